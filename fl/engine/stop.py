"""Stop an in-process run between rounds (SIGTERM), so that no round is charged untrained.

A round is entered in the privacy ledger before it touches private data, and a run killed
inside a round is charged for that round on resume
(:func:`fedlap_privacy.fl.engine.simulation.resume`) although it never trained on it. A batch system
(SLURM, Kubernetes) or a user who must stop a long run sends SIGTERM instead: inside
:func:`stop_between_rounds` the signal only sets a flag, the round under way finishes and is
checkpointed, and the run stops before the next round with ``stopped`` = :data:`STOPPED`. Resuming
it (``train --resume``, or the same ``compare`` command again) continues from there: nothing is
charged twice or lost. Ctrl-C (SIGINT) still stops at once.

The flag is process-wide: every run of a ``compare`` stops, and ``compare`` reports the stop
(:class:`StopRequested`) instead of tabulating unfinished runs.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from fedlap_privacy.errors import FedlapError

__all__ = [
    "STOPPED",
    "STOP_EXIT_CODE",
    "StopRequested",
    "request_stop",
    "stop_between_rounds",
    "stop_requested",
]

#: the ``stopped`` reason of a run that stopped on request
STOPPED = "stop requested (SIGTERM); resume to continue"
#: the exit status of a command that stopped on request (128 + SIGTERM, as a shell reports)
STOP_EXIT_CODE = 128 + signal.SIGTERM

_requested = threading.Event()


class StopRequested(FedlapError):
    """A run stopped between rounds on request; resuming it continues."""


def request_stop() -> None:
    """Ask the runs of this process to stop before their next round."""
    _requested.set()


def stop_requested() -> bool:
    return _requested.is_set()


@contextmanager
def stop_between_rounds() -> Iterator[None]:
    """Within the block, SIGTERM asks for a stop before the next round instead of killing the
    process. The handler is installed from the main thread only (elsewhere only
    :func:`request_stop` asks); the flag is clear on entry and on exit, and the previous
    handler is restored."""
    _requested.clear()
    main = threading.current_thread() is threading.main_thread()

    def handler(signum: int, frame: FrameType | None) -> None:
        request_stop()

    previous = signal.signal(signal.SIGTERM, handler) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        _requested.clear()
