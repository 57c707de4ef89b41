"""The plots of a comparison (``comparison.json``, :mod:`~fedlap_privacy.fl.engine.compare`):
accuracy against the target epsilon, after each round, and against the round count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedlap_privacy.fl.engine.compare_budgets import NO_DP
from fedlap_privacy.fl.engine.compare_records import Comparison
from fedlap_privacy.state.atomic import write_figure

__all__ = ["plot_comparison", "plot_round_counts", "plot_rounds"]


def plot_rounds(report: Comparison, path: Path) -> Path:
    """Accuracy after each round (mean over seeds), one panel per target epsilon; with
    several round counts a curve per count (one colour per method, each curve reaching the
    target at its own last round)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [f"{e:g}" for e in report.eps]
    fig, axes = plt.subplots(1, len(columns), figsize=(4.2 * len(columns), 3.6), squeeze=False)
    for ax, column in zip(axes[0], columns, strict=True):
        for method, row in report.methods.items():
            cell = row.results.get(column) or row.results.get(NO_DP)
            if not cell or not cell.mean_by_round:
                continue
            style = "--" if column not in row.results else "-"
            color = None
            for result in cell.by_rounds:
                curve = [100 * a for a in result.mean_by_round]
                (line,) = ax.plot(range(1, len(curve) + 1), curve, style, marker=".",
                                  color=color, label=None if color else
                                  f"{method}" + (" (no DP)" if style == "--" else ""))
                color = line.get_color()
        ax.set_title(f"target epsilon {column} (each curve reaches it at its last round)",
                     fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    write_figure(fig, path)
    plt.close(fig)
    return path


def plot_comparison(report: Comparison, path: Path) -> Path:
    """Accuracy (mean +- std over seeds) versus target epsilon; non-private rows as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    eps = report.eps
    colours = plt.get_cmap("tab20").colors
    for i, (method, row) in enumerate(report.methods.items()):
        results, colour = row.results, colours[(2 * i) % 20 + (2 * i) // 20]
        if NO_DP in results:
            ax.axhline(100 * results[NO_DP].mean, ls="--", lw=1, color=colour,
                       label=f"{method} (no DP)")
            continue
        xs = [e for e in eps if f"{e:g}" in results]
        means = [100 * results[f"{e:g}"].mean for e in xs]
        stds = [100 * results[f"{e:g}"].std for e in xs]
        ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, color=colour,
                    label=f"{method} ({row.notion})")
    ax.set_xscale("log")
    ax.set_xticks(eps, [f"{e:g}" for e in eps])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel(f"target epsilon (delta {report.delta:g}; notion in the legend)")
    ax.set_ylabel("test accuracy (%)")
    counts = report.round_counts
    several = f" (the largest of {', '.join(map(str, counts))})" if len(counts) > 1 else ""
    ax.set_title(f"{report.dataset}, {report.rounds} rounds{several}")
    return _finish(fig, ax, path)


def _finish(fig: Any, ax: Any, path: Path) -> Path:
    """Grid, legend beside the axes, written atomically to ``path``; the figure is closed."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    write_figure(fig, path)
    plt.close(fig)
    return path


def plot_round_counts(report: Comparison, path: Path) -> Path:
    """Final test accuracy (mean +- std over seeds) against the round count the runs were
    planned for, one line per method and target epsilon (each point its own budget: the
    target spent after that many rounds); non-private methods dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    counts = report.round_counts
    colours = plt.get_cmap("tab20").colors
    markers, lines = "os^Dvp*h", ["-", "-.", ":", (0, (5, 1))]
    column_style = {f"{e:g}": (markers[j % len(markers)], lines[j % len(lines)])
                    for j, e in enumerate(report.eps)}
    for i, (method, row) in enumerate(report.methods.items()):
        colour = colours[(2 * i) % 20 + (2 * i) // 20]
        for column, cell in row.results.items():
            points = cell.by_rounds
            xs = [p.rounds for p in points]
            means = [100 * p.mean for p in points]
            stds = [100 * p.std for p in points]
            private = column != NO_DP
            label = (f"{method} ({row.notion}), eps {column}" if private
                     else f"{method} (no DP)")
            marker, line = column_style.get(column, (".", "--"))
            ax.errorbar(xs, means, yerr=stds, capsize=3, color=colour, ls=line,
                        lw=1.5 if private else 1, marker=marker, label=label)
    if max(counts) > 3 * min(counts):
        ax.set_xscale("log")
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("rounds R (each run's budget planned to spend its target epsilon in R)")
    ax.set_ylabel("test accuracy (%) after the last round")
    ax.set_title(f"{report.dataset}, delta {report.delta:g}, {report.seeds} seed(s)")
    return _finish(fig, ax, path)
