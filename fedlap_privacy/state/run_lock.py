"""One writer per run folder: an exclusive lock held for the whole run, and a folder only its
owner can change.

Two processes that train into one run folder lose privacy spent: each composes its own
ledger from the same checkpoint, so the folder records fewer rounds than touched the data
(two ``train`` on one new ``--out``; two ``--resume`` at once, e.g. a job scheduler that
restarts a job whose first copy is still alive). :func:`lock_run_folder` is the one place
that prevents it. Before anything of the run is read, it

* refuses a folder that is a symbolic link or a file, or that is owned by another user or
  writable by its group or by others (they could delete or rename the run's files, the
  ledger among them): checked on the opened folder (``O_NOFOLLOW``, ``fstat``), not on a
  name that could be swapped afterwards;
* takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on :data:`LOCK_FILE` inside it (created with mode
  0600 and ``O_NOFOLLOW``), and refuses with one line (:class:`RunBusyError`, exit 2) if
  another process holds it. The kernel releases the lock when the holder exits or dies,
  so a crashed run never leaves a stale lock; the file itself stays (removing a lock file
  others may be waiting on would let two writers in).

The holder writes ``PID TOKEN`` into the lock file. A process started on the holder's behalf
(the Flower ServerApp, launched by ``train --engine flower`` which holds the lock) passes the
token as ``inherit`` and works under the holder's lock instead of being refused.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
from pathlib import Path
from types import TracebackType

from fedlap_privacy.errors import ConfigError, FedlapError

__all__ = ["LOCK_FILE", "RunBusyError", "RunLock", "check_folder_stat", "lock_run_folder"]

#: the lock file inside a run folder
LOCK_FILE = "run.lock"
#: a created run folder's mode (before the umask): the owner alone may change it
FOLDER_MODE = 0o755


class RunBusyError(FedlapError):
    """Another process holds the run folder (it trains or resumes the same run)."""


class RunLock:
    """The exclusive lock on one run folder (:func:`lock_run_folder`); a context manager that
    releases it on exit. ``inherited``: the lock is held by the process that started this one
    (token given), not by this process."""

    def __init__(self, folder: Path, fd: int | None, token: str) -> None:
        self.folder = folder
        self.token = token
        self._fd = fd

    @property
    def inherited(self) -> bool:
        return self._fd is None

    def covers(self, folder: str | Path) -> bool:
        """Whether ``folder`` is the folder this lock holds."""
        try:
            return os.path.samefile(self.folder, folder)
        except OSError:
            return False

    def release(self) -> None:
        """Release the lock (closing the file releases the flock); idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def check_folder_stat(folder: Path, info: os.stat_result) -> None:
    """Refuse a run folder that is not a folder, is owned by another user, or is writable by
    its group or by others (``info``: its ``lstat`` / ``fstat``)."""
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(f"run folder {folder} is a symbolic link: give a real folder")
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"run folder {folder} is a file, not a folder")
    if info.st_uid != os.geteuid():
        raise ConfigError(f"run folder {folder} belongs to another user (uid {info.st_uid}): "
                          "they could delete or rename its ledger; use a folder of your own")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"run folder {folder} is writable by its group or by others (mode "
                          f"{stat.S_IMODE(info.st_mode):o}): they could delete or rename its "
                          f"ledger; chmod go-w {folder}")


def _holder(fd: int) -> tuple[str, str]:
    """(pid, token) the holder wrote into the lock file ('?' where unreadable)."""
    try:
        words = os.pread(fd, 200, 0).decode("ascii", "replace").split()
    except OSError:
        words = []
    pid = words[0] if words and words[0].isdigit() else "?"
    return pid, words[1] if len(words) > 1 else "?"


def lock_run_folder(folder: str | Path, *, create: bool = False,
                    inherit: str | None = None) -> RunLock:
    """Check and exclusively lock the run folder ``folder`` (module docstring).

    ``create``: make the folder (mode 0755 less the umask, parents as needed) when it does
    not exist. ``inherit``: the token of a holder this process works for. Raises
    :class:`~fedlap_privacy.errors.ConfigError` for a folder that may not hold a run and
    :class:`RunBusyError` when another process holds it.
    """
    folder = Path(folder)
    try:
        check_folder_stat(folder, folder.lstat())
    except FileNotFoundError:
        if not create:
            raise ConfigError(f"no run folder {folder}") from None
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            folder.mkdir(mode=FOLDER_MODE)
        except FileExistsError:
            pass  # made meanwhile: checked below like any other
        except OSError as exc:
            raise ConfigError(f"cannot create run folder {folder}: {exc.strerror}") from None
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        dir_fd = os.open(folder, flags)
    except OSError as exc:
        if folder.is_symlink():
            raise ConfigError(f"run folder {folder} is a symbolic link: give a real "
                              "folder") from None
        raise ConfigError(f"cannot open run folder {folder}: {exc.strerror}") from None
    try:
        check_folder_stat(folder, os.fstat(dir_fd))
        try:
            fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=dir_fd)
        except OSError as exc:
            raise ConfigError(f"cannot open {folder / LOCK_FILE} ({exc.strerror}): a run "
                              "folder's lock must be a plain file of yours") from None
    finally:
        os.close(dir_fd)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise ConfigError(f"{folder / LOCK_FILE} is not a plain file of yours")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, token = _holder(fd)
        os.close(fd)
        if inherit and token == inherit:
            return RunLock(folder, None, token)
        raise RunBusyError(f"another process (pid {pid}) holds the run in {folder}: it is "
                           "training or resuming it; wait for it to end (two writers would "
                           "lose privacy spent)") from None
    token = secrets.token_hex(16)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {token}\n".encode("ascii"), 0)
    return RunLock(folder, fd, token)
