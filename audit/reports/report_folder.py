"""The folder an audit writes its report into, held open by a descriptor the audit owns.

An audit's ``out`` may lie where another local user can write (a shared ``/tmp``-like folder)
or be mistaken for a training run's folder. :class:`ReportFolder` refuses, in one line, an
``out`` that is a symbolic link, that holds a training run (its checkpoint, private state,
commit record or run lock), that belongs to another user or that every user can write;
otherwise it creates the folder,
opens it with ``O_NOFOLLOW | O_DIRECTORY`` and writes every file relative to that descriptor:
each into a fresh temporary name created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (mode 0600),
flushed and renamed over the target inside the same folder. A link swapped in for the folder
or for a file after the check is never followed, and nothing the audit wrote is read back by
path: a figure is embedded from the bytes it was written from.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from types import TracebackType

from fedlap_privacy.errors import ConfigError

__all__ = ["ReportFolder", "check_report_folder", "figure_png", "run_files"]


def run_files() -> tuple[str, ...]:
    """The files that make a folder a training run's (never an audit's ``out``); imported
    here, not at the top, so that writing a report of scores does not load torch."""
    from fedlap_privacy.state.checkpoint import CHECKPOINT, COMMIT, PRIVATE
    from fedlap_privacy.state.run_lock import LOCK_FILE

    return CHECKPOINT, PRIVATE, COMMIT, LOCK_FILE


def check_report_folder(out: str | Path) -> None:
    """The refusals of :class:`ReportFolder`, asked before any work and creating nothing
    (a folder that does not exist yet passes: it will be created as the user's own)."""
    path = Path(out)
    if path.is_symlink() or path.is_dir():
        ReportFolder(path).close()


class ReportFolder:
    """``out``, checked, created and opened (module docstring); a context manager that
    closes the descriptor. :meth:`write` puts a file into it."""

    def __init__(self, out: str | Path) -> None:
        self.path = Path(out)
        if self.path.is_symlink():
            raise ConfigError(f"the report folder {self.path} is a symbolic link: give the "
                              "folder itself")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                               | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(f"cannot write the audit report to {self.path}: "
                              f"{exc.strerror or exc}") from None
        try:
            self._check()
        except BaseException:
            os.close(self._fd)
            raise

    def _check(self) -> None:
        info = os.fstat(self._fd)
        if info.st_uid != os.geteuid():
            raise ConfigError(f"the report folder {self.path} belongs to another user (uid "
                              f"{info.st_uid}): give a folder of your own")
        if info.st_mode & stat.S_IWOTH:
            raise ConfigError(f"the report folder {self.path} is writable by every user: "
                              "give a folder of your own")
        names = set(os.listdir(self._fd))
        found = sorted(names.intersection(run_files()))
        if found:
            raise ConfigError(f"the report folder {self.path} holds a training run "
                              f"({', '.join(found)}): give the audit a folder of its own")

    def write(self, name: str, data: bytes) -> Path:
        """Replace ``name`` in the folder with ``data`` (module docstring); its path."""
        if "/" in name or name in ("", ".", ".."):
            raise ConfigError(f"not a file name: {name!r}")
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=self._fd)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
            except BaseException:
                os.unlink(tmp, dir_fd=self._fd)
                raise
        except OSError as exc:
            raise ConfigError(f"cannot write the audit report to {self.path}: "
                              f"{exc.strerror or exc}") from None
        return self.path / name

    def write_text(self, name: str, text: str) -> Path:
        """:meth:`write` for UTF-8 text."""
        return self.write(name, text.encode("utf-8"))

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> ReportFolder:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def figure_png(fig: object, dpi: int = 120) -> bytes:
    """A matplotlib figure as PNG bytes (written and embedded from the same bytes)."""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)  # type: ignore[attr-defined]
    return buffer.getvalue()
