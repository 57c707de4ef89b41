"""The audit as a report people can read: ``report.md`` and a self-contained ``report.html``.

Written by ``fedlap-privacy audit --out DIR`` beside ``report.json`` and ``roc.png``, for a
reader who is not a privacy researcher (a data-protection officer): the guarantee and whom
it holds against, what was released without noise, the ledger, every audit that ran with
what it can and cannot show (its ceiling against the claim), the ROC and canary-score plots,
and the verdict. Every number in the report is a number of ``report.json``
(:func:`render_blocks` reads nothing else), printed with :func:`fmt` (4 significant digits),
so the two never disagree. The HTML embeds the figure as a base64 PNG and loads nothing
from the network. Every string the report shows that came from a user or a file (the
model's path, the method and dataset names, what the run declared public, ...) goes through
:func:`literal`: escaped in both files, never read as Markdown or HTML.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlap_privacy.audit.reports.report_folder import ReportFolder
from fedlap_privacy.state.ledger import PrivacyLedger, selection_withheld
from fedlap_privacy.vocabulary import NoiseKind, Notion, ThreatModel

__all__ = ["Block", "canary_blocks", "figure_text", "fmt", "ledger_summary", "literal",
           "render_blocks", "to_html", "to_markdown", "write_privacy_report"]

#: who each threat model's epsilon holds against (fedlap_privacy.state.ledger, module docstring)
THREAT_MODEL_TEXT = {
    ThreatModel.SERVER:
        "the server that coordinates training, which sees every client's upload and knows "
        "which clients it selected in each round; anyone who sees less (other clients, users "
        "of the released model) is covered too",
    ThreatModel.HIDDEN_SELECTION:
        "anyone who sees the uploads or the models but not which clients were selected in "
        "each round; NOT the server, which knows whom it selected",
    ThreatModel.TRUSTED_SERVER:
        "those who see the released models only; NOT the server, which sees each client's "
        "update in the clear and adds the noise itself",
}
NOTION_TEXT = {
    Notion.RECORD: "one record (one person's example) of a client's data",
    Notion.CLIENT: "a client's whole dataset",
    Notion.LOCAL: "each uploaded weight, per round (local DP); it bounds no record's membership "
             "in the model",
    Notion.NONE: "nothing: the method is not private",
}
#: each test's name in the report's tables
METHOD_NAMES = {"steinke": "Steinke bound", "fdp": "f-DP bound",
                "claim-curve": "claimed mechanism's curve", "noise": "noise in the releases"}
METHOD_TEXT = {
    "steinke": "Steinke, Nasr and Jagielski's one-run (epsilon, delta) lower bound",
    "fdp": "the f-DP one-run lower bound of Mahloujifar, Melis and Chaudhuri (Gaussian "
           "trade-off family; it tests the claim only where the claimed mechanism is at least "
           "as private as that Gaussian curve)",
    "claim-curve": "a test of the guesses against the trade-off curve of the exact mechanism "
                   "claimed (for a run of this package, the one its ledger describes; a "
                   "p-value below its level is a violation)",
    "noise": "a test of the released values themselves: do they carry at least half the "
             "claimed noise? (it can only find a violation, never support the claim)",
}
VERDICT_TEXT = {
    "violation": "VIOLATION: the audit shows more leakage than the claim allows",
    "consistent": "consistent: no evidence against the claim, and this test could have "
                  "refuted it",
    "inconclusive": "inconclusive: with the coins that were drawn, no test of this audit "
                    "could have refuted the claim (it is above their ceilings), so it can "
                    "neither refute nor support it",
}


def fmt(value: Any) -> str:
    """A number as the report prints it: 4 significant digits ("n/a" for none)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    return f"{float(value):.4g}"


