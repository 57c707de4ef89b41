"""DP-NormFedAvg (client-level DP) and ALI-DPFL (adaptive local iterations):
docs/algorithms.md#dp-normfedavg, #ali-dpfl."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import tiny
from torch import nn

import fedlap_privacy.fl.methods.fedavg as fedavg_module
from fedlap_privacy.accountant import FedLAPSchedule, composed_epsilon, epsilon, plan_rounds
from fedlap_privacy.data.client_splits import split_clients
from fedlap_privacy.data.datasets import load_dataset
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.simulation import train
from fedlap_privacy.fl.methods.alidpfl import ALIDPFL, ali_tau, ali_tau_value
from fedlap_privacy.fl.methods.fedavg import local_training
from fedlap_privacy.fl.methods.interface import Reply, RoundInfo
from fedlap_privacy.fl.methods.normfedavg import DPNormFedAvg, normalise_update
from fedlap_privacy.fl.run.privacy import build_ledger
from fedlap_privacy.models import ModelConfig, build_model
from fedlap_privacy.state.checkpoint import PRIVATE, PRIVATE_FORMAT, load_checkpoint


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(1, 8, 10, width=16))


def _data(n: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))


def _info(cfg: TrainConfig, lr: float, **extras) -> RoundInfo:
    return RoundInfo(1, cfg.rounds, lr, extras)


# ---------------------------------------------------------------- DP-NormFedAvg


@pytest.mark.parametrize("lr", [1e-4, 0.05, 3.0])
def test_normfedavg_upload_is_the_update_scaled_to_norm_c(lr):
    """Whatever the raw update's size, the upload is (w_k - w_g) * C / ||w_k - w_g||."""
    cfg = tiny(method="dp-normfedavg", clip=0.7, sigma=1.0)
    model, (x, y) = _model(), _data()
    reply = DPNormFedAvg(cfg, torch.device("cpu")).client(
        model, x, y, {}, _info(cfg, lr), torch.Generator().manual_seed(3)
    )
    assert reply.accesses == 1 and reply.num_examples == len(y)
    assert _norm(reply.payload) == pytest.approx(0.7, abs=1e-5)
    trained, _ = local_training(model, x, y, steps=3, lr=lr, batch_size=32,
                                generator=torch.Generator().manual_seed(3))
    start = dict(model.named_parameters())
    raw = {k: (p - start[k]).detach() for k, p in trained.named_parameters()}
    raw_norm = _norm(raw)
    assert raw_norm > 0 and abs(raw_norm - 0.7) > 1e-3  # the scaling did something
    for k, t in raw.items():
        torch.testing.assert_close(reply.payload[k], t * (0.7 / raw_norm), rtol=1e-5, atol=1e-8)


def test_normalise_keeps_a_zero_update_zero():
    out = normalise_update({"a": torch.zeros(3), "b": torch.zeros(2, 2)}, 1.0)
    assert _norm(out) == 0.0
    big = normalise_update({"a": torch.full((3,), 1e6), "b": torch.full((2, 2), -1e6)}, 2.5)
    assert _norm(big) == pytest.approx(2.5, rel=1e-6)


