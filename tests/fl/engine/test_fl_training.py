"""FedLAP / FedLAP-DP / baselines: the rules of docs/algorithms.md on tiny configurations."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import tiny
from torch import Tensor

from fedlap_privacy.accountant import FedLAPSchedule, epsilon
from fedlap_privacy.errors import CheckpointError, ConfigError
from fedlap_privacy.fl.config import PRESETS, TrainConfig
from fedlap_privacy.fl.engine.events import ClientDone, RoundEnded
from fedlap_privacy.fl.engine.simulation import (
    CHECKPOINT,
    METRICS,
    PENDING,
    resume,
    train,
)
from fedlap_privacy.fl.methods.fedavg import average_weights
from fedlap_privacy.fl.methods.fedlap import (
    FedLAP,
    SyntheticSet,
    client_approximation,
    cosine_lr,
    init_synthetic,
    server_optimisation,
)
from fedlap_privacy.fl.methods.interface import Reply, RoundInfo
from fedlap_privacy.fl.methods.trust_region import clone_params, distance
from fedlap_privacy.models import ModelConfig, build_model
from fedlap_privacy.state.checkpoint import (
    PRIVATE,
    PRIVATE_FORMAT,
    load_checkpoint,
    save_checkpoint,
)


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(1, 8, 10, width=16))


def _data(n: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 2, (n,), generator=g)


def test_client_stays_in_trust_region_and_keeps_labels(monkeypatch: pytest.MonkeyPatch):
    import fedlap_privacy.fl.methods.fedlap as fedlap

    model = _model()
    x, y = _data()
    g = torch.Generator().manual_seed(1)
    syn = init_synthetic(x, y, 3, "noise", g)
    labels = syn.labels.clone()
    radius = 0.05  # tiny, so the local steps hit it
    cfg = tiny(method="fedlap-dp", radius=radius, lr_net=5.0, max_loops=4, local_model_steps=3)
    seen: dict[str, list[float]] = {}
    anchor = clone_params(model)

    def spy(name, fn):  # record the distance of every weight a gradient is taken at
        def wrapper(client_model, *args, **kwargs):
            seen.setdefault(name, []).append(distance(client_model, anchor))
            return fn(client_model, *args, **kwargs)
        return wrapper

    # every use of the weights: the DP gradient, the matching steps, the local steps
    for name in ("_real_gradient", "_matching_gradient", "_loss_grad"):
        monkeypatch.setattr(fedlap, name, spy(name, getattr(fedlap, name)))
    update = client_approximation(model, x, y, syn, cfg, 5.0, g, None)
    assert set(seen) == {"_real_gradient", "_matching_gradient", "_loss_grad"}
    assert max(max(d) for d in seen.values()) <= radius * (1 + 1e-5)
    assert torch.equal(update.synthetic.labels, labels)
    assert not torch.equal(update.synthetic.images, syn.images)  # the images did learn
    # the trust region stopped the trajectory early: fewer accesses than the worst case
    assert 1 <= update.accesses < cfg.accesses_per_round


def test_server_never_steps_past_radius_and_counts_steps():
    model = _model()
    anchor = clone_params(model)
    x, y = _data(20)
    sets = [SyntheticSet(x[:10], y[:10]), SyntheticSet(x[10:], y[10:])]
    steps = server_optimisation(model, sets, [0.5, 0.5], 0.1, 10.0, 50, 512,
                                torch.Generator().manual_seed(0))
    assert steps < 50  # stopped by the radius, not the cap
    assert distance(model, anchor) == pytest.approx(0.1, rel=1e-4)


def test_server_weights_clients_by_size():
    """The server's first gradient equals sum_k (N_k/N) grad loss(w, S_k)."""
    x, y = _data(12)
    x = x.double()
    sets = [SyntheticSet(x[:4], y[:4]), SyntheticSet(x[4:], y[4:])]
    weights = [0.8, 0.2]
    model = _model().double()
    params = list(model.parameters())
    expected = [torch.zeros_like(p) for p in params]
    for s, w in zip(sets, weights, strict=True):
        grads = torch.autograd.grad(F.cross_entropy(model(s.images), s.labels), params)
        for e, g in zip(expected, grads, strict=True):
            e += w * g
    before = clone_params(model)
    lr = 1e-3
    server_optimisation(model, sets, weights, None, lr, 1, 512, torch.Generator())
    for p, b, e in zip(model.parameters(), before, expected, strict=True):
        torch.testing.assert_close((b - p.detach()) / lr, e, rtol=1e-6, atol=1e-9)