#: the marks around a :func:`literal` in a block's text (not printable: no string carries them)
_OPEN, _CLOSE = "\x02", "\x03"
_LITERALS = re.compile(f"{_OPEN}(.*?){_CLOSE}", re.S)
#: what a literal's text becomes in report.md: HTML's specials as entities, Markdown's inline
#: punctuation (code spans, emphasis, links, table cells, strike-through) backslash-escaped
_MARKDOWN = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;",
             **{c: "\\" + c for c in "\\`*_[]|~!(){}#"}}


def literal(value: Any) -> str:
    """A string that came from a user or a file (a path, a name, anything report.json holds
    that the audit did not write itself), marked for the renderers: :func:`to_markdown` and
    :func:`to_html` show it as text in a code style, whatever Markdown or HTML it contains.
    Every such string of the report goes through here. Characters that are not printable
    (a newline, the marks themselves) are shown as their escape (``\\n``)."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))
    return f"{_OPEN}{text}{_CLOSE}"


def figure_text(value: Any) -> str:
    """A string from a file as a figure shows it: as text, never as matplotlib's mathtext
    (a ``$`` escaped; an unbalanced formula would fail to draw) nor over several lines."""
    return " ".join(str(value).split()).replace("$", r"\$")


def _markdown_inline(text: str) -> str:
    """``text`` for report.md: each :func:`literal` escaped (:data:`_MARKDOWN`) in a
    ``<code>`` element, the report's own text as it is."""
    parts = _LITERALS.split(text)
    return "".join("<code>" + "".join(_MARKDOWN.get(c, c) for c in part) + "</code>"
                   if i % 2 else part for i, part in enumerate(parts))


def _word(value: Any, known: dict[str, str]) -> str:
    """A word of the package's vocabulary as it is (one of ``known``), else a :func:`literal`."""
    return value if isinstance(value, str) and value in known else literal(value)


def _plain(text: str) -> str:
    """``text`` without the literal marks and code backticks (a page title)."""
    return text.replace(_OPEN, "").replace(_CLOSE, "").replace("`", "")


@dataclass(frozen=True)
class Block:
    """One piece of the report: ``kind`` is heading / text / bullets / table / image;
    ``items`` the bullets or table rows (the first row is the header)."""

    kind: str
    text: str = ""
    items: tuple[tuple[str, ...], ...] = ()


def ledger_summary(ledger: PrivacyLedger, public: Iterable[str]) -> dict[str, Any]:
    """What ``report.json`` says about the release: the ledger's rounds, noise, sampling and
    accesses, and what the run declared public (released without noise)."""
    entries = ledger.entries
    gaussian = [e for e in entries if e.sigma is not None]
    return {
        "public": list(public),
        "rounds": len(entries),
        "interrupted_rounds": sum(e.status != "completed" for e in entries),
        "sigma": max((e.sigma for e in gaussian), default=None),  # type: ignore[type-var]
        "sampling_rate": max((e.q2 for e in gaussian if e.q2 is not None), default=None),
        "accounted_steps_per_round": max(
            (e.local_steps for e in gaussian if e.local_steps is not None), default=None),
        # withheld where the threat model assumes the selection hidden (ledger.py)
        "selection": "withheld" if selection_withheld(ledger.threat_model) else "released",
        "clients_per_round": max((e.clients for e in entries if e.clients is not None),
                                 default=None),
    }


def _guarantee(report: dict[str, Any]) -> list[Block]:
    p = report["privacy"]
    notion = p.get("notion", "none")
    lines = [f"Notion: {_word(notion, NOTION_TEXT)}, it protects "
             f"{NOTION_TEXT.get(notion) or literal(notion)}."]
    if p.get("epsilon") is not None:
        lines.append(f"Claim: epsilon {fmt(p['epsilon'])} at delta {fmt(p.get('delta'))}, "
                     f"composed by the {literal(p.get('accountant'))} accountant from the ledger "
                     f"(recomputed by the audit, not read from a stored number).")
    threat = p.get("threat_model")
    if threat:
        lines.append(f"Holds against ({_word(threat, THREAT_MODEL_TEXT)}): "
                     f"{THREAT_MODEL_TEXT.get(threat) or literal(threat)}.")
    noise = p.get("noise")
    if noise == NoiseKind.SEEDED:
        lines.append("The noise was derived from the run's seed: anyone with the seed can "
                     "remove it. This run is NOT private, whatever its epsilon.")
    elif noise == NoiseKind.SECRET:
        lines.append("The noise was drawn from a secret seed (the operating system's).")
    lines.append(f"What the audit tests: {literal(p.get('basis'))}.")
    return [Block("heading", "The guarantee and whom it holds against"),
            Block("bullets", items=tuple((line,) for line in lines))]