def _payload(model: nn.Module, seed: int, clip: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = {k: torch.randn(p.shape, generator=g) for k, p in model.named_parameters()}
    return normalise_update(raw, clip)


def test_normfedavg_server_divides_the_sum_by_the_expected_count():
    """sigma = 0: w_g moves by server_lr * sum_k Delta_k / (q K), not by the realised mean."""
    cfg = tiny(method="dp-normfedavg", clients=4, client_fraction=0.5, sigma=0.0, clip=1.3,
               server_lr=0.3)
    model = nn.Linear(6, 4)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    replies = [Reply(_payload(model, s, 1.3), 1, 10 * (s + 1)) for s in range(3)]
    DPNormFedAvg(cfg, torch.device("cpu")).aggregate(
        model, replies, {}, _info(cfg, 0.1), torch.Generator().manual_seed(0)
    )
    for k, p in model.named_parameters():
        total = sum(r.payload[k] for r in replies)
        # uniform weights, q K = 2 although 3 clients replied
        torch.testing.assert_close(p.detach() - before[k], 0.3 * total / 2.0)


def test_normfedavg_noise_std_is_sigma_c_over_expected_clients():
    sigma, clip, server_lr = 2.0, 0.5, 1.5
    cfg = tiny(method="dp-normfedavg", clients=10, client_fraction=0.3, sigma=sigma, clip=clip,
               server_lr=server_lr)
    method = DPNormFedAvg(cfg, torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    moves = []
    for _ in range(200):
        model = nn.Linear(20, 10)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        zero = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
        method.aggregate(model, [Reply(zero, 1, 5)], {}, _info(cfg, 0.1), gen)
        moves.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    draws = torch.stack(moves).double()  # 200 x 210 independent noise coordinates
    expected = server_lr * sigma * clip / (0.3 * 10)  # = 0.5
    assert float(draws.std()) == pytest.approx(expected, rel=0.03)
    assert abs(float(draws.mean())) < 0.02
    # reproducible from the generator, and an independent draw each round
    again = nn.Linear(20, 10)
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    zero = {k: torch.zeros_like(p) for k, p in again.named_parameters()}
    method.aggregate(again, [Reply(zero, 1, 5)], {}, _info(cfg, 0.1),
                     torch.Generator().manual_seed(7))
    first = torch.cat([p.detach().flatten() for p in again.parameters()]).double()
    torch.testing.assert_close(first, draws[0])
    assert not torch.equal(draws[0], draws[1])


def test_normfedavg_run_is_accounted_at_client_level():
    cfg = tiny(method="dp-normfedavg", clients=5, client_fraction=0.6, sigma=1.5, rounds=3,
               local_steps=2)
    result = train(cfg, None, device="cpu")
    schedule = FedLAPSchedule.client_level(5, 0.6)
    assert result.ledger.notion == "client-level"
    assert result.summary.privacy.notion == "client-level"
    assert len(result.ledger.entries) == 3
    for m, entry in enumerate(result.ledger.entries, start=1):
        assert entry.q1 == pytest.approx(0.6) and entry.local_steps == 1
        assert entry.accesses <= 1
        assert entry.epsilon == pytest.approx(epsilon(schedule, 1.5, m, cfg.delta, cfg.accountant),
                                              rel=1e-12)
    assert result.summary.privacy.epsilon == pytest.approx(epsilon(schedule, 1.5, 3, cfg.delta,
                                                              cfg.accountant))


# ---------------------------------------------------------------- ALI-DPFL: the tau rule


def test_ali_tau_worked_example():
    # mu = 0.5, Gamma = 2, T = 50, C = 1, sigma = 1.2, d = 1000, Bhat = 64, written out:
    # noise term = 1.2^2 * 1^2 * 1000 / 64^2 = 0.3515625
    # numerator = 4/0.25 + 3 + 2*2*50*0.5 + 0.3515625 = 119.3515625
    # denominator = (2 + 2/50) * (1 + 0.3515625) = 2.7571875
    expected = math.sqrt(1 + 119.3515625 / 2.7571875)
    assert expected == pytest.approx(6.6549, abs=1e-4)
    assert ali_tau_value(0.5, 2.0, 50, 1.0, 1.2, 1000, 64) == pytest.approx(expected, rel=1e-12)
    assert ali_tau(0.5, 2.0, 50, 1.0, 1.2, 1000, 64) == 7
    # a second point, from the formula on literals
    value = math.sqrt(1 + (4 / 0.1**2 + 3 * 2.0**2 + 2 * 0.3 * 10 * 0.1
                           + 0.8**2 * 2.0**2 * 5000 / 32**2)
                      / ((2 + 2 / 10) * (2.0**2 + 0.8**2 * 2.0**2 * 5000 / 32**2)))
    assert ali_tau_value(0.1, 0.3, 10, 2.0, 0.8, 5000, 32) == pytest.approx(value, rel=1e-12)
    assert ali_tau(0.1, 0.3, 10, 2.0, 0.8, 5000, 32) == math.floor(value + 0.5) == 4


def test_ali_tau_clamps():
    assert ali_tau(1e-4, 0.0, 10, 1.0, 1.0, 100, 64) == 100  # 4/mu^2 huge
    assert ali_tau(1e-4, 0.0, 10, 1.0, 1.0, 100, 64, tau_max=17) == 17
    assert ali_tau(0.0, 0.0, 10, 1.0, 1.0, 100, 64) == 100  # the limit mu -> 0
    assert ali_tau(math.inf, 1.0, 10, 1.0, 1.0, 100, 64, tau_max=30) == 30
    # mu = inf, Gamma = 0: only 3 C^2 + noise left -> sqrt(1 + (3 + n) / (2.2 (1 + n))) < 2
    n = 1.0**2 * 1.0**2 * 100 / 64**2
    assert ali_tau_value(math.inf, 0.0, 10, 1.0, 1.0, 100, 64) == pytest.approx(
        math.sqrt(1 + (3 + n) / ((2 + 2 / 10) * (1 + n))))
    assert ali_tau(math.inf, 0.0, 10, 1.0, 1.0, 100, 64) == 2
    assert ali_tau(5.0, 0.0, 1, 1.0, 1e4, 10**5, 8) == 1  # noise dominates: sqrt(1.25) -> 1
    with pytest.raises(ConfigError):
        ali_tau(math.nan, 1.0, 10, 1.0, 1.0, 100, 64)
    with pytest.raises(ConfigError):
        ali_tau(1.0, 1.0, 0, 1.0, 1.0, 100, 64)


def test_ali_tau_falls_as_noise_grows():
    """More noise grows numerator and denominator; with these numbers tau* falls toward
    sqrt(1 + 1/(2 + 2/T)) (checked on the computed values)."""
    mu, gamma, T, C, d, B = 0.5, 2.0, 50, 1.0, 1000, 64
    values, nums, dens = [], [], []
    for sigma in [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 1e3]:
        noise = sigma**2 * C**2 * d / B**2
        nums.append(4 / mu**2 + 3 * C**2 + 2 * gamma * T * mu + noise)
        dens.append((2 + 2 / T) * (C**2 + noise))
        values.append(ali_tau_value(mu, gamma, T, C, sigma, d, B))
        assert values[-1] == pytest.approx(math.sqrt(1 + nums[-1] / dens[-1]), rel=1e-12)
    assert all(b > a for a, b in itertools.pairwise(nums))
    assert all(b > a for a, b in itertools.pairwise(dens))
    assert all(b < a for a, b in itertools.pairwise(values))
    assert values[0] == pytest.approx(math.sqrt(1 + 119 / 2.04))
    assert values[-1] == pytest.approx(math.sqrt(1 + 1 / 2.04), rel=1e-3)
    taus = [ali_tau(mu, gamma, T, C, s, d, B) for s in [0.0, 1.0, 4.0, 1e3]]
    assert taus == [8, 7, 4, 1]


# ---------------------------------------------------------------- ALI-DPFL: client estimates


def test_ali_client_estimates_are_post_processing_of_released_gradients(monkeypatch):
    """mu_i, Gamma_i come from the tau DP gradients the client released, nothing else."""
    cfg = tiny(method="ali-dpfl", sigma=0.05, clip=1.0, target_eps=5.0, batch_size=16)
    model, (x, y) = _model(), _data()
    calls = []
    real = fedavg_module.dp_gradient

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fedavg_module, "dp_gradient", counting)
    tau, lr = 4, 0.2
    reply = ALIDPFL(cfg, torch.device("cpu")).client(
        model, x, y, {}, _info(cfg, lr, tau=tau), torch.Generator().manual_seed(5)
    )
    assert len(calls) == tau == reply.accesses  # no extra read of private data
    # recompute the estimates by hand from the same (seeded) release
    grads, weights = [], []

    def spy(step, g, params):
        grads.append(torch.cat([t.flatten().double() for t in g]))
        weights.append(torch.cat([p.detach().flatten().double() for p in params]))

    local_training(model, x, y, steps=tau, lr=lr, batch_size=16,
                   generator=torch.Generator().manual_seed(5), dp=(1.0, 0.05), on_step=spy)
    d = sum(p.numel() for p in model.parameters())
    noise_sq = d * (0.05 * 1.0 / 16) ** 2
    w_g = torch.cat([p.detach().flatten().double() for p in model.parameters()])
    mu = math.sqrt(max(float((grads[-1] - grads[0]).square().sum()) - 2 * noise_sq, 0.0)) / float(
        (weights[-1] - w_g).norm())
    gamma = lr * sum(max(float(g.square().sum()) - noise_sq, 0.0) for g in grads)
    assert reply.stats["mu"] == pytest.approx(mu, rel=1e-9)
    assert reply.stats["gamma"] == pytest.approx(gamma, rel=1e-9)
    assert reply.stats["mu"] > 0 and reply.stats["gamma"] > 0


def test_ali_estimates_stay_finite_under_huge_noise():
    cfg = tiny(method="ali-dpfl", sigma=1e4, clip=1.0, target_eps=5.0, batch_size=16)
    model, (x, y) = _model(), _data()
    method = ALIDPFL(cfg, torch.device("cpu"))
    reply = method.client(model, x, y, {}, _info(cfg, 1e-3, tau=3),
                          torch.Generator().manual_seed(1))
    for key in ("mu", "gamma"):
        assert math.isfinite(reply.stats[key]) and reply.stats[key] >= 0
    one = method.client(model, x, y, {}, _info(cfg, 1e-3, tau=1), torch.Generator().manual_seed(1))
    assert "mu" not in one.stats and math.isfinite(one.stats["gamma"])  # tau = 1: no mu


# ---------------------------------------------------------------- ALI-DPFL: end to end


def _min_client(cfg: TrainConfig) -> int:
    data = load_dataset(cfg.dataset)
    parts = split_clients(data.y_train, cfg.clients, cfg.split, cfg.dirichlet_alpha, cfg.seed,
                          data.num_classes)
    return min(len(p) for p in parts)


def test_ali_dpfl_run_accounts_each_rounds_tau(tmp_path):
    cfg = tiny(method="ali-dpfl", sigma=1.0, target_eps=8.0, rounds=3, local_steps=3, tau_max=6)
    result = train(cfg, tmp_path, device="cpu")
    state = load_checkpoint(tmp_path / PRIVATE, PRIVATE_FORMAT)["server_state"]
    n_min = _min_client(cfg)
    step = FedLAPSchedule(batch_size=32, client_size=n_min, local_steps=1)
    assert state["rc"] == plan_rounds(step, 1.0, 8.0, cfg.delta, cfg.accountant) > 0
    assert state["rc"] > plan_rounds(step, 1.0, 8.0, cfg.delta, "rdp")  # PLD: more iterations
    taus = [h.extras["tau"] for h in result.history]
    assert len(result.ledger.entries) == len(taus) == 3 and taus[0] == 3
    assert state["taus"] == taus and state["total"] == sum(taus)
    assert all(1 <= t <= 6 for t in taus)
    for m, (entry, h) in enumerate(zip(result.ledger.entries, result.history, strict=True)):
        assert entry.local_steps == h.extras["tau"] == entry.accesses == h.local_steps
        rounds = [FedLAPSchedule(batch_size=32, client_size=n_min, local_steps=t)
                  for t in taus[: m + 1]]
        assert entry.epsilon == pytest.approx(
            composed_epsilon(rounds, 1.0, cfg.delta, cfg.accountant), rel=1e-12)
        assert entry.epsilon <= 8.0
        # the server's rule, from the public values it reported
        T = min(cfg.rounds * h.extras["tau"], state["rc"])
        assert h.extras["next_tau"] == ali_tau(h.extras["mu"], h.extras["gamma"], T, 1.0, 1.0,
                                             state["d"], 32, 6)
        if m + 1 < len(taus):
            assert taus[m + 1] == h.extras["next_tau"]


def test_ali_dpfl_stops_at_its_iteration_budget():
    cfg = tiny(method="ali-dpfl", sigma=1.0, rounds=10, local_steps=3, tau_max=6)
    step = FedLAPSchedule(batch_size=32, client_size=_min_client(cfg), local_steps=1)
    cfg.target_eps = epsilon(step, 1.0, 4, cfg.delta, cfg.accountant) * (1 + 1e-9)  # Rc = 4
    assert plan_rounds(step, 1.0, cfg.target_eps, cfg.delta, cfg.accountant) == 4
    result = train(cfg, None, device="cpu")
    taus = [h.extras["tau"] for h in result.history]
    assert 1 <= result.summary.rounds_run < 10 and sum(taus) <= 4
    assert "Rc = 4" in result.summary.stopped
    assert result.ledger.epsilon <= cfg.target_eps
    # stopped because tau would not fit
    assert sum(taus) + result.history[-1].extras["next_tau"] > 4


def test_ali_stop_rule_counts_every_accounted_round():
    """Interrupted rounds (and rounds with no client) are in the ledger, not in the aggregated
    total: the iteration budget Rc counts what the ledger accounted."""
    cfg = tiny(method="ali-dpfl", sigma=1.0, local_steps=3, tau_max=6)
    sizes = [_min_client(cfg)] * cfg.clients
    step = FedLAPSchedule(batch_size=32, client_size=sizes[0], local_steps=1)
    cfg.target_eps = epsilon(step, 1.0, 4, cfg.delta, cfg.accountant) * (1 + 1e-9)  # Rc = 4
    ledger = build_ledger(cfg, sizes)
    method = ALIDPFL(cfg, torch.device("cpu"))
    state = method.init_server_state(_model(), ledger)
    assert state["rc"] == 4 and state["tau"] == 3 and method.accounted_steps(state) == 3
    assert method.extras(state) == {"tau": 3}
    assert method.stop_reason(state) is None  # 0 + 3 <= 4
    ledger.record(1, 3, range(cfg.clients), "interrupted", local_steps=3)
    assert state["total"] == 0 and "Rc = 4" in (method.stop_reason(state) or "")
