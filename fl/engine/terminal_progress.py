"""Progress of a run started from Python (:func:`fedlap_privacy.fl.train`), in a terminal.

The command line shows a live bar; a script or notebook that calls ``train(TrainConfig(...))``
without a ``callback`` gets one line per round on stderr instead (and the run's warnings),
when stderr is a terminal or when asked with ``progress=True``; ``progress=False`` keeps it
silent. Lines, not a redrawn bar: they read the same in a terminal, a log and a notebook.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from fedlap_privacy.fl.engine.training_run import Callback

__all__ = ["progress_callback"]


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


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

    def on_event(event: str, info: dict[str, Any]) -> None:
        if event == "start":
            cfg = info["config"]
            rounds[0] = cfg["rounds"]
            sigma = "" if info["sigma"] is None else f", sigma {info['sigma']:.4g}"
            start = "" if info["start_round"] == 1 else f", from round {info['start_round']}"
            say(f"training {cfg['method']} on {cfg['dataset']}: {cfg['rounds']} rounds, "
                f"{cfg['clients']} clients{sigma}{start}")
        elif event == "warning":
            say(f"warning: {info['message']}")
        elif event == "estimate" and info["long"]:
            say(f"note: a round will take about {_duration(info['round_s'])}, the run about "
                f"{_duration(info['run_s'])}")
        elif event == "round_end":
            eps = info.get("epsilon")
            say(f"round {info['round']}/{rounds[0]}: test accuracy "
                f"{info['test_accuracy']:.2%}, epsilon "
                f"{'-' if eps is None else f'{eps:.3f}'} "
                f"({_duration(time.perf_counter() - began)} so far)")

    return on_event