def _release(report: dict[str, Any]) -> list[Block]:
    release = report.get("release")
    if not release:
        return []
    public = release.get("public") or []
    out = [Block("heading", "What was released without noise (declared public)"),
           Block("bullets", items=tuple((literal(item),) for item in public)) if public else
           Block("text", "Nothing beyond the noisy releases.")]
    out += [Block("heading", "Ledger summary"), Block("table", items=(
        ("entry", "value"),
        ("rounds recorded", fmt(release["rounds"])),
        ("of them interrupted (still counted)", fmt(release["interrupted_rounds"])),
        ("noise multiplier sigma", fmt(release["sigma"])),
        ("largest Poisson sampling rate of a record", fmt(release["sampling_rate"])),
        ("accounted accesses to the data per client and round",
         fmt(release["accounted_steps_per_round"])),
        ("most clients in a round", "withheld" if release["selection"] == "withheld"
         else fmt(release["clients_per_round"])),
    ))]
    return out


def _attacks(report: dict[str, Any]) -> list[Block]:
    rows: list[tuple[str, ...]] = [("feature / attack", "AUC",
                                    "true positives at 1% false positives",
                                    "lower bound on epsilon")]
    for feature, by in report.get("attacks", {}).items():
        for kind, m in by.items():
            rows.append((f"{literal(feature)} / {literal(kind)}", fmt(m["auc"]),
                         fmt(m.get("tpr_at_fpr_0.01")), fmt(m["eps_lb"])))
    per_half = report.get("sets", {}).get("per_half")
    return [
        Block("heading", "Membership-inference attacks"),
        Block("text", f"Attacks are fitted on one half of the records and measured on the "
                      f"other ({fmt(per_half)} members and as many non-members per half). "
                      "An AUC near one half means the attack does no better than guessing. "
                      "What they can show: a lower bound on epsilon, at confidence "
                      f"{fmt(report.get('confidence'))}. What they cannot show: that the "
                      "model is private; and with this many records their bound stays far "
                      "below most claims."),
        Block("table", items=tuple(rows)),
    ]


