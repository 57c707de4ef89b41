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

from fedlap_privacy.cli.audit import audit, render_report
from fedlap_privacy.models import ModelConfig, build_model
from fedlap_privacy.state.checkpoint import FORMAT, save_checkpoint

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


# ------------------------------------------------- bad input still escaped (issue 33, item 7)


@pytest.fixture
def external(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """A TorchScript 10-class ConvNet on 8x8 images and 40 records for it (labels 0..9)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(1, 8, 10, width=8))
    torch.jit.save(torch.jit.script(model.eval()), tmp_path / "model.pt")
    rng = np.random.default_rng(0)
    return tmp_path / "model.pt", rng.normal(size=(40, 1, 8, 8)).astype(np.float32), \
        np.arange(40) % 10


def _external_fails(model: Path, members: Path, nonmembers: Path, *extra: str) -> str:
    return _fails(["--model", str(model), "--members", str(members), "--nonmembers",
                   str(nonmembers), "--max-per-half", "5", *extra])


def test_truncated_npz_records_are_one_line(external, tmp_path: Path) -> None:
    model, x, y = external
    np.savez(tmp_path / "out.npz", x=x, y=y)
    whole = (tmp_path / "out.npz").read_bytes()
    for name, body in (("cut.npz", whole[: len(whole) // 2]),  # was: BadZipFile traceback
                       ("tail.npz", whole[:-40])):
        (tmp_path / name).write_bytes(body)
        line = _external_fails(model, tmp_path / name, tmp_path / "out.npz")
        assert f"cannot read {tmp_path / name} as .npz" in line


def test_npz_whose_header_declares_more_than_it_holds_is_refused_unallocated(
    external, tmp_path: Path
) -> None:
    """A forged header asking for 10^9 x 64 floats (256 GB) over a few bytes of data."""
    import io
    import zipfile

    from numpy.lib import format as npy

    model, x, y = external
    np.savez(tmp_path / "out.npz", x=x, y=y)
    for shape, data in (((10**9, 1, 8, 8), b"\0" * 64), ((40, 1, 8, 8), x.tobytes()[:-4])):
        header = io.BytesIO()
        npy.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                            "shape": shape})
        labels = io.BytesIO()
        np.save(labels, y)
        with zipfile.ZipFile(tmp_path / "forged.npz", "w") as archive:
            archive.writestr("x.npy", header.getvalue() + data)
            archive.writestr("y.npy", labels.getvalue())
        line = _external_fails(model, tmp_path / "forged.npz", tmp_path / "out.npz")
        assert f"declares shape {shape}" in line and "truncated or forged" in line


def test_labels_the_model_cannot_score_are_one_line(external, tmp_path: Path) -> None:
    model, x, y = external
    np.savez(tmp_path / "out.npz", x=x, y=y)
    np.savez(tmp_path / "high.npz", x=x, y=y + 3)  # labels up to 12 for a 10-class model
    line = _external_fails(model, tmp_path / "high.npz", tmp_path / "out.npz")
    assert "labels run up to 12, but the model outputs 10 classes" in line  # was: IndexError
    np.savez(tmp_path / "big.npz", x=np.zeros((40, 1, 28, 28), np.float32), y=y)
    line = _external_fails(model, tmp_path / "big.npz", tmp_path / "big.npz")
    assert "the model cannot score records of shape (1, 28, 28)" in line
    bad = x.copy()
    bad[3, 0, 0, 0] = np.nan
    np.savez(tmp_path / "nan.npz", x=bad, y=y)
    assert "NaN or infinite" in _external_fails(model, tmp_path / "nan.npz", tmp_path / "out.npz")


def test_an_audit_out_that_cannot_be_created_is_one_line(external, tmp_path: Path) -> None:
    model, x, y = external
    np.savez(tmp_path / "records.npz", x=x, y=y)
    (tmp_path / "file").write_text("keep")
    line = _external_fails(model, tmp_path / "records.npz", tmp_path / "records.npz",
                           "--out", str(tmp_path / "file" / "report"))
    assert "--out" in line and "is a file, not a folder" in line
