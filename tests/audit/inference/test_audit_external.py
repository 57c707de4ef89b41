"""Audit a model trained elsewhere: the Python API and ``audit --model`` on a TorchScript
module or a state dict with a factory, members and non-members from .npz or IDX files
(exported programs, and the attacks on them: test_audit_pt2_safety.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from fedlap_privacy.audit.inference.external import audit_model
from fedlap_privacy.cli.main import app

runner = CliRunner()
FACTORY = '''
import torch.nn as nn

def make():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
'''


def _make() -> torch.nn.Module:
    namespace: dict = {}
    exec(FACTORY, namespace)  # the same model the factory file builds
    return namespace["make"]()


@pytest.fixture(scope="module")
def overfit():
    """A small MLP trained elsewhere to memorise 200 records of random pixels and labels
    (nothing to generalise: a member's loss is near 0, a non-member's is not); 200 others
    unseen. Pixels are whole numbers / 255, as an IDX file holds them."""
    rng = np.random.default_rng(0)
    x = (rng.integers(0, 256, size=(400, 1, 8, 8)) / 255.0).astype(np.float32)
    y = rng.integers(0, 10, size=400).astype(np.int64)
    torch.manual_seed(0)
    model = _make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    xm, ym = torch.from_numpy(x[:200]), torch.from_numpy(y[:200])
    for _ in range(300):
        opt.zero_grad()
        F.cross_entropy(model(xm), ym).backward()
        opt.step()
    model.eval()
    return model, (x[:200], y[:200]), (x[200:], y[200:])


def test_python_api_finds_the_memorised_records(overfit) -> None:
    model, members, nonmembers = overfit
    report = audit_model(model, members, nonmembers, claimed_epsilon=0.5, attacks="loss").to_json()
    m = report["attacks"]["loss"]["threshold"]
    assert m["auc"] > 0.9  # memorised
    assert report["violation"] is True and report["max_eps_lb"] > 0.5
    clean = audit_model(model, members, nonmembers, attacks="loss").to_json()
    assert clean["privacy"]["notion"] == "none" and clean["violation"] is False


def _idx(path: Path, images: np.ndarray, labels: np.ndarray) -> str:
    (path / "img").write_bytes(struct.pack(">4i", 2051, *images.shape) + images.tobytes())
    (path / "lab").write_bytes(struct.pack(">2i", 2049, len(labels)) + labels.tobytes())
    return f"{path / 'img'},{path / 'lab'}"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch 2.13 deprecates TorchScript
def test_cli_torchscript_with_npz_records(overfit, tmp_path: Path) -> None:
    """Every default attack, grad-norm included (torch.func used to refuse a scripted module:
    "stateless API can't be used with Jitted modules", a traceback)."""
    model, members, nonmembers = overfit
    torch.jit.save(torch.jit.script(model), tmp_path / "model.pt")
    np.savez(tmp_path / "in.npz", x=members[0], y=members[1])
    np.savez(tmp_path / "out.npz", x=nonmembers[0], y=nonmembers[1])
    result = runner.invoke(app, [
        "audit", "--model", str(tmp_path / "model.pt"), "--members", str(tmp_path / "in.npz"),
        "--nonmembers", str(tmp_path / "out.npz"), "--claimed-eps", "0.5", "--json",
        "--fail-on-violation"])
    assert result.exit_code == 1, result.stderr  # a violation, as asked to fail on
    report = json.loads(result.stdout)
    assert report["privacy"]["epsilon"] == 0.5 and report["violation"] is True
    assert set(report["attacks"]) == {"loss", "grad-norm"}
    assert report["attacks"]["grad-norm"]["threshold"]["auc"] > 0.9  # memorised: small grads


class _Branchy(torch.nn.Module):
    """Data-dependent control flow: TorchScript runs it, torch.func's vmap cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x.flatten(1))
        if bool(h.sum() > 0):
            h = h * 2.0
        return h


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_cli_torchscript_grad_norm_cannot_trace_gets_one_line(overfit, tmp_path: Path) -> None:
    _, members, nonmembers = overfit
    torch.jit.save(torch.jit.script(_Branchy()), tmp_path / "model.pt")
    np.savez(tmp_path / "in.npz", x=members[0], y=members[1])
    np.savez(tmp_path / "out.npz", x=nonmembers[0], y=nonmembers[1])
    base = ["audit", "--model", str(tmp_path / "model.pt"), "--members",
            str(tmp_path / "in.npz"), "--nonmembers", str(tmp_path / "out.npz"), "--json"]
    result = runner.invoke(app, base)
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    line = " ".join(result.stderr.split())
    assert len(result.stderr.strip().splitlines()) == 1
    assert "the grad-norm attack cannot run on this TorchScript module" in line
    assert "data-dependent control flow" in line and "--attacks loss" in line
    result = runner.invoke(app, [*base, "--attacks", "loss"])  # the way out it names
    assert result.exit_code == 0, result.stderr
    assert set(json.loads(result.stdout)["attacks"]) == {"loss"}


