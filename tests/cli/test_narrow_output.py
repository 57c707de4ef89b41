"""Tables at 80 columns and in a pipe (typer's CliRunner is one): every cell wraps or folds,
none is cut with an ellipsis ("Ste…", "0.3…")."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fedlap_privacy.cli.main import app

ELLIPSIS = "…"


@pytest.fixture
def constant_timing(monkeypatch):
    from fedlap_privacy.fl.engine import dry_run

    monkeypatch.setattr(dry_run, "time_steps",
                        lambda cfg, data, device: dry_run.RoundTiming(1, 2, 0.5, 1, 0, "cpu"))


def _narrow(args: list[str]) -> str:
    result = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.output


def test_compare_plan_keeps_every_value_whole_at_80_columns(tmp_path, constant_timing):
    out = _narrow(["compare", "--eps", "3", "--rounds", "1", "--set", "width=4", "--out",
                   str(tmp_path / "c"), "--dry-run"])
    assert ELLIPSIS not in out
    assert "dp-fedavg-client" in out and "dp-normfedavg" in out  # the method names whole
    assert max(len(line) for line in out.splitlines()) <= 80


def test_plan_and_train_tables_at_80_columns(tmp_path):
    out = _narrow(["plan", "--client-fraction", "0.5", "--threat-model", "hidden-selection"])
    assert ELLIPSIS not in out and "same sigma and rounds, PLD" in out
    out = _narrow(["train", "--method", "dp-fedavg", "--sigma", "2", "--rounds", "1", "--set",
                   "width=4", "--set", "local_steps=1", "--out", str(tmp_path / "t")])
    assert ELLIPSIS not in out and "test acc" in out
