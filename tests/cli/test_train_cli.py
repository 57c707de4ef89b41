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


def test_one_resolver_layers_preset_flags_and_settings() -> None:
    from fedlap_privacy.fl.config import config_value, resolve_config

    cfg = resolve_config("paper-dp", {"rounds": 3, "sigma": None}, ["lr_net=0.01"])
    assert (cfg.method, cfg.rounds, cfg.lr_net, cfg.sigma) == ("fedlap-dp", 3, 0.01, 1.0)
    planned = resolve_config(None, {"target_eps": 3.0}, [])
    assert planned.sigma is None  # planned for the rounds by the driver
    kept = resolve_config(None, {"target_eps": 3.0}, ["sigma=2"])  # a sigma set via --set
    assert kept.sigma == 2.0
    ali = resolve_config(None, {"method": "ali-dpfl", "target_eps": 3.0}, [])
    assert ali.sigma == 1.5  # ALI-DPFL keeps a fixed sigma
    # the same parser reads text (--set) and TOML-typed values (Flower's run config)
    assert config_value("rounds", "12", text=True) == config_value("rounds", 12.0, text=False)
    with pytest.raises(ValueError, match="must be int"):
        config_value("rounds", "12", text=False)
