"""The files of an audit report: ``report.json``, the ROC figure ``roc.png`` (with the
canary score histograms) and the readable ``report.md`` / ``report.html``
(:mod:`.privacy_report`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from fedlap_privacy.audit.reports.privacy_report import figure_text, write_privacy_report
from fedlap_privacy.audit.reports.report_folder import ReportFolder, figure_png
from fedlap_privacy.audit.reports.results import AuditReport
from fedlap_privacy.state.jsonsafe import json_safe

__all__ = ["plot_canary_scores", "plot_roc", "write_report"]


def write_report(report: AuditReport, out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.json`` (non-finite numbers as null), ``roc.png`` and the readable
    ``report.md`` / ``report.html`` (:mod:`.privacy_report`) into ``out_dir`` (a
    :class:`~.report_folder.ReportFolder`: a link, a training run's folder or another
    user's is refused; the HTML embeds the figure from the bytes written)."""
    raw = report.to_json()
    data = json_safe(raw)
    png = plot_roc(raw)
    with ReportFolder(out_dir) as folder:
        json_path = folder.write_text("report.json", json.dumps(data, indent=2))
        png_path = folder.write("roc.png", png)
        readable = write_privacy_report(data, folder, ("roc.png", png))
    return {"json": json_path, "png": png_path, **readable}


def plot_canary_scores(ax: Any, audit: dict[str, Any], prefix: str = "") -> None:
    """One canary audit's scores on ``ax`` (their histogram in report.json): included
    against not included, its bound and verdict in the title (``prefix`` before the
    audit's name)."""
    histogram = audit["histogram"]
    edges = np.asarray(histogram["edges"], dtype=np.float64)
    for side in ("in", "out"):
        counts = np.asarray(histogram[side], dtype=np.float64)
        ax.stairs(counts, edges, fill=True, alpha=0.6, label=f"{side} ({int(counts.sum())})")
    ax.set_title(f"{prefix}{figure_text(audit['audit'])}: eps LB "
                 f"{audit['epsilon_lower_bound']:.2f} ({audit['verdict']})", fontsize=8)
    ax.set_xlabel("score")
    ax.legend(fontsize=7)


def plot_roc(report: dict[str, Any]) -> bytes:
    """Linear ROC and log-log ROC (Carlini et al. 2022), diagonal, AUC in legend; beside
    them, when the run has canaries, the histogram of each canary audit's scores, in vs out;
    as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    canaries = (report.get("one_run") or {}).get("audits", [])
    fig = Figure(figsize=(10 + 4.5 * len(canaries), 4.5))
    FigureCanvasAgg(fig)
    linear, loglog, *histograms = fig.subplots(1, 2 + len(canaries))
    for ax, audit in zip(histograms, canaries, strict=True):
        plot_canary_scores(ax, audit, "canaries, ")
    floor = 1.0
    for feature, by_model in report["attacks"].items():
        for kind, metrics in by_model.items():
            fpr = np.asarray(metrics["roc"]["fpr"])
            tpr = np.asarray(metrics["roc"]["tpr"])
            floor = min(floor, 0.5 / max(1, metrics["n_nonmembers"]))
            label = f"{feature} / {kind} (AUC {metrics['auc']:.3f})"
            linear.plot(fpr, tpr, label=label)
            loglog.plot(np.maximum(fpr, floor), np.maximum(tpr, floor), label=label)
    for ax, lo in ((linear, 0.0), (loglog, floor)):
        ax.plot([lo, 1], [lo, 1], "k--", lw=0.8, label="random guess (AUC 0.5)")
        ax.set_xlabel("false positive rate")
        ax.set_ylabel("true positive rate")
    linear.set_xlim(0, 1)
    linear.set_ylim(0, 1)
    loglog.set_xscale("log")
    loglog.set_yscale("log")
    loglog.set_xlim(floor, 1)
    loglog.set_ylim(floor, 1)
    linear.set_title("ROC (audit half)")
    loglog.set_title("ROC, log-log (low-FPR regime)")
    linear.legend(loc="lower right", fontsize=7)
    eps = report["privacy"].get("epsilon")
    fig.suptitle(
        f"{figure_text(report.get('method') or 'model')} on "
        f"{figure_text(report['dataset']['name'])}: accountant eps = "
        f"{'n/a' if eps is None else f'{eps:.3g}'} ({report['privacy']['notion']}), "
        f"max eps lower bound = {report['max_eps_lb']:.3g}",
        fontsize=9,
    )
    fig.tight_layout()
    return figure_png(fig)
