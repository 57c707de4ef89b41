"""End-to-end membership-inference audit on small digits ConvNets (docs/audit.md; paper 6.6).

Checkpoints are built here with plain torch in the schema ``train`` writes:

* ``overfit``: a non-private ConvNet (width 32) trained full-batch with Adam to near-zero
  loss on 280 digits training records (the members). It must be visibly attackable.
* ``untrained``: a randomly initialised ConvNet whose checkpoint claims all 1438 training
  records as members. Its weights never saw any record, so it stands in for the limit of
  strong DP: membership is independent of the weights and every attack must sit at AUC
  ~0.5 with an epsilon lower bound of 0. (The real DP check is an audit of a ``train`` run.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import ledger_claiming, save_run_files

from fedlap_privacy.audit.bounds.metrics import attack_metrics
from fedlap_privacy.audit.inference.attacks import MLPAttack, ThresholdAttack
from fedlap_privacy.audit.inference.features import compute_features
from fedlap_privacy.audit.inference.membership import make_membership_split
from fedlap_privacy.audit.inference.report import evaluate_attacks, run_audit
from fedlap_privacy.data.datasets import load_dataset
from fedlap_privacy.errors import CheckpointError, DataError
from fedlap_privacy.models import ModelConfig, build_model

CONFIG = ModelConfig(in_channels=1, image_size=8, num_classes=10, width=32)
NONE = {"notion": "none", "epsilon": None, "delta": None, "accountant": None}


def _save(path: Path, model: torch.nn.Module, members: np.ndarray, *args: Any) -> Path:
    """A run folder: the release checkpoint at ``path``, ``private.pt`` beside it."""
    indices = [torch.as_tensor(p) for p in np.array_split(members, 2)]
    return save_run_files(path, _checkpoint(model, members, *args), indices)


def _checkpoint(
    model: torch.nn.Module,
    members: np.ndarray,
    privacy: dict[str, Any] = NONE,
    config: ModelConfig = CONFIG,
    dataset: str = "digits",
) -> dict[str, Any]:
    return {
        "model_state": model.state_dict(),
        "model_config": config.to_dict(),
        "dataset": {"name": dataset},
        "privacy": privacy,
        "ledger": ledger_claiming(privacy["epsilon"]) if privacy.get("epsilon") else [],
        "config": {},
        "round": 1,
        "method": "test",
    }


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="module")
def overfit(digits, tmp_path_factory) -> tuple[Path, torch.nn.Module, np.ndarray]:
    """A ConvNet trained to near-zero loss on 280 records; its checkpoint path."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: threads only add overhead on a busy 2-core box
    try:
        torch.manual_seed(0)
        members = np.sort(np.random.default_rng(0).permutation(len(digits.y_train))[:280])
        model = build_model(CONFIG)
        x = torch.as_tensor(digits.x_train[members])
        y = torch.as_tensor(digits.y_train[members])
        opt = torch.optim.Adam(model.parameters(), lr=3e-2)
        for _ in range(200):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        with torch.no_grad():
            assert F.cross_entropy(model(x), y).item() < 0.01  # memorised
    finally:
        torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("overfit") / "ckpt.pt"
    _save(path, model, members)
    return path, model, members


@pytest.fixture(scope="module")
def overfit_features(overfit, digits):
    """Features of the overfit model on the default audit sets (computed once)."""
    _, model, members = overfit
    split = make_membership_split(members, digits.y_train, digits.y_test, seed=0)
    x, y, is_member, is_audit = split.gather(
        digits.x_train, digits.y_train, digits.x_test, digits.y_test
    )
    return compute_features(model, x, y), is_member, is_audit


