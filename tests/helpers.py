"""Plain helpers the tests import (pyproject.toml puts this folder on the path)."""

from __future__ import annotations

from pathlib import Path


def save_run_files(
    checkpoint: Path, release: dict, client_indices: list, data_dir: str | None = None
) -> Path:
    """A hand-made run folder for the audit: ``checkpoint`` (the releasable part) and the
    ``private.pt`` beside it with the member indices and the data folder."""
    from fedlap_privacy.checkpoint import PRIVATE, PRIVATE_FORMAT, save_checkpoint

    save_checkpoint(checkpoint, release)
    private = {"client_indices": client_indices, "config": {"data_dir": data_dir}}
    save_checkpoint(checkpoint.parent / PRIVATE, private, PRIVATE_FORMAT)
    return checkpoint
