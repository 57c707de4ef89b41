"""What a run reports while it runs: one frozen record per event, passed to the
``callback`` of :func:`~fedlap_privacy.fl.engine.simulation.train` and ``resume`` and of the
Flower runners (:data:`RunEvent`), and of
:func:`~fedlap_privacy.fl.engine.compare.run_comparison` (:data:`ComparisonEvent`). A callback
tells them apart by type (``isinstance`` or ``match``); a run's events come in the order of
:data:`RunEvent`'s members, the round's ones repeating."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedlap_privacy.fl.config import TrainConfig
    from fedlap_privacy.fl.engine.compare_records import ComparisonRun
    from fedlap_privacy.fl.run.run_records import RoundRecord
    from fedlap_privacy.state.run_state import ValidationScore

__all__ = [
    "Callback",
    "ClientDone",
    "ClientStep",
    "ComparisonCallback",
    "ComparisonEvent",
    "ComparisonRunEnded",
    "ComparisonRunStarted",
    "ComparisonStarted",
    "RoundEnded",
    "RoundEstimate",
    "RoundStarted",
    "RunEvent",
    "RunStarted",
    "RunWarning",
]


@dataclass(frozen=True)
class RunStarted:
    """The run starts (or resumes) at ``start_round`` with ``config`` (its sigma planned)."""

    config: TrainConfig
    start_round: int


@dataclass(frozen=True)
class RunWarning:
    """A one-line warning about the run's configuration (printed before round 1)."""

    message: str


@dataclass(frozen=True)
class RoundEstimate:
    """Before round 1: one access to the private data timed, times T ``accesses`` per
    client, times the ``clients`` expected in a round; ``long`` past
    :data:`~fedlap_privacy.fl.engine.progress.LONG_ROUND_S`."""

    access_s: float
    accesses: int
    clients: float
    round_s: float
    run_s: float
    long: bool


@dataclass(frozen=True)
class RoundStarted:
    round: int


@dataclass(frozen=True)
class ClientStep:
    """Step ``step`` of ``steps`` of the client at ``position`` (0-based, in the order the
    driver runs them) of the round's ``clients``; ``cohort``: every client of the round
    did that step at once (``client`` None). ``round_estimate_s``: the elapsed seconds over
    the fraction of the round's steps done."""

    round: int
    client: int | None
    position: int
    clients: int
    step: int
    steps: int
    elapsed_s: float
    round_estimate_s: float
    cohort: bool = False


@dataclass(frozen=True)
class ClientDone:
    round: int
    client: int


@dataclass(frozen=True)
class RoundEnded:
    """A round ended: its metrics as ``metrics.jsonl`` records them, and its score on the
    validation hold-out of private records when the run keeps one (the owner's view)."""

    record: RoundRecord
    validation: ValidationScore | None = None

    @property
    def round(self) -> int:
        return self.record.round


RunEvent = (RunStarted | RunWarning | RoundEstimate | RoundStarted | ClientStep | ClientDone
            | RoundEnded)


@dataclass(frozen=True)
class ComparisonStarted:
    runs: int
    round_counts: list[int]


@dataclass(frozen=True)
class ComparisonRunStarted:
    method: str
    eps: float | None
    rounds: int
    seed: int


@dataclass(frozen=True)
class ComparisonRunEnded:
    """One run of the comparison ended; ``run``: its entry in ``comparison.json``."""

    method: str
    eps: float | None
    run: ComparisonRun


ComparisonEvent = ComparisonStarted | ComparisonRunStarted | ComparisonRunEnded
#: what a run reports to
Callback = Callable[[RunEvent], None]
#: what a comparison reports to
ComparisonCallback = Callable[[ComparisonEvent], None]
