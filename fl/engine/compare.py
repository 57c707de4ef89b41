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

``comparison.json`` (:func:`run_comparison`) is
:meth:`~fedlap_privacy.fl.engine.compare_records.Comparison.to_json`: a row per method, a cell
per budget, each run and a summary per round count
(:mod:`~fedlap_privacy.fl.engine.compare_records`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

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
from fedlap_privacy.fl.engine.compare_records import (
    Comparison,
    ComparisonCell,
    ComparisonRun,
    MethodRow,
    RoundsResult,
)
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

__all__ = [
    "COMPARISON",
    "NO_DP",
    "Comparison",
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
) -> Comparison:
    """Train every method at every budget, round count and seed; write and return
    ``comparison.json`` (:class:`Comparison`) and the plots
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
    cells: dict[str, dict[str, list[ComparisonRun]]] = {m: {} for m in methods}
    uploads: dict[str, float | None] = dict.fromkeys(methods)
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
        run = ComparisonRun(
            seed=seed, rounds=job.rounds, test_accuracy=summary.test_accuracy,
            validation_accuracy=summary.validation_accuracy, epsilon=privacy.epsilon,
            accountant=privacy.accountant, epsilon_by_accountant=privacy.epsilon_by_accountant,
            delta=privacy.delta, sigma=privacy.sigma, round_epsilon=privacy.round_epsilon,
            rounds_run=summary.rounds_run, stopped=summary.stopped,
            seconds=time.perf_counter() - started, out=summary.out,
            accuracy_by_round=[h.test_accuracy for h in history],
            epsilon_by_round=[h.epsilon for h in history],
        )
        uploaded = [h.upload_bytes for h in history if h.clients]
        if uploaded:
            uploads[method] = float(np.mean(uploaded))
        cells[method].setdefault(NO_DP if eps is None else f"{eps:g}", []).append(run)
        callback(ComparisonRunEnded(method, eps, run))
    report = Comparison(
        dataset=first.dataset, rounds=counts[-1], round_counts=counts, delta=first.delta,
        eps=[float(e) for e in eps_values], seeds=seeds,
        configs={m: dataclasses.replace(base_for(base, m), rounds=counts[-1]).to_dict()
                 for m in methods},
        methods={m: MethodRow(METHOD_TABLE[m].notion.value, uploads[m],
                              {b: ComparisonCell.of(runs, counts[-1])
                               for b, runs in cells[m].items()})
                 for m in methods},
        seconds=time.perf_counter() - t0,
    )
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / COMPARISON, json.dumps(report.to_json(), indent=2) + "\n")
    plot_comparison(report, out / "accuracy_vs_epsilon.png")
    plot_rounds(report, out / "accuracy_vs_round.png")
    plot_round_counts(report, out / "accuracy_vs_rounds.png")
    return report

