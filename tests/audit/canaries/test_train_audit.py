"""End to end: a checkpoint written by training is audited against its own ledger
(docs/audit.md#what-is-tested)."""

from __future__ import annotations

import pytest

from fedlap_privacy.audit.inference.report import run_audit
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.simulation import CHECKPOINT, train


def test_strong_dp_model_is_not_attackable(tmp_path):
    """DP-FedAvg at epsilon ~1: AUC near 0.5 and an empirical bound below the promise."""
    cfg = TrainConfig(method="dp-fedavg", width=16, rounds=2, local_steps=5, batch_size=32,
                      sigma=None, target_eps=1.0, lr_local=0.5)
    result = train(cfg, tmp_path, device="cpu")
    eps = result.ledger.epsilon
    assert eps <= 1.0
    report = run_audit(tmp_path / CHECKPOINT, seed=0).to_json()
    assert report["privacy"]["epsilon"] == pytest.approx(eps)
    for feature in ("loss", "grad-norm"):
        for attack in report["attacks"][feature].values():
            assert abs(attack["auc"] - 0.5) < 0.1
    assert report["max_eps_lb"] < eps and not report["violation"]
