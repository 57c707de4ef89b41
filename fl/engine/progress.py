"""Progress inside a client's step, and the time a round will take.

A FedLAP-DP client of the large schedule runs for minutes; a progress display that moves
only when a client is done looks stuck. A method's inner loop calls :func:`report_step`
after each of its T accesses to the private data (step t of T); the driver installs a
reporter around each client's step with :func:`reporting` (a context variable, so the
methods' signatures, shared with the Flower client, do not change, and nothing is reported
where no driver listens). :class:`RoundClock` turns the steps into the driver's
:class:`~fedlap_privacy.fl.engine.events.ClientStep` event: the client, step t of T, the
seconds since the round began and an estimate of the whole round's seconds from the steps
done so far. The methods never print.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

from fedlap_privacy.fl.engine.events import ClientStep

__all__ = ["LONG_ROUND_S", "RoundClock", "StepReporter", "report_step", "reporting"]

#: a round estimated to take longer than this (seconds) is announced before round 1
LONG_ROUND_S = 300.0

#: receives (t, T): step t of the T steps of the client's round is done
StepReporter = Callable[[int, int], None]

_REPORTER: ContextVar[StepReporter | None] = ContextVar("fedlap_step_reporter", default=None)


def report_step(step: int, steps: int) -> None:
    """Step ``step`` of ``steps`` of the current client is done (no-op without a reporter)."""
    reporter = _REPORTER.get()
    if reporter is not None:
        reporter(step, steps)


@contextlib.contextmanager
def reporting(reporter: StepReporter) -> Iterator[None]:
    """Send the steps reported inside the block to ``reporter``."""
    token = _REPORTER.set(reporter)
    try:
        yield
    finally:
        _REPORTER.reset(token)


@dataclass
class RoundClock:
    """The steps of one round's ``clients`` clients, each at most ``steps`` steps, in turn.

    :meth:`step` gives the :class:`ClientStep` event of client number ``position`` (0-based, in
    the order the driver runs them): its step t of T, the round's elapsed seconds and
    ``round_estimate_s``, the elapsed time over the fraction of the round's steps done
    (clients done count T each; a client that stops early, e.g. FedLAP at its radius,
    makes the estimate conservative)."""

    round: int
    clients: int
    start: float = field(default_factory=time.perf_counter)

    def step(self, position: int, client: int, step: int, steps: int) -> ClientStep:
        elapsed = time.perf_counter() - self.start
        done = (position + step / max(steps, 1)) / max(self.clients, 1)
        return ClientStep(self.round, client, position, self.clients, step, steps, elapsed,
                          elapsed / done if done else 0.0)

    def cohort_step(self, step: int, steps: int) -> ClientStep:
        """The event of a cohort trained at once (:mod:`~fedlap_privacy.fl.engine.cohort`):
        all ``clients`` clients did step t of T (``cohort`` True, ``client`` None, position
        0); the estimate is the elapsed time over t / T."""
        elapsed = time.perf_counter() - self.start
        done = step / max(steps, 1)
        return ClientStep(self.round, None, 0, self.clients, step, steps, elapsed,
                          elapsed / done if done else 0.0, cohort=True)
