"""What a comparison (:func:`~fedlap_privacy.fl.engine.compare.run_comparison`) returns, as
typed records; :meth:`Comparison.to_json` is ``comparison.json``.

A :class:`Comparison` holds one :class:`MethodRow` per method, which holds one
:class:`ComparisonCell` per budget (a target epsilon as ``"3"``, or ``"non-private"``), which
holds every :class:`ComparisonRun` of that method and budget and one :class:`RoundsResult`
per round count. A cell's ``mean`` / ``std`` / ``mean_by_round`` are those of its largest
round count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlap_privacy.state.jsonsafe import json_safe

__all__ = ["Comparison", "ComparisonCell", "ComparisonRun", "MethodRow", "RoundsResult"]


@dataclass(frozen=True)
class ComparisonRun:
    """One run of a comparison, as its folder's summary and history report it."""

    seed: int
    #: the rounds the run was planned for and budgeted over
    rounds: int
    test_accuracy: float | None
    #: with ``--set validation_records=N``: accuracy on the held-out training records
    #: (private data: from the run's ``private.pt``, never in its ``ckpt.pt``)
    validation_accuracy: float | None
    epsilon: float | None
    #: the accountant that planned sigma and reports epsilon, and the run's epsilon by
    #: every accountant (RDP's Theorem 5.8 figure beside PLD's)
    accountant: str | None
    epsilon_by_accountant: dict[str, float] | None
    delta: float | None
    sigma: float | None
    round_epsilon: float | None
    rounds_run: int
    stopped: str
    seconds: float
    out: str | None
    #: per round: how accuracy grows while the run spends its budget (a run planned for R
    #: rounds spends less than its target before round R)
    accuracy_by_round: list[float | None]
    epsilon_by_round: list[float | None]


@dataclass(frozen=True)
class RoundsResult:
    """One cell (method, budget) of a comparison at one round count: the final test accuracy
    and the reported epsilon of its runs, mean and population standard deviation over seeds.
    ``epsilon_*`` / ``sigma_mean`` are None where a run has none (non-private; sigma: methods
    without Gaussian noise)."""

    rounds: int
    seeds: list[int]
    mean: float
    std: float
    epsilon_mean: float | None
    epsilon_std: float | None
    sigma_mean: float | None
    #: mean accuracy after each round (over the runs that reached it)
    mean_by_round: list[float]
    #: mean accuracy on the runs' validation split (None without ``validation_records``)
    validation_mean: float | None = None

    @classmethod
    def of(cls, rounds: int, runs: list[ComparisonRun]) -> RoundsResult:
        """The summary of ``runs``, all planned for ``rounds``."""
        accs = [r.test_accuracy for r in runs]
        eps = [r.epsilon for r in runs]
        sigmas = [r.sigma for r in runs]
        validation = [r.validation_accuracy for r in runs]
        known = None not in eps
        return cls(
            rounds=rounds,
            seeds=[r.seed for r in runs],
            mean=float(np.mean(accs)),
            std=float(np.std(accs)),
            epsilon_mean=float(np.mean(eps)) if known else None,
            epsilon_std=float(np.std(eps)) if known else None,
            sigma_mean=float(np.mean(sigmas)) if None not in sigmas else None,
            mean_by_round=_mean_by_round([r.accuracy_by_round for r in runs]),
            validation_mean=float(np.mean(validation)) if None not in validation else None,
        )


@dataclass(frozen=True)
class ComparisonCell:
    """Every run of one method at one budget, summarised per round count (``by_rounds``,
    ascending); ``mean`` / ``std`` / ``mean_by_round`` are those of the runs planned for the
    comparison's largest count."""

    runs: list[ComparisonRun]
    by_rounds: list[RoundsResult]
    mean: float
    std: float
    mean_by_round: list[float]

    @classmethod
    def of(cls, runs: list[ComparisonRun], last: int) -> ComparisonCell:
        """The cell of ``runs``; ``last``: the comparison's largest round count."""
        by_count: dict[int, list[ComparisonRun]] = {}
        for run in runs:
            by_count.setdefault(run.rounds, []).append(run)
        results = [RoundsResult.of(r, mine) for r, mine in sorted(by_count.items())]
        final = next((r for r in results if r.rounds == last), results[-1])
        return cls(list(runs), results, final.mean, final.std, final.mean_by_round)

    def to_json(self) -> dict[str, Any]:
        return {"runs": [dataclasses.asdict(r) for r in self.runs],
                "by_rounds": [dataclasses.asdict(r) for r in self.by_rounds],
                "mean": self.mean, "std": self.std, "mean_by_round": self.mean_by_round}


@dataclass(frozen=True)
class MethodRow:
    """One method of a comparison: its privacy notion, the mean upload of one client in one
    round (None: no round uploaded) and a cell per budget."""

    notion: str
    upload_bytes: float | None
    results: dict[str, ComparisonCell]


@dataclass(frozen=True)
class Comparison:
    """A comparison's result. ``rounds``: its largest round count (usually the only one);
    ``round_counts``: all of them, ascending; ``configs``: each method's base configuration
    (a run's own is in its folder); ``seconds``: the comparison's wall-clock time."""

    dataset: str
    rounds: int
    round_counts: list[int]
    delta: float
    eps: list[float]
    seeds: int
    configs: dict[str, dict[str, Any]]
    methods: dict[str, MethodRow]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        """``comparison.json``: plain JSON values (non-finite numbers as null)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["methods"] = {
            m: {"notion": row.notion, "upload_bytes": row.upload_bytes,
                "results": {b: cell.to_json() for b, cell in row.results.items()}}
            for m, row in self.methods.items()
        }
        return json_safe(out)


def _mean_by_round(curves: list[list[float | None]]) -> list[float]:
    """Mean accuracy after each round over the runs that reached it."""
    longest = max((len(c) for c in curves), default=0)
    return [float(np.mean([c[i] for c in curves if len(c) > i])) for i in range(longest)]