def test_fedavg_average_is_size_weighted():
    a = {"w": torch.tensor([0.0, 2.0])}
    b = {"w": torch.tensor([4.0, 6.0])}
    out = average_weights([a, b], [300, 100])
    torch.testing.assert_close(out["w"], torch.tensor([1.0, 3.0]))


def test_synthetic_init_is_balanced_over_client_classes():
    x, y = _data()
    syn = init_synthetic(x, y, 5, "noise", torch.Generator().manual_seed(0))
    assert syn.labels.tolist() == [0] * 5 + [1] * 5
    real = init_synthetic(x, y, 5, "real", torch.Generator().manual_seed(0))
    for img, lab in zip(real.images, real.labels, strict=True):  # real init: images of its class
        match = (x == img).flatten(1).all(1)
        assert match.any() and bool((y[match] == lab).all())


def test_cosine_learning_rate():
    assert cosine_lr(0.1, 1, 10) == pytest.approx(0.1)
    assert cosine_lr(0.1, 10, 10) == pytest.approx(1e-6)
    assert cosine_lr(0.1, 1, 1) == 0.1


def test_open_cosine_keeps_a_rate_in_the_last_round():
    """lr0 (1 + cos(pi (m-1)/M))/2: 1, 3/4, 1/4 of lr0 at M = 3, where the authors' cosine
    gives 1, 1/2 and the floor; torch's CosineAnnealingLR(T_max=M) is the oracle."""
    assert [cosine_lr(0.1, m, 3, "cosine-open") for m in (1, 2, 3)] == pytest.approx(
        [0.1, 0.075, 0.025])
    assert [cosine_lr(0.1, m, 3) for m in (1, 2, 3)] == pytest.approx([0.1, 0.05, 1e-6])
    assert cosine_lr(0.1, 1, 1, "cosine-open") == pytest.approx(0.1)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for m in range(1, 11):
        assert cosine_lr(0.1, m, 10, "cosine-open") == pytest.approx(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    with pytest.raises(ValueError, match="lr_schedule 'linear'"):
        tiny(lr_schedule="linear").validate()


def test_fedlap_server_optimises_at_server_lr_times_the_round_rate():
    """server_lr scales only the server's optimisation: factor 2 at rate 0.01 moves the
    global model exactly as factor 1 at rate 0.02, and differently from factor 1 at 0.01."""
    x, y = _data(40)
    g = torch.Generator().manual_seed(3)
    syn = init_synthetic(x, y, 3, "noise", g)
    replies = [Reply({"images": syn.images, "labels": syn.labels}, 1, 40)]

    def aggregated(server_lr: float, lr: float) -> Tensor:
        cfg = tiny(method="fedlap-dp", server_lr=server_lr, dsa=False, radius=100.0)
        model = _model()
        FedLAP(cfg, torch.device("cpu")).aggregate(
            model, replies, {}, RoundInfo(1, 2, lr), torch.Generator().manual_seed(0))
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    scaled = aggregated(2.0, 0.01)
    assert torch.allclose(scaled, aggregated(1.0, 0.02), atol=1e-6)
    assert not torch.allclose(scaled, aggregated(1.0, 0.01), atol=1e-4)


def test_presets_carry_the_authors_values():
    dp = TrainConfig.from_dict(PRESETS["paper-dp"]).validate()
    assert dp.accesses_per_round == 200 and dp.sigma == 1.0 and dp.lr_net == 0.002
    plain = TrainConfig.from_dict(PRESETS["paper"]).validate()
    assert plain.radius_rule == "min" and plain.mse_weight == 0.1 and plain.ipc == 50


def test_dp_config_rejects_private_data_leaks():
    with pytest.raises(ValueError, match="init 'real'"):
        tiny(method="fedlap-dp", init="real").validate()
    with pytest.raises(ValueError, match="radius rule"):
        tiny(method="fedlap-dp", radius_rule="min").validate()


@pytest.mark.parametrize("method", ["fedlap-dp", "dp-fedavg", "dp-fedprox"])
def test_ledger_epsilon_equals_the_accountant(tmp_path, method):
    cfg = tiny(method=method, sigma=2.0)
    result = train(cfg, tmp_path, device="cpu")
    private = load_checkpoint(tmp_path / PRIVATE, PRIVATE_FORMAT)
    sizes = [len(p) for p in private["client_indices"]]
    schedule = FedLAPSchedule(batch_size=cfg.batch_size, client_size=min(sizes),
                              local_steps=cfg.accesses_per_round)
    for m, entry in enumerate(result.ledger.entries, start=1):
        assert entry.epsilon == pytest.approx(
            epsilon(schedule, 2.0, m, cfg.delta, accountant=cfg.accountant), rel=1e-12)
        assert entry.accesses <= entry.local_steps == cfg.accesses_per_round
        assert entry.accountant == cfg.accountant == "pld"  # the default
    ckpt = load_checkpoint(tmp_path / CHECKPOINT)
    assert ckpt["privacy"]["epsilon"] == pytest.approx(result.ledger.entries[-1].epsilon)
    assert ckpt["privacy"]["notion"] == "record-level"
    lines = (tmp_path / METRICS).read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2]
    assert (tmp_path / "accuracy.png").exists() and (tmp_path / "epsilon.png").exists()


