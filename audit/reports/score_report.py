"""The files of an audit of canary scores (:mod:`.score_audit`): ``report.json``, the score
histograms ``scores.png`` and the readable ``report.md`` / ``report.html``.

The readable report is built from ``report.json``'s dict alone, with the blocks and the
canary-audit table of the privacy report (:mod:`.privacy_report`), so the numbers of the
three files never disagree.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedlap_privacy.audit.reports.privacy_report import (
    VERDICT_TEXT,
    Block,
    canary_blocks,
    fmt,
    literal,
    to_html,
    to_markdown,
)
from fedlap_privacy.audit.reports.report_files import plot_canary_scores
from fedlap_privacy.audit.reports.report_folder import ReportFolder, figure_png
from fedlap_privacy.state.jsonsafe import json_safe

__all__ = ["render_score_blocks", "write_score_report"]

FIGURE = "scores.png"


def _claim(report: dict[str, Any]) -> list[Block]:
    claim = report["claim"]
    source = (report.get("gradient_canaries") or {}).get("claim_source", "given")
    said = {"set up": "the mechanism the optimiser was set up with, accounted over the steps "
                      "released (The run, below)",
            "accountant": "as the accountant given to the audit reports it"}.get(
        source, "as stated by whoever trained the model; this audit does not recompute it")
    lines = [f"Claim: epsilon {fmt(claim['epsilon'])} at delta {fmt(claim['delta'])} for each "
             f"canary ({said})."]
    mech = claim.get("mechanism")
    if mech:
        lines.append(f"Claimed mechanism: {fmt(mech['steps'])} steps of the Poisson-subsampled "
                     f"Gaussian, noise multiplier {fmt(mech['noise_multiplier'])}, sample rate "
                     f"{fmt(mech['sample_rate'])}; by this package's PLD accountant it is "
                     f"({fmt(claim['mechanism_epsilon'])}, {fmt(claim['delta'])})-DP.")
        eps = claim.get("mechanism_epsilon")
        if eps is not None and eps > claim["epsilon"] * 1.01 + 1e-9:
            lines.append("Note: the mechanism described spends MORE than the claimed epsilon; "
                         "the claim is not what its own accounting gives.")
    else:
        lines.append("No mechanism was described: the test against its trade-off curve did "
                     "not run, and the f-DP bound is shown but counts in no verdict.")
    return [Block("heading", "The claim"), Block("bullets", items=tuple((x,) for x in lines))]


def _verdict(report: dict[str, Any]) -> list[Block]:
    """The verdict and what decided it: the one-run audits', or a test of the run itself
    that decided over them (``report['decided_by']``: the sampling test of canary records)."""
    decided = report.get("decided_by") or {"test": report["one_run"]["audit"],
                                           "reason": report["one_run"].get("reason", "n/a")}
    lines = [VERDICT_TEXT[report["verdict"]] + ".",
             f"Decided by {literal(decided['test'])}: {decided['reason']}.",
             f"Largest lower bound on epsilon: {fmt(report['epsilon_lower_bound'])}, every "
             f"test at its share of the level {fmt(1.0 - report['confidence'])} "
             f"(claimed {fmt(report['claim']['epsilon'])})."]
    return [Block("heading", "Verdict"), Block("bullets", items=tuple((x,) for x in lines))]


def render_score_blocks(report: dict[str, Any], figure: str | None = FIGURE,
                        sections: Sequence[Block] = ()) -> list[Block]:
    """The report's content, from ``report.json``'s dict alone; ``sections`` (the run the
    canaries saw, :func:`~.gradient_canary_audit.run_blocks`) follow the claim."""
    blocks = [Block("title", "Privacy audit"),
              Block("text", f"Audited: {literal(report['source'])}.")]
    blocks += _verdict(report) + _claim(report) + list(sections) + canary_blocks(report)
    blocks.append(Block("text", "The bounds hold only if each canary's bit was a secret fair "
                                "coin drawn before training and the scores were computed "
                                "without looking at the bits."))
    if figure is not None:
        blocks += [Block("heading", "Figures"),
                   Block("text", "Each audit's canary scores, included against not included."),
                   Block("image", figure)]
    return blocks


def plot_scores(report: dict[str, Any]) -> bytes:
    """One histogram per audit (the included canaries' scores against the others'), as
    PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    audits = report["one_run"]["audits"]
    fig = Figure(figsize=(4.5 * len(audits), 4.0))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(audits), squeeze=False)[0]
    for ax, audit in zip(axes, audits, strict=True):
        plot_canary_scores(ax, audit)
    fig.tight_layout()
    return figure_png(fig)


def write_score_report(report: dict[str, Any], out_dir: str | Path,
                       sections: Sequence[Block] = ()) -> dict[str, Path]:
    """Write ``report.json`` (non-finite numbers as null), ``scores.png``, ``report.md`` and
    ``report.html`` into ``out_dir`` (a :class:`~.report_folder.ReportFolder`: a link, a
    training run's folder or another user's is refused; the HTML embeds the figure from
    the bytes written, never read back); the paths by kind."""
    data = json_safe(report)
    png = plot_scores(report)
    blocks = render_score_blocks(data, sections=sections)
    with ReportFolder(out_dir) as folder:
        return {"json": folder.write_text("report.json", json.dumps(data, indent=2)),
                "png": folder.write(FIGURE, png),
                "md": folder.write_text("report.md", to_markdown(blocks)),
                "html": folder.write_text("report.html", to_html(blocks, {FIGURE: png}))}