def canary_blocks(report: dict[str, Any]) -> list[Block]:
    """The canary audits of ``report`` (its ``one_run`` and ``confidence``) as blocks."""
    one_run = report.get("one_run")
    if not one_run:
        return [Block("heading", "Canary audits"),
                Block("text", "The run has no canaries (train with canaries to audit it "
                              "in one run).")]
    rows: list[tuple[str, ...]] = [("score", "test", "lower bound on epsilon", "ceiling",
                                    "p-value", "level", "verdict", "counts in the verdict",
                                    "evidence")]
    for audit in one_run["audits"]:
        for name, m in audit["methods"].items():
            counts = (f"{fmt(m['correct'])} of {fmt(m['guesses'])} guesses right"
                      if "guesses" in m else f"{fmt(m['values'])} released values")
            rows.append((literal(audit["audit"]), METHOD_NAMES.get(name) or literal(name),
                         fmt(m.get("epsilon_lower_bound")), fmt(m.get("ceiling")),
                         fmt(m.get("p_value")), fmt(m.get("level")), _word(m["verdict"],
                                                                           VERDICT_TEXT),
                         "yes" if m.get("valid", True) else "no", counts))
    present = {name for audit in one_run["audits"] for name in audit["methods"]}
    out = [
        Block("heading", "Canary audits"),
        Block("text", f"{fmt(one_run['canaries'])} canaries of kind "
                      f"{literal(one_run['kind'])} were each put into training with a "
                      "secret coin flip; the auditor guesses which were in from what it "
                      "observed. Each method turns the guesses "
                      "into evidence at a family-wise confidence of "
                      f"{fmt(report.get('confidence'))}:"),
        Block("bullets", items=tuple((f"{METHOD_NAMES[k]}: {v}",)
                                     for k, v in METHOD_TEXT.items() if k in present)),
        Block("text", "Each test runs at its own level, its share of the family's (the "
                      "level column): a p-value below it, or a bound above the claim, is a "
                      "violation. What they cannot show: a bound can never exceed its "
                      "ceiling (the bound a perfect score would reach with the coins that "
                      "were drawn, known before the scores are read), so a claim above the "
                      "ceiling is inconclusive; and no audit proves a guarantee, it can only "
                      "fail to refute it."),
        Block("table", items=tuple(rows)),
    ]
    for audit in one_run["audits"]:
        gdp = audit.get("gdp_estimate")
        if gdp:
            out.append(Block("text", f"{literal(audit['audit'])}: a Gaussian-DP ESTIMATE (Nasr et "
                                     f"al.; it assumes Gaussian scores and is NOT a bound, "
                                     f"and no verdict uses it): mu {fmt(gdp['mu'])}, epsilon "
                                     f"{fmt(gdp['epsilon'])} at delta {fmt(gdp['delta'])}."))
    estimates = [a for a in one_run["audits"] if a.get("epsilon_estimate")]
    for audit in estimates:
        est = audit["epsilon_estimate"]
        out.append(Block("text", f"{literal(audit['audit'])}: the canary clients' epsilon ESTIMATE "
                                 f"(Andrew et al.; an estimate, not a bound) is "
                                 f"{fmt(est['epsilon'])} at delta {fmt(est['delta'])}."))
    for audit in one_run["audits"]:
        if audit.get("epsilon_estimate_skipped"):
            out.append(Block("text", f"{literal(audit['audit'])}: no epsilon ESTIMATE (the bounds "
                                     f"above do not need it): "
                                     f"{audit['epsilon_estimate_skipped']}."))
    return out


def _verdict(report: dict[str, Any]) -> list[Block]:
    one_run = report.get("one_run") or {}
    p = report["privacy"]
    lines = []
    if report.get("violation"):
        lines.append("VIOLATION: an audit found more leakage than the claim allows; the "
                     "implementation or its accounting is wrong. Do not rely on the claim.")
    else:
        lines.append("No audit found a violation of the claim.")
    lines.append(f"Claimed epsilon: {fmt(p.get('epsilon'))}; tested on records: "
                 f"{fmt(p.get('epsilon_tested'))}.")
    lines.append(f"Largest membership-attack lower bound: {fmt(report.get('max_eps_lb'))} "
                 f"({literal(report.get('max_eps_lb_attack'))}).")
    if one_run:
        lines.append(f"Canary audit: {VERDICT_TEXT[one_run['verdict']]} (lower bound "
                     f"{fmt(one_run['epsilon_lower_bound'])}, by {literal(one_run['method'])}; "
                     f"decided by {literal(one_run['audit'])}: {one_run.get('reason', 'n/a')}).")
    return [Block("heading", "Verdict"), Block("bullets", items=tuple((x,) for x in lines))]