def test_target_epsilon_stops_before_exceeding(tmp_path):
    cfg = tiny(method="dp-fedavg", sigma=1.0, rounds=50)
    sizes_eps = train(tiny(method="dp-fedavg", sigma=1.0, rounds=1), None, device="cpu")
    first = sizes_eps.ledger.entries[0].epsilon
    cfg.target_eps = first * 1.5  # one round fits, two may not
    result = train(cfg, tmp_path, device="cpu")
    assert result.ledger.epsilon <= cfg.target_eps
    assert result.summary.rounds_run < 50 and "would be exceeded" in result.summary.stopped


def test_sigma_is_planned_for_target_and_rounds():
    cfg = tiny(method="dp-fedavg", sigma=None, target_eps=5.0, rounds=2)
    result = train(cfg, None, device="cpu")
    assert result.summary.rounds_run == 2
    assert result.ledger.epsilon <= 5.0
    assert result.ledger.epsilon == pytest.approx(5.0, rel=2e-3)  # the smallest such sigma


class _Stop(Exception):
    pass


def _stop_at(kind: type, round_: int):
    def callback(event):
        if isinstance(event, kind) and event.round == round_:
            raise _Stop

    return callback


@pytest.mark.parametrize("method", ["fedlap-dp", "dp-fedavg"])
def test_resume_equals_uninterrupted_run(tmp_path, method):
    cfg = tiny(method=method, rounds=3, reproducible_noise=True)
    full = train(dataclasses.replace(cfg), tmp_path / "full", device="cpu")
    with pytest.raises(_Stop):
        train(cfg, tmp_path / "cut", device="cpu", callback=_stop_at(RoundEnded, 2))
    assert not (tmp_path / "cut" / PENDING).exists()
    resumed = resume(tmp_path / "cut", device="cpu")
    assert resumed.ledger.to_list() == full.ledger.to_list()
    for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values(),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert resumed.history[-1].test_accuracy == full.history[-1].test_accuracy


def test_crash_mid_round_is_counted_not_lost(tmp_path):
    cfg = tiny(method="dp-fedavg", rounds=2)
    with pytest.raises(_Stop):
        train(cfg, tmp_path, device="cpu", callback=_stop_at(ClientDone, 2))
    assert (tmp_path / PENDING).exists()
    resumed = resume(tmp_path, device="cpu")
    statuses = [e.status for e in resumed.ledger.entries]
    assert statuses == ["completed", "interrupted", "completed"]
    full = train(tiny(method="dp-fedavg", rounds=2), None, device="cpu")
    assert resumed.ledger.epsilon > full.ledger.epsilon  # the interrupted round is paid for
    assert resumed.ledger.rounds_spent == 3


def test_a_finished_run_is_not_overwritten(tmp_path):
    train(tiny(method="dp-fedavg", rounds=1), tmp_path, device="cpu")
    with pytest.raises(ValueError, match="already holds a run"):
        train(tiny(method="dp-fedavg", rounds=1), tmp_path, device="cpu")
    more = resume(tmp_path, rounds=2, device="cpu")  # raising the total continues the ledger
    assert [e.round for e in more.ledger.entries] == [1, 2]


def test_non_private_fedlap_suggests_radii(tmp_path):
    cfg = tiny(method="fedlap", init="real", radius_rule="min", radius=10.0, mse_weight=0.1,
               sigma=None, lr_net=0.1, rounds=1)
    result = train(cfg, tmp_path, device="cpu")
    h = result.history[0]
    assert h.epsilon is None and result.ledger.notion == "none"
    assert 0 < h.extras["radius"] <= 10.0


