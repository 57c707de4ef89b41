"""``audit`` command: bad input gives one line on stderr and exit != 0; good input a report.

The command is registered on a throwaway Typer app here (the real app lives in cli/main.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from helpers import ledger_claiming, save_run_files
from typer.testing import CliRunner

from fedlap_privacy.checkpoint import FORMAT, save_checkpoint
from fedlap_privacy.cli.audit import audit, render_report
from fedlap_privacy.models import ModelConfig, build_model

app = typer.Typer()
app.command("audit")(audit)


@app.command("noop")
def _noop() -> None:  # a second command keeps "audit" a sub-command, as in the real app
    """Nothing."""


runner = CliRunner()


class _MakesMarker:
    """Pickles to a call of os.mkdir(marker): code that would run if the file were unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def _save(path: Path, payload: dict, indices: list | None = None,
          data_dir: str | None = None) -> Path:
    return save_run_files(path, payload, [torch.arange(200)] if indices is None else indices,
                          data_dir)


def _payload(dataset: str = "digits") -> dict:
    size = 8 if dataset == "digits" else 28
    config = ModelConfig(1, size, 10, width=8)
    torch.manual_seed(0)
    return {
        "model_state": build_model(config).state_dict(),
        "model_config": config.to_dict(),
        "dataset": {"name": dataset},
        "privacy": {"notion": "record-level", "epsilon": 3.0, "delta": 1e-5, "accountant": "rdp"},
        "ledger": ledger_claiming(3.0),
        "config": {},
        "round": 1,
        "method": "fedlap-dp",
    }


def _fails(args: list[str]) -> str:
    """Run the command expecting a clean failure; return its one stderr line."""
    result = runner.invoke(app, ["audit", *args])
    assert result.exit_code != 0, result.stdout
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert lines[0].startswith("error:")
    return lines[0]


def test_missing_file(tmp_path: Path) -> None:
    assert "no such checkpoint" in _fails(["--model", str(tmp_path / "nope.pt")])


def test_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "noise.pt"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    assert "not a readable torch checkpoint" in _fails(["--model", str(path)])


def test_tampered_checkpoint_does_not_run_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({**_payload(), "format": FORMAT, "hook": _MakesMarker(marker)}, path)
    line = _fails(["--model", str(path)])
    assert "refusing to load" in line
    assert not marker.exists()


def test_unknown_dataset(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    _save(path, _payload(dataset="imagenet"))
    assert "unknown dataset 'imagenet'" in _fails(["--model", str(path)])


def test_mnist_without_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    path = tmp_path / "ckpt.pt"
    _save(path, _payload(dataset="mnist"), data_dir=str(empty))
    line = _fails(["--model", str(path)])  # the data dir recorded in the checkpoint
    assert "missing dataset file" in line and "--data-dir" in line
    line = _fails(["--model", str(path), "--data-dir", str(empty)])
    assert "missing dataset file" in line


def test_unknown_attack_and_bad_split(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    _save(path, _payload())
    assert "unknown attack 'entropy'" in _fails(["--model", str(path), "--attacks", "entropy"])
    _save(path, _payload(), [torch.tensor([5, 10**6])])
    assert "out of range" in _fails(["--model", str(path)])
    save_checkpoint(path, {"model_state": {}})
    assert "lacks 'model_config'" in _fails(["--model", str(path)])


def test_json_and_table_output(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    _save(path, _payload())
    args = ["audit", "--model", str(path), "--max-per-half", "60", "--seed", "1"]
    result = runner.invoke(app, [*args, "--json", "--attacks", "loss"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)  # exactly one JSON object on stdout
    assert report["sets"]["per_half"] == 60
    assert set(report["attacks"]) == {"loss"}
    assert report["privacy"]["epsilon"] == pytest.approx(3.0, rel=1e-3)
    assert report["violation"] is False
    out = tmp_path / "out"
    result = runner.invoke(app, [*args, "--out", str(out)], terminal_width=160)
    assert result.exit_code == 0, result.stderr
    for needle in ("AUC", "TPR@1%FPR", "grad-norm", "epsilon = 3.000", "record-level"):
        assert needle in result.stdout, needle
    assert "VIOLATION" not in result.stdout
    assert (out / "report.json").is_file() and (out / "roc.png").is_file()


def test_violation_line(capsys: pytest.CaptureFixture[str]) -> None:
    metrics = {
        "auc": 0.9,
        "tpr_at_fpr_0.001": 0.1,
        "tpr_at_fpr_0.01": 0.2,
        "balanced_accuracy": 0.8,
        "eps_lb": 1.5,
    }
    report = {
        "dataset": {"name": "digits"},
        "sets": {"per_half": 100},
        "attacks": {"loss": {"threshold": metrics}},
        "privacy": {
            "notion": "record-level",
            "epsilon": 1.0,
            "delta": 1e-5,
            "accountant": "rdp",
            "epsilon_tested": 1.0,
            "delta_tested": 1e-5,
            "basis": "record-level DP, as promised",
        },
        "max_eps_lb": 1.5,
        "max_eps_lb_attack": "loss/threshold",
        "confidence": 0.95,
        "violation": True,
    }
    render_report(report)
    assert "VIOLATION" in capsys.readouterr().out


def test_cli_module_does_not_import_torch() -> None:
    code = "import sys, fedlap_privacy.cli.audit; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
