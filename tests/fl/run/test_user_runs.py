"""Training on a user's records and model (fl.run.user_runs): every method trains a tiny custom
model on tabular data; refusals come before anything is read or written; ckpt.pt records the
factory spec and the audit rebuilds it; changed files refuse --resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from torch import nn
from user_records import CLASSES, FEATURES, blobs, tabular_folder

from fedlap_privacy.accountant import FedLAPSchedule, epsilon
from fedlap_privacy.errors import CheckpointError, ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.config_rules import METHODS
from fedlap_privacy.fl.engine.simulation import resume, train
from fedlap_privacy.state.run_state import ModelRelease

FACTORY = f"{__name__}:tiny_model"


def tiny_model(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A custom model the fast paths do not know: LayerNorm and Tanh (vmap per-record path)."""
    return nn.Sequential(nn.Linear(input_shape[0], 12), nn.LayerNorm(12), nn.Tanh(),
                         nn.Linear(12, num_classes))


def with_batchnorm(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(input_shape[0], 8), nn.BatchNorm1d(8),
                         nn.Linear(8, num_classes))


def not_a_module(input_shape: tuple[int, ...], num_classes: int) -> str:
    return "model"


def raises(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    raise RuntimeError("no GPU here")


#: per method: settings that make it train on 3 small clients, and the accuracy it must reach
#: (chance is 1/3); client-level DP (3 clients) and LDP-FL noise everything: they must run
#: and account, not learn
SETTINGS: dict[str, tuple[dict, float]] = {
    "fedlap": (dict(lr_img=1.0, lr_net=0.5), 0.8),
    "fedlap-dp": (dict(lr_img=1.0, lr_net=0.5, sigma=0.8), 0.7),
    "fedavg": ({}, 0.8), "fedprox": ({}, 0.8), "scaffold": ({}, 0.8), "fedsgd": ({}, 0.6),
    "dp-fedavg": (dict(sigma=0.8), 0.7), "dp-fedprox": (dict(sigma=0.8), 0.7),
    "ali-dpfl": (dict(sigma=0.8, target_eps=50.0), 0.6),
    "dp-normfedavg": (dict(sigma=0.5), 0.0), "dp-fedavg-client": (dict(sigma=0.5), 0.0),
    "ldp-fl": (dict(ldp_epsilon=5.0), 0.0),
}


def _cfg(**kw: object) -> TrainConfig:
    base = dict(rounds=3, batch_size=32, local_steps=6, lr_local=0.3, max_loops=2,
                real_batches=2, syn_steps=3, ipc=4, server_epochs=20, model=FACTORY, seed=0)
    return TrainConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_settings_cover_every_method() -> None:
    assert set(SETTINGS) == set(METHODS)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_a_custom_model_on_tabular_data(tmp_path: Path,
                                                            method: str) -> None:
    extra, floor = SETTINGS[method]
    data = tabular_folder(tmp_path / "d")
    result = train(_cfg(method=method, **extra), tmp_path / "run", "cpu", data=data)
    assert result.summary.dataset == "custom" and result.summary.rounds_run >= 1
    assert result.summary.test_accuracy >= floor
    assert np.isfinite(result.history[-1].test_loss)
    release = ModelRelease.load(tmp_path / "run" / "ckpt.pt")
    assert release.model_factory == {"factory": FACTORY, "input_shape": [FEATURES],
                                     "num_classes": CLASSES}
    assert "data" not in release.config  # the data path stays in private.pt


def test_dp_epsilon_is_the_accountants_on_the_natural_partition(tmp_path: Path) -> None:
    data = tabular_folder(tmp_path / "d", sizes=(90, 80, 70), test=60)
    result = train(_cfg(method="dp-fedavg", sigma=1.0, model=None), None, "cpu", data=data)
    step = FedLAPSchedule(batch_size=32, client_size=70, local_steps=6)
    assert result.summary.privacy.accountant == "pld"
    assert result.summary.privacy.epsilon == pytest.approx(epsilon(step, 1.0, 3, 1e-5, "pld"),
                                                      rel=1e-9)
    assert result.summary.test_accuracy > 0.8  # the default MLP


def test_held_out_evaluation_is_declared_public(tmp_path: Path) -> None:
    data = tabular_folder(tmp_path / "d", test=0)
    result = train(_cfg(method="dp-fedavg", sigma=1.0, rounds=1), None, "cpu", data=data)
    assert any("held out of the clients' own data" in p for p in result.summary.privacy.public)
    with_test = train(_cfg(method="dp-fedavg", sigma=1.0, rounds=1), None, "cpu",
                      data=tabular_folder(tmp_path / "t"))
    assert not any("held out" in p for p in with_test.summary.privacy.public)


@pytest.mark.parametrize(("factory", "words"), [
    ("with_batchnorm", "layer '1' is BatchNorm1d"), ("not_a_module", "returned a str"),
    ("raises", "raised RuntimeError"), ("missing", "has no function missing"),
])
def test_bad_model_refused_before_features_are_read_and_nothing_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, factory: str, words: str) -> None:
    data = tabular_folder(tmp_path / "d")
    x, y = blobs(20, 0)
    x[0, 0] = np.nan  # would be refused too, but only once the features are read
    np.savez(data / "site0.npz", x=x, y=y)
    with pytest.raises(ConfigError, match=words):
        train(_cfg(model=f"{__name__}:{factory}"), tmp_path / "run", "cpu", data=data)
    assert not (tmp_path / "run").exists()


def test_factory_file_and_audit_rebuild(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedlap_privacy.audit.inference.report import run_audit

    (tmp_path / "net.py").write_text(
        "from torch import nn\n"
        "def make(shape, k):\n    return nn.Sequential(nn.Linear(shape[0], 8), nn.ReLU(), "
        "nn.Linear(8, k))\n")
    monkeypatch.chdir(tmp_path)
    tabular_folder(tmp_path / "d")
    train(_cfg(method="dp-fedavg", sigma=1.0, model="net.py:make", rounds=2), "run", "cpu",
          data="d")
    with pytest.raises(ConfigError, match=r"rerun with --model-factory net\.py:make"):
        run_audit("run/ckpt.pt", attacks="loss")  # recorded: shown, never imported alone
    report = run_audit("run/ckpt.pt", attacks="loss", factory="net.py:make")
    found = report.to_json()
    assert found["dataset"]["name"] == "custom" and found["privacy"]["epsilon"] > 0
    (tmp_path / "net.py").rename(tmp_path / "moved.py")
    with pytest.raises(ConfigError, match="cannot rebuild the run's model"):
        run_audit("run/ckpt.pt", attacks="loss", factory="net.py:make")
    assert run_audit("run/ckpt.pt", attacks="loss", factory="moved.py:make") is not None


def test_changed_files_refuse_resume(tmp_path: Path) -> None:
    data = tabular_folder(tmp_path / "d")
    train(_cfg(method="fedavg", rounds=1), tmp_path / "run", "cpu", data=data)
    x, y = blobs(90, 42)
    np.savez(data / "site0.npz", x=x, y=y)
    with pytest.raises(CheckpointError, match="training data changed"):
        resume(tmp_path / "run", rounds=2, device="cpu", model=FACTORY)


def test_resume_continues_on_the_same_files(tmp_path: Path) -> None:
    data = tabular_folder(tmp_path / "d")
    train(_cfg(method="dp-fedavg", sigma=1.0, rounds=1), tmp_path / "run", "cpu", data=data)
    result = resume(tmp_path / "run", rounds=2, device="cpu", model=FACTORY)
    assert result.summary.rounds_run == 2 and len(result.ledger.entries) == 2


