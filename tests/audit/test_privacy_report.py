"""``audit --out`` writes report.md and a self-contained report.html whose numbers are all
report.json's."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fedlap_privacy.audit.reports.privacy_report import fmt
from fedlap_privacy.cli.main import app
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.simulation import train
from fedlap_privacy.state.checkpoint import CHECKPOINT

runner = CliRunner()
#: a number standing alone (not part of a word such as cifar10 or a flag)
NUMBER = re.compile(r"(?<![\w.\-])-?\d+(?:\.\d+)?(?:e[+-]?\d+)?(?![\w.])")


#: the long arrays (ROC points, canary scores) are plotted, never printed: left out, so
#: that a stray number cannot match one of their thousands of values by chance
PLOTTED = ("roc", "scores_in", "scores_out")


def _numbers(value: Any) -> list[float]:
    """Every number in a JSON value, at any depth (but the plotted arrays)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    items = ([v for k, v in value.items() if k not in PLOTTED] if isinstance(value, dict)
             else value)
    return [n for v in items for n in _numbers(v)]


def _prose_numbers(text: str) -> list[str]:
    """The numbers of a report, code spans and elements (names, paths) left out."""
    text = re.sub(r"`[^`]*`|<code>.*?</code>", " ", text)
    return NUMBER.findall(text)


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("report") / "run"
    train(TrainConfig(method="dp-fedavg", rounds=2, local_steps=5, batch_size=16, sigma=1.0,
                      canaries=200), run)
    out = run.parent / "audit"
    result = runner.invoke(app, ["audit", "--model", str(run / CHECKPOINT), "--out", str(out),
                                 "--max-per-half", "40", "--attacks", "loss"])
    assert result.exit_code == 0, result.stdout
    return out


def test_every_number_in_the_report_is_the_json_s(audited: Path) -> None:
    data = json.loads((audited / "report.json").read_text())
    printed = {fmt(v) for v in _numbers(data)} | {fmt(int(v)) for v in _numbers(data)
                                                   if v == int(v)}
    md = (audited / "report.md").read_text()
    page = (audited / "report.html").read_text()
    text_of_page = html.unescape(re.sub(r"<[^>]+>", " ", re.sub(
        r"<(style|title)>.*?</\1>|src=\"data:[^\"]*\"", " ", page, flags=re.S)))
    for name, text in (("report.md", md), ("report.html", text_of_page)):
        found = _prose_numbers(text)
        assert len(found) > 20, (name, found)  # the report does carry the numbers
        stray = [n for n in found if n not in printed]
        assert not stray, (name, stray)
    # the claim, the canary bounds and the ledger are there, as the JSON has them
    one_run = data["one_run"]
    for value in (data["privacy"]["epsilon"], data["privacy"]["delta"],
                  one_run["epsilon_lower_bound"], one_run["ceiling"],
                  one_run["methods"]["fdp"]["epsilon_lower_bound"],
                  data["release"]["sigma"], data["release"]["sampling_rate"]):
        assert fmt(value) in _prose_numbers(md)
    assert "Holds against (server)" in md and "declared public" in md
    gdp = one_run["audits"][0]["gdp_estimate"]  # shown, labelled, never a bound
    assert fmt(gdp["epsilon"]) in _prose_numbers(md) and "NOT a bound" in md
    assert data["release"]["rounds"] == 2 and data["release"]["sigma"] == 1.0


def test_the_html_page_is_self_contained(audited: Path) -> None:
    page = (audited / "report.html").read_text()
    assert 'src="data:image/png;base64,' in page
    sources = re.findall(r"(?:src|href)=\"([^\"]*)\"", page)
    assert sources and all(s.startswith("data:") for s in sources)
    assert "http" not in re.sub(r"src=\"data:[^\"]*\"", "", page)
    assert "![figures](roc.png)" in (audited / "report.md").read_text()


def test_strings_from_files_are_escaped_in_report_md(audited: Path, tmp_path: Path) -> None:
    """A model file named ``<img src=x onerror=alert(1)>.pt`` (or a run whose files carry
    Markdown) is shown as text in report.md and report.html, never as HTML or Markdown: the
    attacker's test of issue 46 (report.md wrote it verbatim)."""
    from markdown_it import MarkdownIt

    from fedlap_privacy.audit.reports.privacy_report import write_privacy_report

    data = json.loads((audited / "report.json").read_text())
    evil = "`<img src=x onerror=alert(1)>`.pt"
    data["checkpoint"] = evil
    data["method"] = "a|b\n# injected"
    data["dataset"]["name"] = "<img src=x onerror=alert(1)>.pt"
    data["release"]["public"] = ["[click](javascript:alert(1))", "*bold* ~~x~~ <b>"]
    paths = write_privacy_report(data, tmp_path, None)
    md, page = paths["md"].read_text(), paths["html"].read_text()
    assert "<img" not in md and "<img" not in page and "<b>" not in md + page
    assert "\n# injected" not in md and "](javascript" not in md
    rendered = MarkdownIt("commonmark").enable("table").render(md)
    assert "<img" not in rendered and "<a " not in rendered and "<em>" not in rendered
    assert "<b>" not in rendered and "<h1>injected" not in rendered
    for shown in (evil, "[click](javascript:alert(1))", "a|b\\n# injected"):
        assert html.escape(shown) in rendered and html.escape(shown) in page
    # the attack table keeps its columns (a pipe in a literal is escaped)
    header = next(line for line in md.splitlines() if line.startswith("| feature / attack"))
    rows = md.split(header, 1)[1].split("\n\n", 1)[0].strip().splitlines()[1:]
    assert rows and all(row.count("|") == header.count("|") for row in rows)


def test_a_name_with_mathtext_still_draws_the_figure(audited: Path, tmp_path: Path) -> None:
    """roc.png's title shows the run's method and dataset names as text: a file's
    ``$\\frac{x$`` used to stop the figure with a mathtext ValueError."""
    from fedlap_privacy.audit.reports.report_files import plot_roc

    data = json.loads((audited / "report.json").read_text())
    data["method"], data["dataset"]["name"] = "$\\frac{x$", "a$b$c\nd"
    assert plot_roc(data)[:4] == b"\x89PNG"