def render_blocks(report: dict[str, Any], figure: str | None = "roc.png") -> list[Block]:
    """The report's content, from ``report.json``'s dict alone (module docstring)."""
    title = (f"Privacy report: {literal(report.get('method') or 'model')} on "
             f"{literal(report['dataset']['name'])}, after round {fmt(report.get('round'))}")
    blocks = [Block("title", title),
              Block("text", f"Model: {literal(report['checkpoint'])}.")]
    blocks += _verdict(report) + _guarantee(report) + _release(report)
    blocks += _attacks(report) + canary_blocks(report)
    if figure is not None:
        blocks += [Block("heading", "Figures"),
                   Block("text", "ROC curves of the attacks (linear and log-log) and, for each "
                                 "canary audit, its scores in against out."),
                   Block("image", figure)]
    return blocks


def to_markdown(blocks: list[Block]) -> str:
    """report.md: every :func:`literal` escaped (:func:`_markdown_inline`)."""
    md = _markdown_inline
    out: list[str] = []
    for b in blocks:
        if b.kind == "title":
            out.append(f"# {md(b.text)}")
        elif b.kind == "heading":
            out.append(f"## {md(b.text)}")
        elif b.kind == "text":
            out.append(md(b.text))
        elif b.kind == "bullets":
            out.append("\n".join(f"- {md(item[0])}" for item in b.items))
        elif b.kind == "table":
            header, *rows = b.items
            lines = ["| " + " | ".join(map(md, header)) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(map(md, r)) + " |" for r in rows]
            out.append("\n".join(lines))
        elif b.kind == "image":
            out.append(f"![figures]({b.text})")
    return "\n\n".join(out) + "\n"


def _inline(text: str) -> str:
    """Escaped text with `code` spans and each :func:`literal` as <code>."""
    def own(part: str) -> str:
        pieces = html.escape(part, quote=False).split("`")
        return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))

    parts = _LITERALS.split(text)
    return "".join(f"<code>{html.escape(part)}</code>" if i % 2 else own(part)
                   for i, part in enumerate(parts))


def to_html(blocks: list[Block], images: dict[str, bytes]) -> str:
    """A self-contained page: inline style, images as base64 data URIs, no network."""
    body: list[str] = []
    for b in blocks:
        if b.kind == "title":
            body.append(f"<h1>{_inline(b.text)}</h1>")
        elif b.kind == "heading":
            body.append(f"<h2>{_inline(b.text)}</h2>")
        elif b.kind == "text":
            body.append(f"<p>{_inline(b.text)}</p>")
        elif b.kind == "bullets":
            body.append("<ul>" + "".join(f"<li>{_inline(i[0])}</li>" for i in b.items) + "</ul>")
        elif b.kind == "table":
            header, *rows = b.items
            head = "".join(f"<th>{_inline(c)}</th>" for c in header)
            cells = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>"
                            for r in rows)
            body.append(f"<table><tr>{head}</tr>{cells}</table>")
        elif b.kind == "image" and b.text in images:
            data = base64.b64encode(images[b.text]).decode("ascii")
            body.append(f'<img alt="figures" src="data:image/png;base64,{data}">')
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.4}"
             "table{border-collapse:collapse}td,th{border:1px solid #999;padding:.2em .5em}"
             "img{max-width:100%}code{background:#eee}")
    title = next((b.text for b in blocks if b.kind == "title"), "Privacy report")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>"
            f"{html.escape(_plain(title))}</title><style>{style}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")


def write_privacy_report(report: dict[str, Any], out: str | Path | ReportFolder,
                         figure: tuple[str, bytes] | None) -> dict[str, Path]:
    """Write ``report.md`` and ``report.html`` into ``out`` (a folder, or a
    :class:`~.report_folder.ReportFolder` already open); ``figure``: the PNG's file name
    (the markdown links to it) and its bytes (the HTML embeds them)."""
    blocks = render_blocks(report, None if figure is None else figure[0])
    images = {} if figure is None else {figure[0]: figure[1]}
    if not isinstance(out, ReportFolder):
        with ReportFolder(out) as folder:
            return write_privacy_report(report, folder, figure)
    return {"md": out.write_text("report.md", to_markdown(blocks)),
            "html": out.write_text("report.html", to_html(blocks, images))}
