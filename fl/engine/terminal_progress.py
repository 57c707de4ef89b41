"""Progress of a run started from Python (:func:`fedlap_privacy.fl.train`), in a terminal.

The command line shows a live bar; a script or notebook that calls ``train(TrainConfig(...))``
without a ``callback`` gets one line per round on stderr instead (and the run's warnings),
when stderr is a terminal or when asked with ``progress=True``; ``progress=False`` keeps it
silent. Lines, not a redrawn bar: they read the same in a terminal, a log and a notebook.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from fedlap_privacy.fl.engine.events import (
    Callback,
    RoundEnded,
    RoundEstimate,
    RunEvent,
    RunStarted,
    RunWarning,
)

__all__ = ["duration", "progress_callback"]


def duration(seconds: float) -> str:
    """A duration in words: 42 s, 3.5 min, 2.1 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def progress_callback(progress: bool | None, callback: Callback | None,
                      stream: TextIO | None = None) -> Callback | None:
    """The callback a run reports to: the caller's ``callback`` when given, else the line
    printer below when ``progress`` is True, or None (the default) and ``stream`` (stderr)
    is a terminal; else None (silent)."""
    stream = sys.stderr if stream is None else stream
    if callback is not None or progress is False:
        return callback
    if progress is None and not (hasattr(stream, "isatty") and stream.isatty()):
        return None
    began = time.perf_counter()
    rounds = [0]

    def say(text: str) -> None:
        print(text, file=stream, flush=True)

    def on_event(event: RunEvent) -> None:
        if isinstance(event, RunStarted):
            cfg = event.config
            rounds[0] = cfg.rounds
            sigma = "" if cfg.sigma is None else f", sigma {cfg.sigma:.4g}"
            start = "" if event.start_round == 1 else f", from round {event.start_round}"
            say(f"training {cfg.method} on {cfg.dataset}: {cfg.rounds} rounds, "
                f"{cfg.clients} clients{sigma}{start}")
        elif isinstance(event, RunWarning):
            say(f"warning: {event.message}")
        elif isinstance(event, RoundEstimate) and event.long:
            say(f"note: a round will take about {duration(event.round_s)}, the run about "
                f"{duration(event.run_s)}")
        elif isinstance(event, RoundEnded):
            r = event.record
            say(f"round {r.round}/{rounds[0]}: test accuracy {r.test_accuracy:.2%}, epsilon "
                f"{'-' if r.epsilon is None else f'{r.epsilon:.3f}'} "
                f"({duration(time.perf_counter() - began)} so far)")

    return on_event
