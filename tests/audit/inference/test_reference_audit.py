"""Reference-model attacks end to end: offline RMIA (Zarifzadeh, Liu, Shokri, ICML 2024) and
LiRA (Carlini et al. 2022) with reference models trained by the pipeline, in the
member/non-member audit, the black-box canary audit and ``audit --reference-models``.

The target must be overfit for membership to show: trained by ``train`` (non-private
FedAvg, 2 IID clients, 3 rounds of 100 local steps) on the digits dataset cut to 300
training records (the other 1497 are its test set), by patching the digits loader for this
module only. On all 1438 records digits generalises so well that no attack beats chance.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fedlap_privacy.audit.inference.reference_audit import ReferenceModel, ReferenceScorer
from fedlap_privacy.audit.inference.report import audited_records, run_audit
from fedlap_privacy.cli.main import app
from fedlap_privacy.data import datasets as data_module
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.auditing.reference_models import (
    MANIFEST,
    load_reference_models,
    train_reference_models,
)
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.simulation import train
from fedlap_privacy.state.checkpoint import CHECKPOINT

runner = CliRunner()
N_TRAIN = 300
OVERFIT = dict(method="fedavg", rounds=3, local_steps=100, width=16, split="iid",
               batch_size=32, lr_local=0.1, clients=2,
               split_seed=0)  # the measured split (the default draws a secret one)


def _small_digits() -> data_module.Dataset:
    """Digits with 300 training records (a fixed random draw) and 1497 test records."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x, y = bunch.data.reshape(-1, 1, 8, 8), bunch.target.astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(y))
    train_, test = np.sort(perm[:N_TRAIN]), np.sort(perm[N_TRAIN:])
    return data_module._make_dataset("digits", x[train_], y[train_], x[test], y[test], 16.0)


@pytest.fixture(scope="module", autouse=True)
def small_digits() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead on a busy 2-core box
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data_module, "_load_digits", _small_digits)
        yield
    torch.set_num_threads(threads)


def _mtimes(run: Path) -> list[int]:
    return [p.stat().st_mtime_ns for p in sorted((run / "reference").glob("*/ckpt.pt"))]


def test_rmia_beats_the_loss_attack_on_an_overfit_model(tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = train(TrainConfig(**OVERFIT), run)
    assert result.summary.privacy.notion == "none"
    audited = audited_records(run / CHECKPOINT)
    paths = train_reference_models(run, 2, audited, device="cpu")
    assert paths == [run / "reference" / "0", run / "reference" / "1"]
    refs = load_reference_models(paths)
    for ref in refs:  # offline: no audited record in any reference model's data
        assert len(ref.trained_on) == N_TRAIN and not np.isin(audited, ref.trained_on).any()
        assert ref.config.seed != 0 and ref.config.canaries == 0
    assert (run / "reference" / "0" / "private.pt").is_file()  # an ordinary run, own ledger
    report = run_audit(run / CHECKPOINT, attacks="loss", device="cpu",
                       reference_models=[ReferenceModel(r.model, r.trained_on, str(r.path))
                                         for r in refs]).to_json()
    attacks = report["attacks"]
    loss_auc = max(m["auc"] for m in attacks["loss"].values())
    loss_tpr = max(m["tpr_at_fpr_0.01"] for m in attacks["loss"].values())
    rmia, lira = attacks["rmia"]["score"], attacks["lira"]["score"]
    # Measured (150 + 150 audit records; digits draws / seeds 0, 1, 2): AUC loss 0.607 /
    # 0.585 / 0.558, RMIA 0.657 / 0.667 / 0.649, LiRA 0.625 / 0.648 / 0.649; TPR at 1% FPR
    # loss 0.020 / 0.060 / 0.007, RMIA 0.087 / 0.067 / 0.047, LiRA 0.073 / 0.067 / 0.020.
    assert rmia["auc"] >= loss_auc + 0.03, (rmia["auc"], loss_auc)
    assert rmia["tpr_at_fpr_0.01"] > loss_tpr, (rmia["tpr_at_fpr_0.01"], loss_tpr)
    assert lira["auc"] > loss_auc
    used = report["reference_models"]
    assert used["count"] == 2 and used["rmia"]["a_tuned"] and used["rmia"]["gamma"] == 1.0
    assert used["models"] == [str(p) for p in paths]
    # Cached: asking again (for fewer) reuses the finished runs; nothing is retrained.
    before = _mtimes(run)
    assert train_reference_models(run, 1, audited, device="cpu") == paths[:1]
    assert _mtimes(run) == before


def _audit(run: Path, *extra: str) -> tuple[int, dict, str]:
    result = runner.invoke(app, ["audit", "--model", str(run / CHECKPOINT), "--json",
                                 "--attacks", "loss", "--reference-models", "1", *extra])
    stdout = result.stdout.strip()
    return result.exit_code, json.loads(stdout) if stdout.startswith("{") else {}, \
        result.output


def test_cli_reference_models_with_black_box_canaries(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(TrainConfig(method="fedavg", rounds=2, local_steps=20, width=8, split="iid",
                      clients=2, canaries=60), run)
    code, report, _ = _audit(run)
    assert code == 0
    assert set(report["attacks"]) == {"loss", "rmia", "lira"}
    for name in ("rmia", "lira"):
        metrics = report["attacks"][name]["score"]
        assert 0.0 <= metrics["auc"] <= 1.0 and "tpr_at_fpr_0.01" in metrics
    used = report["reference_models"]
    assert used["count"] == 1 and used["models"] == [str(run / "reference" / "0")]
    assert used["rmia"] == {"a": 0.3, "a_tuned": False, "gamma": 1.0, "tuning": None}
    names = [a["audit"] for a in report["one_run"]["audits"]]
    assert names == ["black-box/loss", "black-box/rmia", "black-box/lira"]
    # Rerun: the reference run is reused, the report is the same.
    before = _mtimes(run)
    code, again, _ = _audit(run)
    assert code == 0 and _mtimes(run) == before
    assert again["attacks"]["rmia"] == report["attacks"]["rmia"]
    # Another audit draw would score records the cached reference trained on: refused.
    code, _, output = _audit(run, "--seed", "1")
    assert code == 2 and "records now under audit" in output
    # A reference folder of another configuration: refused, never silently reused.
    manifest_path = run / "reference" / "0" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["config"]["lr_local"] = 0.01
    manifest_path.write_text(json.dumps(manifest))
    code, _, output = _audit(run)
    assert code == 2 and "another configuration (lr_local)" in output


def test_a_reference_model_that_saw_audited_records_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    x = np.zeros((4, 1, 8, 8), dtype=np.float32)
    seen = ReferenceModel(model, np.array([3, 7]), "ref")
    with pytest.raises(ConfigError, match="trained on 1 of the records under audit"):
        ReferenceScorer(model, [seen], x, np.arange(4), audited=np.array([7, 8]))
    with pytest.raises(ConfigError, match="at least one reference model"):
        ReferenceScorer(model, [], x, np.arange(4), audited=np.array([7]))
