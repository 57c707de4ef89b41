"""Errors a user can cause and fix. The CLI prints them as one line and exits non-zero."""


class FedlapError(Exception):
    """Base class of every user-facing error of fedlap-privacy."""


class ConfigError(FedlapError, ValueError):
    """An argument or configuration value is impossible (names the offending value)."""


class DataError(FedlapError):
    """A dataset file is missing, corrupt, or of the wrong format (names the file)."""


class MissingDataError(DataError):
    """A built-in dataset's files are not there (``--download`` fetches them)."""


class CheckpointError(FedlapError):
    """A checkpoint is missing, not a fedlap-privacy checkpoint, or unsafe to load."""
