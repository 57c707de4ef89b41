"""A second process that holds a run folder's lock, as a concurrent ``train`` / ``--resume``
would: it takes the lock, prints ``PID TOKEN`` and keeps it until its stdin closes or it is
killed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_HOLD = (
    "import sys\n"
    "from fedlap_privacy.state.run_lock import lock_run_folder\n"
    "lock = lock_run_folder(sys.argv[1], create=True)\n"
    "print(lock.token, flush=True)\n"
    "sys.stdin.read()\n"
)


@contextmanager
def lock_held_elsewhere(folder: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """(process, token) of another process holding ``folder``'s lock for the block."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        token = proc.stdout.readline().strip()
        assert token, "the holder could not take the lock"
        yield proc, token
    finally:
        proc.kill()
        proc.wait(timeout=30)
