"""Seconds spent in the named phases of a method's round, for benchmarks and profiling.

A method marks a phase with ``with phase("matching"): ...``; a caller that wants the times
wraps the call in :func:`timing`, which collects them in a :class:`PhaseTimes` (a context
variable, as :mod:`fedlap_privacy.fl.engine.progress` does, so that the methods' signatures do not
change). Outside :func:`timing` a phase costs one context-variable lookup. FedLAP and
FedLAP-DP (:mod:`fedlap_privacy.fl.methods.fedlap`) mark ``real gradients`` (the DP gradients in
FedLAP-DP), ``matching`` and ``local steps`` of a client round.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

__all__ = ["PhaseTimes", "phase", "timing"]


@dataclass
class PhaseTimes:
    """Seconds per phase by ``clock`` (process CPU time by default), summed over the
    phase's occurrences."""

    clock: Callable[[], float] = time.process_time
    seconds: dict[str, float] = field(default_factory=dict)

    def get(self, name: str) -> float:
        return self.seconds.get(name, 0.0)


_TIMES: ContextVar[PhaseTimes | None] = ContextVar("fedlap_phase_times", default=None)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the block's time to phase ``name`` of the enclosing :func:`timing`, if any."""
    times = _TIMES.get()
    if times is None:
        yield
        return
    start = times.clock()
    try:
        yield
    finally:
        times.seconds[name] = times.get(name) + times.clock() - start


@contextlib.contextmanager
def timing(clock: Callable[[], float] = time.process_time) -> Iterator[PhaseTimes]:
    """Collect the phases marked inside the block (nested phases count in both)."""
    times = PhaseTimes(clock)
    token = _TIMES.set(times)
    try:
        yield times
    finally:
        _TIMES.reset(token)
