"""Methods side by side at matched privacy budgets: the shape of the paper's Table 2.

For every target epsilon (at one delta) each method is configured so that its accountant
reports that epsilon after the run, with every other setting (split, model, rounds, seed)
shared:

* record-level methods with a fixed T (FedLAP-DP, DP-FedAvg, DP-FedProx): sigma planned for
  the rounds (Theorem 5.8, docs/accounting.md#theorem-58);
* ALI-DPFL: the budget is its (epsilon, delta) and sigma is DP-FedAvg's planned sigma, so it
  spends the same noise differently (tau per round, docs/algorithms.md#other-methods);
* DP-NormFedAvg: sigma planned for the client-level SGM (docs/accounting.md#client-level-dp)
  — a different notion;
* LDP-FL: per-weight epsilon per round = target / rounds, so the per-weight composition is
  the target (docs/accounting.md#local-dp) — a different, much weaker notion for the whole
  model;
* non-private methods run once per seed, as the reference column.

Epsilons of different notions are not comparable; the table says which notion each row has.
Every run is a normal ``train`` output directory under ``OUT/runs`` (checkpoint, metrics,
ledger), so any of them can be audited; a comparison re-run resumes runs already there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedlap_privacy.atomic import write_figure, write_text_atomic
from fedlap_privacy.checkpoint import CHECKPOINT
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import METHODS, TrainConfig
from fedlap_privacy.fl.method_table import METHOD_TABLE, Budget, method_spec
from fedlap_privacy.fl.run_files import load_run_config
from fedlap_privacy.jsonsafe import json_safe

__all__ = [
    "COMPARISON",
    "budget_config",
    "plan_jobs",
    "plot_comparison",
    "plot_rounds",
    "run_comparison",
]

COMPARISON = "comparison.json"
#: the column of the non-private methods
NO_DP = "non-private"

Callback = Callable[[str, dict[str, Any]], None]


def _client_sizes(cfg: TrainConfig) -> list[int]:
    from fedlap_privacy.data import load_dataset
    from fedlap_privacy.fl.simulation import client_parts

    return [len(p) for p in client_parts(cfg, load_dataset(cfg.dataset, cfg.data_dir))]


def budget_config(base: TrainConfig, method: str, eps: float | None) -> TrainConfig:
    """The configuration of ``method`` that spends ``eps`` (None: the non-private run), by
    the method table's :class:`~fedlap_privacy.fl.method_table.Budget` rule."""
    budget = method_spec(method).budget
    cfg = dataclasses.replace(base, method=method, target_eps=None, ldp_epsilon=None)
    if budget == Budget.NONE:
        if eps is not None:
            raise ConfigError(f"{method} is not private: it has no epsilon to match")
        return cfg.validate()
    if eps is None:
        raise ConfigError(f"{method} is private: give it a target epsilon")
    if budget == Budget.LDP:
        cfg = dataclasses.replace(cfg, ldp_epsilon=eps / cfg.rounds)
    elif budget == Budget.ALI:
        from fedlap_privacy.fl.privacy import with_planned_sigma

        reference = dataclasses.replace(cfg, method="dp-fedavg", sigma=None, target_eps=eps)
        sigma = with_planned_sigma(reference, _client_sizes(reference)).sigma
        cfg = dataclasses.replace(cfg, sigma=sigma, target_eps=eps)
    else:
        cfg = dataclasses.replace(cfg, sigma=None, target_eps=eps)  # planned by the driver
    return cfg.validate()


def _run_dir(out: Path, method: str, eps: float | None, seed: int) -> Path:
    budget = "nodp" if eps is None else f"eps{eps:g}"
    return out / "runs" / f"{method}-{budget}-seed{seed}"


def _train_or_resume(cfg: TrainConfig, run_dir: Path, device: str) -> dict[str, Any]:
    """Train into ``run_dir``; if it holds this very configuration already, resume it."""
    from fedlap_privacy.fl.simulation import resume, train

    if not (run_dir / CHECKPOINT).exists():
        return train(cfg, run_dir, device).summary
    saved = load_run_config(run_dir).to_dict()
    planned = dict(cfg.to_dict(), sigma=saved.get("sigma")) if cfg.sigma is None else cfg.to_dict()
    if saved != planned:
        raise ConfigError(f"{run_dir} holds a run with other settings: pick another --out")
    return resume(run_dir, device=device).summary


Job = tuple[str, float | None, int, TrainConfig]


def plan_jobs(
    base: TrainConfig,
    eps_values: list[float],
    methods: list[str] | tuple[str, ...] = METHODS,
    seeds: int = 1,
) -> list[Job]:
    """(method, target epsilon or None, seed, configuration) of every run; checks the request."""
    unknown = [m for m in methods if m not in METHOD_TABLE]
    if unknown:
        raise ConfigError(f"unknown method(s) {', '.join(unknown)}: choose from {METHODS}")
    if not eps_values or any(not (math.isfinite(e) and e > 0) for e in eps_values):
        raise ConfigError("give one or more positive target epsilons, e.g. --eps 3,10")
    if seeds < 1:
        raise ConfigError(f"seeds {seeds} must be >= 1")
    jobs = []
    for method in methods:
        for eps in [None] if METHOD_TABLE[method].budget == Budget.NONE else eps_values:
            for seed in range(base.seed, base.seed + seeds):
                cfg = budget_config(dataclasses.replace(base, seed=seed), method, eps)
                jobs.append((method, eps, seed, cfg))
    return jobs