def test_help_warns_that_torchscript_runs_code() -> None:
    result = runner.invoke(app, ["audit", "--help"], env={"COLUMNS": "200"})
    text = " ".join(result.stdout.replace("│", " ").split())
    assert "loading TorchScript runs the file's code" in text
    assert "read without unpickling" in text


def test_cli_state_dict_with_factory_and_idx_records(overfit, tmp_path: Path) -> None:
    model, members, nonmembers = overfit
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    (tmp_path / "factory.py").write_text(FACTORY)
    sets = []
    for name, (x, y) in (("in", members), ("out", nonmembers)):
        folder = tmp_path / name
        folder.mkdir()
        sets.append(_idx(folder, np.rint(x[:, 0] * 255).astype(np.uint8), y.astype(np.uint8)))
    result = runner.invoke(app, [
        "audit", "--model", str(tmp_path / "weights.pt"), "--model-factory",
        f"{tmp_path / 'factory.py'}:make", "--members", sets[0], "--nonmembers", sets[1],
        "--attacks", "loss", "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["attacks"]["loss"]["threshold"]["auc"] > 0.9


def test_exported_program(overfit, tmp_path: Path) -> None:
    model, members, nonmembers = overfit
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(model, (torch.from_numpy(members[0][:2]),),
                                  dynamic_shapes=({0: batch},))
    torch.export.save(program, tmp_path / "model.pt2")
    np.savez(tmp_path / "in.npz", x=members[0], y=members[1])
    np.savez(tmp_path / "out.npz", x=nonmembers[0], y=nonmembers[1])
    result = runner.invoke(app, [
        "audit", "--model", str(tmp_path / "model.pt2"), "--members", str(tmp_path / "in.npz"),
        "--nonmembers", str(tmp_path / "out.npz"), "--json"])
    assert result.exit_code == 0, result.stderr
    attacks = json.loads(result.stdout)["attacks"]
    assert attacks["loss"]["threshold"]["auc"] > 0.9 and "grad-norm" in attacks


@pytest.mark.parametrize(("args", "message"), [
    (["--members", "x.npz"], "both --members and --nonmembers"),
    (["--claimed-eps", "1"], "apply to a model trained elsewhere"),
])
def test_cli_refuses_incomplete_requests(tmp_path: Path, args, message) -> None:
    model = tmp_path / "m.pt"
    torch.save({"w": torch.zeros(1)}, model)
    result = runner.invoke(app, ["audit", "--model", str(model), *args])
    assert result.exit_code == 2 and message in " ".join(result.stderr.split())


def test_state_dict_without_factory_and_bad_records(overfit, tmp_path: Path) -> None:
    model, members, _ = overfit
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    np.savez(tmp_path / "in.npz", x=members[0], y=members[1])
    np.savez(tmp_path / "bad.npz", images=members[0])
    base = ["audit", "--model", str(tmp_path / "weights.pt"), "--members",
            str(tmp_path / "in.npz")]
    result = runner.invoke(app, [*base, "--nonmembers", str(tmp_path / "in.npz")])
    assert result.exit_code == 2 and "--model-factory" in result.stderr
    (tmp_path / "factory.py").write_text(FACTORY)
    result = runner.invoke(app, [*base, "--nonmembers", str(tmp_path / "bad.npz"),
                                 "--model-factory", f"{tmp_path / 'factory.py'}:make"])
    assert result.exit_code == 2 and "needs arrays 'x' and 'y'" in result.stderr


def test_factory_that_needs_arguments_is_one_line(overfit, tmp_path: Path) -> None:
    """A run's factory ``make(shape, k)`` given with --members used to end in a TypeError
    traceback (exit 1)."""
    model, members, _ = overfit
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    np.savez(tmp_path / "in.npz", x=members[0], y=members[1])
    (tmp_path / "factory.py").write_text("def make(shape, k):\n    raise AssertionError\n")
    result = runner.invoke(app, [
        "audit", "--model", str(tmp_path / "weights.pt"), "--members", str(tmp_path / "in.npz"),
        "--nonmembers", str(tmp_path / "in.npz"), "--model-factory",
        f"{tmp_path / 'factory.py'}:make"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot be called without arguments" in lines[0]
    assert "'shape' and 'k'" in lines[0]