def test_client_records_caps_clients_and_sets_the_rate():
    full = train(tiny(method="dp-fedavg", rounds=1), None, device="cpu")
    cut = train(tiny(method="dp-fedavg", rounds=1, client_records=100), None, device="cpu")
    # the sampling rate is B over the smallest client: 32/100 once every client holds 100
    assert cut.ledger.entries[0].q2 == pytest.approx(32 / 100)
    assert full.ledger.entries[0].q2 < 32 / 100
    assert cut.ledger.epsilon > full.ledger.epsilon  # same sigma and T, higher rate
    with pytest.raises(ConfigError, match="client_records 0 must be an integer >= 1"):
        tiny(client_records=0).validate()


def test_validation_split_is_held_out_of_every_client():
    from fedlap_privacy.data.datasets import load_dataset
    from fedlap_privacy.fl.engine.simulation import client_parts, evaluate, validation_indices

    data = load_dataset("digits")
    plain = tiny(method="fedavg", rounds=2)
    cfg = tiny(method="fedavg", rounds=2, validation_records=300, local_steps=10, split_seed=7)
    held = validation_indices(cfg, data)
    parts = client_parts(cfg, data)
    assert len(held) == 300 and not np.isin(held, np.concatenate(parts)).any()
    # every other training record is still some client's
    assert len(np.concatenate(parts)) + len(held) == len(data.y_train)
    assert len(validation_indices(plain, data)) == 0  # nothing held out by default
    result = train(cfg, None, device="cpu")
    val = result.summary.validation_accuracy
    # released: public only
    assert not any("validation_accuracy" in h.to_json() for h in result.history)
    x, y = torch.from_numpy(data.x_train[held]), torch.from_numpy(data.y_train[held])
    assert evaluate(result.model, x, y)[0] == pytest.approx(val)
    assert val > 0.4  # FedAvg learns: well above chance (0.1) on records it never saw
    # held-out training records measure what the test set measures (300 records: sd ~0.03)
    assert val == pytest.approx(result.summary.test_accuracy, abs=0.12)
    assert "validation_accuracy" not in train(plain, None, device="cpu").summary.to_json()


def test_resume_restores_the_secret_split_and_refuses_another(tmp_path):
    """The secret split seed lives in private.pt only: --resume restores exactly the same
    split (the fingerprint check passes), and a private.pt whose split seed was changed is
    refused (the fingerprints no longer match)."""
    cfg = tiny(method="fedavg", rounds=1, local_steps=1, width=8, split="iid",
               validation_records=50)
    train(cfg, tmp_path / "run", device="cpu")
    path = tmp_path / "run" / PRIVATE
    before = load_checkpoint(path, PRIVATE_FORMAT)
    assert before["config"]["split_seed"] is None and isinstance(before["split_seed"], int)
    resumed = resume(tmp_path / "run", rounds=2, device="cpu")
    after = load_checkpoint(path, PRIVATE_FORMAT)
    assert after["split_seed"] == before["split_seed"] and resumed.ledger.rounds_spent == 2
    for a, b in zip(before["client_indices"], after["client_indices"], strict=True):
        assert torch.equal(a, b)
    assert [v["round"] for v in after["validation"]] == [1, 2]
    save_checkpoint(path, {**after, "split_seed": after["split_seed"] + 1}, PRIVATE_FORMAT)
    with pytest.raises(CheckpointError, match="split of the records"):
        resume(tmp_path / "run", rounds=3, device="cpu")


def test_a_run_saved_before_split_seeds_resumes_with_its_split_declared_public(tmp_path):
    """A private.pt without a split seed (an earlier version) drew its split from ``seed``,
    which the released weights reveal: it resumes on that split, now declared public."""
    cfg = tiny(method="dp-fedavg", rounds=1, local_steps=1, width=8, split="iid", seed=3)
    train(dataclasses.replace(cfg, split_seed=3), tmp_path / "run", device="cpu")
    path = tmp_path / "run" / PRIVATE
    old = load_checkpoint(path, PRIVATE_FORMAT)
    del old["split_seed"], old["validation"]
    save_checkpoint(path, {**old, "config": {k: v for k, v in old["config"].items()
                                             if k != "split_seed"}}, PRIVATE_FORMAT)
    result = resume(tmp_path / "run", rounds=2, device="cpu")
    assert any("split_seed 3" in item for item in result.summary.privacy.public)
