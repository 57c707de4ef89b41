"""Methods side by side at matched privacy budgets: the shape of the paper's Table 2, and
accuracy against the number of rounds at matched epsilon (the paper's round-efficiency claim:
FedLAP-DP ahead of DP-FedAvg after 1 and 3 rounds at the same epsilon;
docs/algorithms.md#published-results).

For every target epsilon (at one delta) and every round count R each method is configured so
that its accountant reports that epsilon after R rounds, with every other setting (split,
model, seed) shared; each R gets its own budget (a 1-round run at epsilon 3 has a much
smaller sigma than a 10-round run at epsilon 3):

* record-level methods with a fixed T (FedLAP-DP, DP-FedAvg, DP-FedProx): sigma planned for
  the R rounds (Theorem 5.8, docs/accounting.md#theorem-58);
* ALI-DPFL: the budget is its (epsilon, delta) and sigma is DP-FedAvg's planned sigma, so it
  spends the same noise differently (tau per round, docs/algorithms.md#other-methods);
* DP-NormFedAvg: sigma planned for the client-level SGM (docs/accounting.md#client-level-dp)
  — a different notion;
* LDP-FL: per-weight epsilon per round = target / R, so the per-weight composition is
  the target (docs/accounting.md#local-dp) — a different, much weaker notion for the whole
  model;
* non-private methods run once per seed and round count, as the reference column.

Epsilons of different notions are not comparable; the table says which notion each row has.
Every run is a normal ``train`` output directory under ``OUT/runs`` (checkpoint, metrics,
ledger), so any of them can be audited; a comparison re-run resumes runs already there. A
comparison sent SIGTERM from the command line stops between two rounds of its current run
(:mod:`fedlap_privacy.fl.engine.stop`) and raises
:class:`~fedlap_privacy.fl.engine.stop.StopRequested`; running it again resumes.
With one round count a run is ``OUT/runs/METHOD-BUDGET-seedS`` (the layout of earlier
comparisons, which keep resuming); with several it is ``OUT/runs/METHOD-BUDGET-roundsR-seedS``,
so going from one count to several in the same ``OUT`` trains the runs again.

Each method starts from its own base configuration, resolved as ``train`` resolves it
(:func:`method_bases`): FedLAP-DP gets its schedule by client size
(:mod:`~fedlap_privacy.fl.methods.schedule`), the baselines keep their defaults.

Every run of a comparison holds the same records (:func:`comparison_split_seed`): the split
seed set with ``--set split_seed=N`` (declared public), else ONE secret split seed for the
comparison, kept only in its runs' ``private.pt`` and read back from there when the
comparison resumes.

``comparison.json`` (:func:`run_comparison`): ``configs`` holds each method's base
configuration; ``rounds`` is the largest round count (the only one, usually) and
``round_counts`` all of them, ascending. Each cell (method, budget) of
``methods[m]["results"]`` holds ``runs`` (every run, each with its planned ``rounds``),
``mean`` / ``std`` / ``mean_by_round`` of the runs planned for ``rounds``, and ``by_rounds``:
one :class:`RoundsResult` per round count.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.config_rules import METHODS
from fedlap_privacy.fl.engine.compare_budgets import (
    NO_DP,
    Bases,
    base_for,
    bases_by_rounds,
    budget_config,
    check_methods,
    check_overrides,
    method_bases,
    round_counts,
)
from fedlap_privacy.fl.engine.compare_plots import plot_comparison, plot_round_counts, plot_rounds
from fedlap_privacy.fl.engine.events import (
    ComparisonCallback,
    ComparisonRunEnded,
    ComparisonRunStarted,
    ComparisonStarted,
)
from fedlap_privacy.fl.engine.stop import STOPPED, StopRequested
from fedlap_privacy.fl.methods.method_table import METHOD_TABLE, Budget
from fedlap_privacy.fl.run.run_files import (
    holds_run,
    load_history,
    load_private,
    load_run_config,
    lock_run,
)
from fedlap_privacy.fl.run.run_records import RunSummary
from fedlap_privacy.state.atomic import write_text_atomic
from fedlap_privacy.state.jsonsafe import json_safe

__all__ = [
    "COMPARISON",
    "NO_DP",
    "Job",
    "RoundsResult",
    "bases_by_rounds",
    "budget_config",
    "check_overrides",
    "comparison_split_seed",
    "method_bases",
    "plan_jobs",
    "plot_comparison",
    "plot_round_counts",
    "plot_rounds",
    "round_counts",
    "run_comparison",
    "run_dir",
]

COMPARISON = "comparison.json"

def comparison_split_seed(base: Bases, out_dir: str | Path) -> int:
    """The split seed every run of the comparison in ``out_dir`` shares: ``split_seed`` of
    the configuration when set (public), else the secret one of the runs already in
    ``OUT/runs`` (a resumed comparison), else a fresh secret. Refuses runs on different
    splits, or from before split seeds (their split followed from each run's seed)."""
    from fedlap_privacy.fl.run.randomness import secret_seed

    explicit = {b.split_seed for b in (base.values() if isinstance(base, Mapping) else [base])}
    if explicit != {None}:
        if len(explicit) > 1:
            raise ConfigError("the methods of a comparison must share one split_seed")
        (seed,) = explicit
        assert seed is not None
        return seed
    found: dict[int, Path] = {}
    runs = Path(out_dir) / "runs"
    for run_dir in sorted(runs.iterdir() if runs.is_dir() else []):
        if not holds_run(run_dir):
            continue
        saved = load_private(run_dir)
        if saved.split_seed is None:
            raise ConfigError(f"{run_dir} was split by its own seed (an earlier version): "
                              "its methods are not on one split; pick another --out")
        found.setdefault(saved.split_seed, run_dir)
    if len(found) > 1:
        first, second = list(found.values())[:2]
        raise ConfigError(f"{first} and {second} hold different splits: pick another --out")
    return next(iter(found)) if found else secret_seed()


@dataclass(frozen=True)
class Job:
    """One run of a comparison: ``method`` at target ``eps`` (None: non-private) planned for
    ``rounds`` rounds, with ``seed``; ``config`` is :func:`budget_config`'s for that."""

    method: str
    eps: float | None
    rounds: int
    seed: int
    config: TrainConfig


def run_dir(out: Path, job: Job, several_counts: bool) -> Path:
    """``OUT/runs/METHOD-BUDGET[-roundsR]-seedS``: the round count only with several counts,
    so a one-count comparison keeps the layout (and resumes the runs) of earlier versions."""
    budget = "nodp" if job.eps is None else f"eps{job.eps:g}"
    rounds = f"-rounds{job.rounds}" if several_counts else ""
    return out / "runs" / f"{job.method}-{budget}{rounds}-seed{job.seed}"


def _train_or_resume(cfg: TrainConfig, run_dir: Path, device: str, split_seed: int
                     ) -> RunSummary:
    """Train into ``run_dir`` on the comparison's split; if it holds this very
    configuration already, resume it (on its own split: :func:`comparison_split_seed`
    checked that it is the comparison's). The run folder's lock is held from before the
    folder is read until the run returns, so a second comparison on the same ``OUT`` is
    refused at the run the first one holds."""
    from fedlap_privacy.fl.engine.simulation import resume, train

    with lock_run(run_dir, new=True) as lock:
        if not holds_run(run_dir):
            return train(cfg, run_dir, device, split_seed=split_seed, lock=lock).summary
        saved = load_run_config(run_dir).to_dict()
        planned = (dict(cfg.to_dict(), sigma=saved.get("sigma")) if cfg.sigma is None
                   else cfg.to_dict())
        if saved != planned:
            raise ConfigError(f"{run_dir} holds a run with other settings: pick another --out")
        return resume(run_dir, device=device, lock=lock, model=cfg.model).summary


def plan_jobs(
    base: Bases,
    eps_values: list[float],
    methods: list[str] | tuple[str, ...] = METHODS,
    seeds: int = 1,
    rounds: Sequence[int] | None = None,
    by_rounds: Mapping[int | None, Bases] | None = None,
    split_seed: int | None = None,
) -> list[Job]:
    """Every run, ordered by method, target epsilon, round count and seed; checks the request.

    ``base``: one configuration, or one per method (:func:`method_bases`). ``rounds``: the
    round counts (None: the base's ``rounds`` alone). ``by_rounds``: the base resolved for
    a round count (:func:`bases_by_rounds`; FedLAP-DP's schedule depends on it), used for
    the counts it holds. Each job's configuration has ``rounds = R`` and its budget planned
    for R rounds by :func:`budget_config`. ``split_seed``: the comparison's
    (:func:`comparison_split_seed`; needed where a budget depends on the client sizes).
    """
    check_methods(methods)
    if not eps_values or any(not (math.isfinite(e) and e > 0) for e in eps_values):
        raise ConfigError("give one or more positive target epsilons, e.g. --eps 3,10")
    if seeds < 1:
        raise ConfigError(f"seeds {seeds} must be >= 1")
    jobs = []
    for method in methods:
        own = base_for(base, method)
        counts = round_counts([own.rounds] if rounds is None else list(rounds))
        for eps in [None] if METHOD_TABLE[method].budget == Budget.NONE else eps_values:
            for r in counts:
                at_r = base_for(by_rounds[r], method) if by_rounds and r in by_rounds else own
                for seed in range(own.seed, own.seed + seeds):
                    cfg = budget_config(dataclasses.replace(at_r, seed=seed, rounds=r), method,
                                        eps, split_seed)
                    jobs.append(Job(method, eps, r, seed, cfg))
    return jobs


@dataclass(frozen=True)
class RoundsResult:
    """One cell (method, budget) of a comparison at one round count: the final test accuracy
    and the reported epsilon of its runs, mean and standard deviation over seeds (population
    sd, as the cell's ``std``). ``epsilon_*`` / ``sigma_mean`` are None where a run has none
    (non-private; sigma: methods without Gaussian noise)."""

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
    def of(cls, rounds: int, runs: list[dict[str, Any]]) -> RoundsResult:
        """The summary of ``runs``, the run records (:func:`run_comparison`) planned for
        ``rounds``."""
        accs = [r["test_accuracy"] for r in runs]
        eps = [r["epsilon"] for r in runs]
        sigmas = [r["sigma"] for r in runs]
        validation = [r.get("validation_accuracy") for r in runs]
        known = None not in eps
        return cls(
            rounds=rounds,
            seeds=[r["seed"] for r in runs],
            mean=float(np.mean(accs)),
            std=float(np.std(accs)),
            epsilon_mean=float(np.mean(eps)) if known else None,
            epsilon_std=float(np.std(eps)) if known else None,
            sigma_mean=float(np.mean(sigmas)) if None not in sigmas else None,
            mean_by_round=_mean_by_round([r["accuracy_by_round"] for r in runs]),
            validation_mean=float(np.mean(validation)) if None not in validation else None,
        )


def _summarise(cell: dict[str, Any], last: int) -> None:
    """Set ``cell``'s ``by_rounds`` and its ``mean`` / ``std`` / ``mean_by_round`` (those of
    the runs planned for ``last`` rounds) from its ``runs``."""
    by_count: dict[int, list[dict[str, Any]]] = {}
    for run in cell["runs"]:
        by_count.setdefault(run["rounds"], []).append(run)
    results = {r: RoundsResult.of(r, runs) for r, runs in sorted(by_count.items())}
    cell["by_rounds"] = [dataclasses.asdict(r) for r in results.values()]
    final = results.get(last) or list(results.values())[-1]
    cell["mean"], cell["std"] = final.mean, final.std
    cell["mean_by_round"] = final.mean_by_round


def run_comparison(
    base: Bases,
    eps_values: list[float],
    methods: list[str] | tuple[str, ...] = METHODS,
    seeds: int = 1,
    out_dir: str | Path = "runs/compare",
    device: str = "auto",
    callback: ComparisonCallback | None = None,
    jobs: list[Job] | None = None,
    rounds: Sequence[int] | None = None,
    split_seed: int | None = None,
) -> dict[str, Any]:
    """Train every method at every budget, round count and seed; write and return
    ``comparison.json`` (its fields: the module docstring) and the plots
    ``accuracy_vs_epsilon.png``, ``accuracy_vs_round.png`` and ``accuracy_vs_rounds.png``.

    ``base``: one configuration, or one per method (:func:`method_bases`). ``rounds``: the
    round counts (None: the base's ``rounds`` alone). ``jobs`` (from :func:`plan_jobs` with
    the same arguments and ``split_seed``) skips planning them again. ``split_seed``: the
    comparison's (None: :func:`comparison_split_seed` of ``out_dir``).
    """
    if split_seed is None:
        split_seed = comparison_split_seed(base, out_dir)
    if jobs is None:
        jobs = plan_jobs(base, eps_values, methods, seeds, rounds, split_seed=split_seed)
    first = base_for(base, methods[0])
    counts = sorted({job.rounds for job in jobs}) or [first.rounds]
    out = Path(out_dir)
    callback = callback or (lambda event: None)
    callback(ComparisonStarted(len(jobs), counts))
    t0 = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {
        m: {"notion": METHOD_TABLE[m].notion.value, "upload_bytes": None, "results": {}}
        for m in methods
    }
    for job in jobs:
        method, eps, seed = job.method, job.eps, job.seed
        callback(ComparisonRunStarted(method, eps, job.rounds, seed))
        started = time.perf_counter()
        folder = run_dir(out, job, len(counts) > 1)
        summary = _train_or_resume(job.config, folder, device, split_seed)
        if summary.stopped == STOPPED:
            raise StopRequested(
                f"stopped on request after round {summary.rounds_run} of {job.rounds} of "
                f"{folder}; the same command resumes the comparison")
        history = load_history(folder)
        privacy = summary.privacy
        run = {
            "seed": seed,
            "rounds": job.rounds,  # planned for (and budgeted over) this many rounds
            "test_accuracy": summary.test_accuracy,
            # with --set validation_records=N: accuracy on the held-out training records
            # (private data: from the run's private.pt, never in its ckpt.pt)
            "validation_accuracy": summary.validation_accuracy,
            "epsilon": privacy.epsilon,
            # the accountant that planned sigma and reports epsilon (PLD by default), and
            # the run's epsilon by every accountant (RDP's Theorem 5.8 figure beside it)
            "accountant": privacy.accountant,
            "epsilon_by_accountant": privacy.epsilon_by_accountant,
            "delta": privacy.delta,
            "sigma": privacy.sigma,
            "round_epsilon": privacy.round_epsilon,
            "rounds_run": summary.rounds_run,
            "stopped": summary.stopped,
            "seconds": time.perf_counter() - started,
            "out": summary.out,
            # per round: how accuracy grows while the run spends its budget (a run planned
            # for R rounds spends less than its target before round R)
            "accuracy_by_round": [h.test_accuracy for h in history],
            "epsilon_by_round": [h.epsilon for h in history],
        }
        row = rows[method]
        uploads = [h.upload_bytes for h in history if h.clients]
        if uploads:
            row["upload_bytes"] = float(np.mean(uploads))
        cell = row["results"].setdefault(NO_DP if eps is None else f"{eps:g}", {"runs": []})
        cell["runs"].append(run)
        callback(ComparisonRunEnded(method, eps, run))
    for row in rows.values():
        for cell in row["results"].values():
            _summarise(cell, counts[-1])
    report = {
        "dataset": first.dataset,
        "rounds": counts[-1],
        "round_counts": counts,
        "delta": first.delta,
        "eps": [float(e) for e in eps_values],
        "seeds": seeds,
        # each method's base (FedLAP-DP's schedule keys are its own); a run's is in its folder
        "configs": {m: dataclasses.replace(base_for(base, m), rounds=counts[-1]).to_dict()
                    for m in methods},
        "methods": rows,
        "seconds": time.perf_counter() - t0,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / COMPARISON, json.dumps(json_safe(report), indent=2) + "\n")
    plot_comparison(report, out / "accuracy_vs_epsilon.png")
    plot_rounds(report, out / "accuracy_vs_round.png")
    plot_round_counts(report, out / "accuracy_vs_rounds.png")
    return report


def _mean_by_round(curves: list[list[float]]) -> list[float]:
    """Mean accuracy after each round over the runs that reached it."""
    longest = max((len(c) for c in curves), default=0)
    return [float(np.mean([c[i] for c in curves if len(c) > i])) for i in range(longest)]
