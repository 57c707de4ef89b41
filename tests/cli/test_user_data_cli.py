"""``train --data`` / ``--model`` from the command line: end to end, and bad input as one line
with exit 2 and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner
from user_records import blobs, tabular_folder

from fedlap_privacy.cli.main import app

runner = CliRunner()


def test_train_then_audit_on_a_tabular_folder(tmp_path: Path) -> None:
    data = tabular_folder(tmp_path / "d")
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--data", str(data), "--method", "dp-fedavg",
                                 "--target-eps", "3", "--rounds", "2", "--local-steps", "4",
                                 "--out", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["dataset"] == "custom" and summary["epsilon"] <= 3.0
    audit = runner.invoke(app, ["audit", "--model", str(out / "ckpt.pt"), "--attacks", "loss",
                                "--json"])
    assert audit.exit_code == 0, audit.stderr
    assert json.loads(audit.stdout.splitlines()[-1])["dataset"]["name"] == "custom"


def test_bad_data_is_one_line_and_nothing_is_written(tmp_path: Path) -> None:
    data = tabular_folder(tmp_path / "d")
    x, y = blobs(20, 0)
    np.savez(data / "site1.npz", x=x[:, :4], y=y)
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--data", str(data), "--out", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "4 features" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_dataset_and_data_exclude_each_other(tmp_path: Path) -> None:
    result = runner.invoke(app, ["train", "--data", str(tmp_path), "--dataset", "mnist",
                                 "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "exclude each other" in result.stderr
