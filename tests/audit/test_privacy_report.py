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

from fedlap_privacy.audit.privacy_report import fmt
from fedlap_privacy.checkpoint import CHECKPOINT
from fedlap_privacy.cli.main import app
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.simulation import train

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
    """The numbers of a report, code spans (names, paths) left out."""
    text = re.sub(r"`[^`]*`", " ", text)
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
