"""``train`` as a user of the ecosystem drives it: a named target is spent, sizes are reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedlap_privacy.cli.main import app

runner = CliRunner()
SMALL = ["--method", "dp-fedavg", "--local-steps", "2", "--set", "width=8"]


def _summary(args: list[str]) -> dict:
    result = runner.invoke(app, ["train", *SMALL, *args, "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_target_eps_alone_plans_sigma_and_spends_it(tmp_path: Path) -> None:
    summary = _summary(["--target-eps", "3", "--rounds", "3", "--out", str(tmp_path / "a")])
    assert summary["sigma_planned"] is True and summary["rounds_run"] == 3
    assert summary["epsilon"] == pytest.approx(3.0, rel=2e-3) and summary["epsilon"] <= 3.0


def test_explicit_sigma_keeps_the_stop_early_behaviour(tmp_path: Path) -> None:
    summary = _summary(["--target-eps", "3", "--sigma", "1", "--rounds", "10",
                        "--out", str(tmp_path / "b")])
    assert summary["sigma_planned"] is False and summary["sigma"] == 1.0
    assert summary["rounds_run"] < 10 and "would be exceeded" in summary["stopped"]


def test_summary_reports_upload_bytes(tmp_path: Path) -> None:
    summary = _summary(["--rounds", "2", "--out", str(tmp_path / "c")])
    history = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text()
               .splitlines()]
    assert summary["upload_bytes_mean"] == history[0]["upload_bytes"] > 0
    assert summary["upload_bytes_total"] == pytest.approx(
        sum(h["upload_bytes"] * h["replies"] for h in history))