def test_overfit_model_is_attackable(overfit, tmp_path) -> None:
    path, _, _ = overfit
    report = run_audit(path, out_dir=tmp_path / "out").to_json()
    aucs = {(f, k): m["auc"] for f, by in report["attacks"].items() for k, m in by.items()}
    # Measured: loss/mlp 0.83, loss/threshold 0.84, grad-norm/mlp 0.83, /threshold 0.85.
    assert all(auc >= 0.75 for auc in aucs.values()), aucs
    assert report["sets"]["per_half"] == 140  # 280 members -> 2 x 140, test halves cut to fit
    assert report["max_eps_lb"] > 0.5  # measured 1.44: a confident, non-trivial bound
    assert report["violation"] is False  # non-private: nothing promised
    assert report["privacy"]["epsilon_tested"] is None
    loss = report["attacks"]["loss"]["threshold"]
    assert loss["feature_median"]["members"] < loss["feature_median"]["nonmembers"]
    assert 0 <= loss["tpr_at_fpr_0.001"] <= loss["tpr_at_fpr_0.01"] <= 1
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["attacks"]["loss"]["mlp"]["auc"] == pytest.approx(aucs[("loss", "mlp")])
    png = (tmp_path / "out" / "roc.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # Same seed, same numbers.
    again = run_audit(path, attacks="loss").to_json()
    assert again["attacks"]["loss"]["mlp"]["auc"] == report["attacks"]["loss"]["mlp"]["auc"]


def test_swapped_labels_invert_the_attack(overfit_features) -> None:
    features, is_member, is_audit = overfit_features
    for name, values in features.items():
        audit_x, audit_y = values[is_audit], is_member[is_audit]
        train_x, train_y = values[~is_audit], is_member[~is_audit]
        # Training-free attack scored against swapped labels: AUC mirrored below 0.5.
        swapped = attack_metrics(~audit_y, ThresholdAttack().score(audit_x)).auc
        assert swapped <= 0.25, (name, swapped)  # measured 0.15 (loss), 0.16 (grad-norm)
        # The MLP trained on swapped labels learns "low loss = non-member" (measured 0.17).
        mlp = MLPAttack(seed=0).fit(train_x, ~train_y)
        assert attack_metrics(audit_y, mlp.score(audit_x)).auc <= 0.25, name


def test_shuffled_labels_give_chance(overfit_features) -> None:
    features, is_member, is_audit = overfit_features
    rng = np.random.default_rng(0)
    shuffled = is_member.copy()
    for half in (is_audit, ~is_audit):  # permute within each half: still balanced
        shuffled[half] = rng.permutation(shuffled[half])
    results = evaluate_attacks(features, shuffled, is_audit, seed=0)
    for name, by in results.items():
        for kind, m in by.items():
            # 140 + 140 audit records: AUC under the null has sd ~0.035 (measured 0.48-0.56).
            assert abs(m.auc - 0.5) < 0.12, (name, kind, m.auc)
            assert m.eps_lb == 0.0


def test_untrained_model_sits_at_chance(digits, tmp_path) -> None:
    torch.manual_seed(1)
    model = build_model(CONFIG)
    members = np.arange(len(digits.y_train))
    privacy = {"notion": "record-level", "epsilon": 1.0, "delta": 1e-5, "accountant": "rdp"}
    path = tmp_path / "ckpt.pt"
    _save(path, model, members, privacy)
    report = run_audit(path, seed=0).to_json()
    assert report["sets"]["per_half"] == 179  # limited by the 359 test records
    for by in report["attacks"].values():
        for m in by.values():
            assert abs(m["auc"] - 0.5) < 0.1, m["auc"]  # measured 0.47-0.50; null sd ~0.03
            assert m["eps_lb"] == 0.0
    assert report["violation"] is False
    assert report["privacy"]["epsilon_tested"] == pytest.approx(1.0, rel=1e-3)


def test_violation_is_flagged(overfit, tmp_path) -> None:
    _, model, members = overfit
    claim = {"notion": "record-level", "epsilon": 0.2, "delta": 1e-5, "accountant": "rdp"}
    path = tmp_path / "lying.pt"
    _save(path, model, members, claim)
    report = run_audit(path, attacks="grad-norm").to_json()
    assert report["max_eps_lb"] > report["privacy"]["epsilon"] == pytest.approx(0.2, rel=1e-3)
    assert report["violation"] is True
    assert report["privacy"]["delta_tested"] == 1e-5


def test_checkpoint_dataset_mismatch(digits, tmp_path) -> None:
    model = build_model(CONFIG)
    bad_index = np.array([0, len(digits.y_train)])  # one past the end of the train set
    _save(tmp_path / "a.pt", model, bad_index)
    with pytest.raises(CheckpointError, match="out of range"):
        run_audit(tmp_path / "a.pt")
    config28 = ModelConfig(1, 28, 10, width=8)
    _save(tmp_path / "b.pt", build_model(config28), np.arange(10), NONE, config28)
    with pytest.raises(DataError, match="expects 1x28x28"):
        run_audit(tmp_path / "b.pt")
    state = _checkpoint(model, np.arange(10))
    state["model_state"] = {"features.0.weight": torch.zeros(3)}
    save_run_files(tmp_path / "c.pt", state, [torch.arange(10)])
    with pytest.raises(CheckpointError, match="cannot rebuild"):
        run_audit(tmp_path / "c.pt")
