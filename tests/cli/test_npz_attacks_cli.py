"""Forged ``.npz`` archives at the command line (issue 46, item 4): ``train --data`` and
``audit --members`` end in one line and exit 2, with nothing trained or written."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from npz_forge import npy_bytes, stored, write_zip
from typer.testing import CliRunner
from user_records import blobs, tabular_folder

from fedlap_privacy.cli.main import app
from fedlap_privacy.models import ModelConfig, build_model

runner = CliRunner()


def _one_line(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def test_train_data_with_a_fifo_client_is_one_line(tmp_path: Path) -> None:
    """Two of three clients used to train, exit 0."""
    data = tabular_folder(tmp_path / "d", sizes=(20, 20), test=0)
    os.mkfifo(data / "c.npz")
    out = tmp_path / "run"
    line = _one_line(["train", "--data", str(data), "--rounds", "1", "--batch-size", "8",
                      "--out", str(out)])
    assert str(data / "c.npz") in line and "not a regular file" in line
    assert not out.exists()


def test_train_data_beyond_float32_is_one_line(tmp_path: Path) -> None:
    """Used to train a run of NaN weights and exit 0."""
    data = tmp_path / "d"
    data.mkdir()
    for k in range(2):
        x, y = blobs(30, k)
        x = x.astype(np.float64)
        x[3, 1] = -1e39 if k else 0.0
        np.savez(data / f"site{k}.npz", x=x, y=y)
    out = tmp_path / "run"
    line = _one_line(["train", "--data", str(data), "--rounds", "1", "--local-steps", "1",
                      "--batch-size", "8", "--out", str(out)])
    assert "site1.npz" in line and "record 3" in line and "float32" in line
    assert not out.exists()


def test_audit_members_with_a_duplicate_member_is_one_line(tmp_path: Path) -> None:
    """x.npy twice: the header checked (float32 images) was not the array read (complex)."""
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(build_model(ModelConfig(1, 8, 10, width=8)).eval()),
                   tmp_path / "model.pt")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 1, 8, 8)).astype(np.float32), np.arange(40) % 10
    np.savez(tmp_path / "out.npz", x=x, y=y)
    write_zip(tmp_path / "in.npz", [stored("x.npy", npy_bytes(x.astype(np.complex64))),
                                    stored("x.npy", npy_bytes(x)), stored("y.npy", npy_bytes(y))])
    line = _one_line(["audit", "--model", str(tmp_path / "model.pt"), "--members",
                      str(tmp_path / "in.npz"), "--nonmembers", str(tmp_path / "out.npz"),
                      "--max-per-half", "5"])
    assert "in.npz" in line and "'x' twice" in line