def run_comparison(
    base: TrainConfig,
    eps_values: list[float],
    methods: list[str] | tuple[str, ...] = METHODS,
    seeds: int = 1,
    out_dir: str | Path = "runs/compare",
    device: str = "auto",
    callback: Callback | None = None,
    jobs: list[Job] | None = None,
) -> dict[str, Any]:
    """Train every method at every budget and seed; write and return ``comparison.json``.

    ``jobs`` (from :func:`plan_jobs` with the same arguments) skips planning them again.
    """
    jobs = jobs if jobs is not None else plan_jobs(base, eps_values, methods, seeds)
    out = Path(out_dir)
    callback = callback or (lambda event, info: None)
    callback("start", {"runs": len(jobs)})
    t0 = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {
        m: {"notion": METHOD_TABLE[m].notion.value, "upload_bytes": None, "results": {}}
        for m in methods
    }
    for method, eps, seed, cfg in jobs:
        callback("run_start", {"method": method, "eps": eps, "seed": seed})
        started = time.perf_counter()
        summary = _train_or_resume(cfg, _run_dir(out, method, eps, seed), device)
        history = _history(_run_dir(out, method, eps, seed))
        run = {
            "seed": seed,
            "test_accuracy": summary["test_accuracy"],
            "epsilon": summary["epsilon"],
            "delta": summary["delta"],
            "sigma": summary["sigma"],
            "round_epsilon": summary.get("round_epsilon"),
            "rounds_run": summary["rounds_run"],
            "stopped": summary["stopped"],
            "seconds": time.perf_counter() - started,
            "out": summary["out"],
            # per round: how accuracy grows while the run spends its budget (a run planned
            # for R rounds spends less than its target before round R)
            "accuracy_by_round": [h["test_accuracy"] for h in history],
            "epsilon_by_round": [h["epsilon"] for h in history],
        }
        row = rows[method]
        uploads = [h["upload_bytes"] for h in history if h.get("clients")]
        if uploads:
            row["upload_bytes"] = float(np.mean(uploads))
        cell = row["results"].setdefault(NO_DP if eps is None else f"{eps:g}", {"runs": []})
        cell["runs"].append(run)
        accs = [r["test_accuracy"] for r in cell["runs"]]
        cell["mean"], cell["std"] = float(np.mean(accs)), float(np.std(accs))
        cell["mean_by_round"] = _mean_by_round([r["accuracy_by_round"] for r in cell["runs"]])
        callback("run_end", {"method": method, "eps": eps, "seed": seed, **run})
    report = {
        "dataset": base.dataset,
        "rounds": base.rounds,
        "delta": base.delta,
        "eps": [float(e) for e in eps_values],
        "seeds": seeds,
        "config": base.to_dict(),
        "methods": rows,
        "seconds": time.perf_counter() - t0,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / COMPARISON, json.dumps(json_safe(report), indent=2) + "\n")
    plot_comparison(report, out / "accuracy_vs_epsilon.png")
    plot_rounds(report, out / "accuracy_vs_round.png")
    return report


def _mean_by_round(curves: list[list[float]]) -> list[float]:
    """Mean accuracy after each round over the runs that reached it."""
    longest = max((len(c) for c in curves), default=0)
    return [float(np.mean([c[i] for c in curves if len(c) > i])) for i in range(longest)]


def plot_rounds(report: dict[str, Any], path: Path) -> Path:
    """Accuracy after each round (mean over seeds), one panel per target epsilon."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [f"{e:g}" for e in report["eps"]]
    fig, axes = plt.subplots(1, len(columns), figsize=(4.2 * len(columns), 3.6), squeeze=False)
    for ax, column in zip(axes[0], columns, strict=True):
        for method, row in report["methods"].items():
            cell = row["results"].get(column) or row["results"].get(NO_DP)
            if not cell or not cell.get("mean_by_round"):
                continue
            curve = [100 * a for a in cell["mean_by_round"]]
            style = "--" if column not in row["results"] else "-"
            ax.plot(range(1, len(curve) + 1), curve, style, marker=".",
                    label=f"{method}" + (" (no DP)" if style == "--" else ""))
        ax.set_title(f"target epsilon {column} (reached at the last round)", fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    write_figure(fig, path)
    plt.close(fig)
    return path


def _history(run_dir: Path) -> list[dict[str, Any]]:
    from fedlap_privacy.fl.simulation import METRICS

    path = run_dir / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_comparison(report: dict[str, Any], path: Path) -> Path:
    """Accuracy (mean +- std over seeds) versus target epsilon; non-private rows as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    eps = report["eps"]
    colours = plt.get_cmap("tab20").colors
    for i, (method, row) in enumerate(report["methods"].items()):
        results, colour = row["results"], colours[(2 * i) % 20 + (2 * i) // 20]
        if NO_DP in results:
            ax.axhline(100 * results[NO_DP]["mean"], ls="--", lw=1, color=colour,
                       label=f"{method} (no DP)")
            continue
        xs = [e for e in eps if f"{e:g}" in results]
        means = [100 * results[f"{e:g}"]["mean"] for e in xs]
        stds = [100 * results[f"{e:g}"]["std"] for e in xs]
        ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, color=colour,
                    label=f"{method} ({row['notion']})")
    ax.set_xscale("log")
    ax.set_xticks(eps, [f"{e:g}" for e in eps])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel(f"target epsilon (delta {report['delta']:g}; notion in the legend)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{report['dataset']}, {report['rounds']} rounds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    write_figure(fig, path)
    plt.close(fig)
    return path
