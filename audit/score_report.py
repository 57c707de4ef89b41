"""The files of an audit of canary scores (:mod:`.score_audit`): ``report.json``, the score
histograms ``scores.png`` and the readable ``report.md`` / ``report.html``.

The readable report is built from ``report.json``'s dict alone, with the blocks and the
canary-audit table of the privacy report (:mod:`.privacy_report`), so the numbers of the
three files never disagree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedlap_privacy.audit.privacy_report import (
    VERDICT_TEXT,
    Block,
    canary_blocks,
    fmt,
    literal,
    to_html,
    to_markdown,
)
from fedlap_privacy.audit.report_files import plot_canary_scores
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.state.atomic import write_figure, write_text_atomic
from fedlap_privacy.state.jsonsafe import json_safe

__all__ = ["render_score_blocks", "write_score_report"]

FIGURE = "scores.png"


def _claim(report: dict[str, Any]) -> list[Block]:
    claim = report["claim"]
    lines = [f"Claim: epsilon {fmt(claim['epsilon'])} at delta {fmt(claim['delta'])} for each "
             "canary (as stated by whoever trained the model; this audit does not recompute "
             "it)."]
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
    lines = [VERDICT_TEXT[report["verdict"]] + ".",
             f"Largest lower bound on epsilon: {fmt(report['epsilon_lower_bound'])} at "
             f"confidence {fmt(report['confidence'])} (claimed {fmt(report['claim']['epsilon'])})."]
    if report.get("claim_curve_p_value") is not None:
        lines.append(f"p-value of \"the training is the claimed mechanism\" (family-adjusted): "
                     f"{fmt(report['claim_curve_p_value'])}; a violation below "
                     f"{fmt(1.0 - report['confidence'])}.")
    return [Block("heading", "Verdict"), Block("bullets", items=tuple((x,) for x in lines))]


def render_score_blocks(report: dict[str, Any], figure: str | None = FIGURE) -> list[Block]:
    """The report's content, from ``report.json``'s dict alone."""
    blocks = [Block("title", f"Privacy audit: {literal(report['source'])}")]
    blocks += _verdict(report) + _claim(report) + canary_blocks(report)
    blocks.append(Block("text", "The bounds hold only if each canary's bit was a secret fair "
                                "coin drawn before training and the scores were computed "
                                "without looking at the bits."))
    if figure is not None:
        blocks += [Block("heading", "Figures"),
                   Block("text", "Each audit's canary scores, included against not included."),
                   Block("image", figure)]
    return blocks


def plot_scores(report: dict[str, Any], path: Path) -> None:
    """One histogram per audit: the scores of the included canaries against the others."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    audits = report["one_run"]["audits"]
    fig = Figure(figsize=(4.5 * len(audits), 4.0))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(audits), squeeze=False)[0]
    for ax, audit in zip(axes, audits, strict=True):
        plot_canary_scores(ax, audit)
    fig.tight_layout()
    write_figure(fig, path)


def write_score_report(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.json`` (non-finite numbers as null), ``scores.png``, ``report.md`` and
    ``report.html`` into ``out_dir``; the paths by kind."""
    out = Path(out_dir)
    data = json_safe(report)
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "report.json", "png": out / FIGURE,
                 "md": out / "report.md", "html": out / "report.html"}
        write_text_atomic(paths["json"], json.dumps(data, indent=2))
        plot_scores(report, paths["png"])
        blocks = render_score_blocks(data)
        write_text_atomic(paths["md"], to_markdown(blocks))
        write_text_atomic(paths["html"], to_html(blocks, {FIGURE: paths["png"].read_bytes()}))
    except OSError as exc:
        raise ConfigError(f"cannot write the audit report to {out}: {exc}") from None
    return paths
