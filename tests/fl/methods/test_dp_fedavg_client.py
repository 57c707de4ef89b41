"""Client-level DP-FedAvg (fl/methods/dp_fedavg_client.py): clipping, the server noise it is
accounted for, adaptive clipping, the sampling of cohorts and its accounting, learning."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from helpers import tiny
from torch import nn

from fedlap_privacy.accountant import DEFAULT_ORDERS
from fedlap_privacy.accountant.client_level import ClientSampling, effective_sigma, update_sigma
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.client_sampling import select_clients
from fedlap_privacy.fl.engine.simulation import train
from fedlap_privacy.fl.methods.dp_fedavg_client import BELOW_CLIP, DPFedAvgClient, clip_update
from fedlap_privacy.fl.methods.interface import Reply, RoundInfo

logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's convergence warnings

METHOD = "dp-fedavg-client"


def _info(cfg: TrainConfig, clip: float) -> RoundInfo:
    return RoundInfo(1, cfg.rounds, cfg.lr_local, {"clip": clip})


def _zeroed(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))


# ---------------------------------------------------------------- the client's clipped update
def test_client_uploads_its_update_clipped_to_the_round_clip():
    cfg = tiny(method=METHOD, clip=0.05, sigma=1.0, local_steps=3, lr_local=0.5)
    method = DPFedAvgClient(cfg, torch.device("cpu"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(80, 1, 8, 8, generator=g), torch.randint(0, 10, (80,), generator=g)
    small = method.client(model, x, y, {}, _info(cfg, 0.05), torch.Generator().manual_seed(2))
    assert _norm(small.payload) == pytest.approx(0.05, rel=1e-5)  # clipped to C_t
    assert small.accesses == 1 and small.num_examples == 80
    large = method.client(model, x, y, {}, _info(cfg, 1e3), torch.Generator().manual_seed(2))
    assert _norm(large.payload) < 1e3  # not clipped: the update itself
    scale = 0.05 / _norm(large.payload)
    for k, t in large.payload.items():
        torch.testing.assert_close(small.payload[k], t * scale, rtol=1e-5, atol=1e-7)
    clipped, norm = clip_update({"a": torch.tensor([3.0, 4.0])}, 1.0)
    assert norm == 5.0 and torch.allclose(clipped["a"], torch.tensor([0.6, 0.8]))
    with pytest.raises(ConfigError, match="clip norm"):
        method.client(model, x, y, {}, _info(cfg, float("nan")), torch.Generator())


# ---------------------------------------------------------------- the server's noise
def _noise_std(method: DPFedAvgClient, clip: float, rounds: int = 100) -> float:
    """The std of the server's noise per coordinate, in units of C / m, measured on what the
    server releases when every client uploads zeros (the model moves by the noise only)."""
    cfg = method.cfg
    gen = torch.Generator().manual_seed(7)
    moves = []
    for _ in range(rounds):
        model = _zeroed(nn.Linear(30, 10))
        zero = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
        replies = [Reply(dict(zero), 1, 5) for _ in range(3)]
        method.aggregate(model, replies, {"clip": clip}, _info(cfg, clip), gen)
        moves.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    draws = torch.stack(moves).double()  # rounds x 310 independent coordinates
    assert abs(float(draws.mean())) < 0.05 * float(draws.std()) + 1e-12
    return float(draws.std()) * cfg.sampling.expected_cohort / (cfg.server_lr * clip)


@pytest.mark.parametrize("sampling", [dict(client_fraction=0.3), dict(clients_per_round=4)])
def test_released_noise_has_the_accounted_std_and_removing_it_is_caught(sampling):
    """Fault injection: the measurement that passes the mechanism flags one whose noise was
    removed (the same method with its noise multiplier forced to 0)."""
    cfg = tiny(method=METHOD, clients=10, sigma=2.0, clip=0.5, server_lr=1.5, **sampling)
    method = DPFedAvgClient(cfg, torch.device("cpu"))
    assert _noise_std(method, 0.5) == pytest.approx(2.0, rel=0.03)

    class NoiseRemoved(DPFedAvgClient):
        def noise_multiplier(self) -> float:
            return 0.0

    assert _noise_std(NoiseRemoved(cfg, torch.device("cpu")), 0.5) < 0.1  # flagged


def test_adaptive_clipping_noise_is_the_update_share_of_the_accounted_sigma():
    cfg = tiny(method=METHOD, clients=40, client_fraction=0.5, sigma=1.0, clip=0.3,
               clip_quantile=0.5, clip_count_sigma=1.0)
    method = DPFedAvgClient(cfg, torch.device("cpu"))
    sigma_u = update_sigma(1.0, 1.0)  # (1 - 1/4)^-1/2
    assert sigma_u == pytest.approx(1 / math.sqrt(0.75))
    assert effective_sigma(sigma_u, 1.0) == pytest.approx(1.0)
    assert _noise_std(method, 0.3) == pytest.approx(sigma_u, rel=0.03)
    with pytest.raises(ConfigError, match="must exceed sigma/2"):
        tiny(method=METHOD, clients=40, sigma=3.0, clip_quantile=0.5,
             clip_count_sigma=1.0).validate()


def test_server_divides_the_clipped_sum_by_the_cohort_size():
    cfg = tiny(method=METHOD, clients=6, clients_per_round=3, sigma=0.0, clip=1.0,
               server_lr=0.5)
    method = DPFedAvgClient(cfg, torch.device("cpu"))
    model = _zeroed(nn.Linear(2, 1))
    up = {"weight": torch.tensor([[3.0, 4.0]]), "bias": torch.zeros(1)}  # norm 5: clipped
    small = {"weight": torch.tensor([[0.1, 0.0]]), "bias": torch.tensor([0.2])}
    method.aggregate(model, [Reply(up, 1, 9), Reply(small, 1, 1)], {"clip": 1.0},
                     _info(cfg, 1.0), torch.Generator())
    # the server re-clips (3, 4) to (0.6, 0.8); uniform weights; K = 3 although 2 replied
    torch.testing.assert_close(model.weight.detach(), 0.5 * torch.tensor([[0.7, 0.8]]) / 3)
    torch.testing.assert_close(model.bias.detach(), 0.5 * torch.tensor([0.2]) / 3)


# ---------------------------------------------------------------- adaptive clipping
@pytest.mark.parametrize("gamma", [0.5, 0.8])
def test_adaptive_clip_tracks_the_target_quantile_of_update_norms(gamma):
    """Norms log-normal(0, 0.5) (so the gamma-quantile is exp(0.5 z_gamma)); 100 clients per
    round with the count noise of Andrew et al.'s default (m / 20 = 5 > sigma): from a clip 10x too
    small, C settles at the quantile within 10%."""
    cfg = tiny(method=METHOD, clients=1000, clients_per_round=100, sigma=1.0, clip=0.1,
               clip_quantile=gamma, clip_lr=0.2)
    method = DPFedAvgClient(cfg, torch.device("cpu"))
    assert cfg.clip_count_noise == 5.0
    gen = torch.Generator().manual_seed(3)
    state: dict = {"clip": 0.1}
    clips = []
    for _ in range(250):
        model = nn.Linear(4, 1)
        norms = torch.exp(0.5 * torch.randn(100, generator=gen))
        replies = []
        for n in norms.tolist():
            direction = torch.randn(5, generator=gen)
            update = {"weight": (direction[:4] / direction.norm() * n).view(1, 4),
                      "bias": (direction[4:] / direction.norm() * n)}
            payload, norm = clip_update(update, state["clip"])
            payload[BELOW_CLIP] = torch.tensor(float(norm <= state["clip"]))
            replies.append(Reply(payload, 1, 10))
        method.aggregate(model, replies, state, _info(cfg, state["clip"]), gen)
        clips.append(state["clip"])
    from scipy.stats import norm as gaussian

    quantile = math.exp(0.5 * gaussian.ppf(gamma))
    settled = float(np.mean(clips[-100:]))
    assert settled == pytest.approx(quantile, rel=0.1)
    assert clips[0] < 0.2 * quantile  # it did have to travel


# ---------------------------------------------------------------- sampling and accounting
def test_fixed_cohorts_have_k_distinct_clients_and_poisson_cohorts_vary():
    fixed = tiny(method=METHOD, clients=50, clients_per_round=7, reproducible_noise=True)
    cohorts = [select_clients(fixed, m) for m in range(1, 41)]
    assert all(len(c) == 7 == len(set(c)) and c == sorted(c) for c in cohorts)
    counts = np.bincount(np.concatenate(cohorts), minlength=50)
    assert counts.sum() == 280 and counts.max() < 20  # every client equally likely (5.6)
    poisson = tiny(method=METHOD, clients=50, client_fraction=0.14, reproducible_noise=True)
    sizes = [len(select_clients(poisson, m)) for m in range(1, 41)]
    assert len(set(sizes)) > 3 and 4 < np.mean(sizes) < 10
    # secret (OS-seeded) selection: the same round drawn twice differs (equal: p = 1e-8)
    secret = tiny(method=METHOD, clients=50, clients_per_round=7)
    assert select_clients(secret, 1) != select_clients(secret, 1)


def test_poisson_selection_keeps_the_random_stream_of_one_draw_per_client():
    """One vector of uniforms selects exactly the clients that one scalar draw per client,
    in client order, selected (the stream of runs seeded before the vector draw)."""
    from fedlap_privacy.fl.run.randomness import dp_generator

    cfg = tiny(method=METHOD, clients=3000, client_fraction=0.0333333, reproducible_noise=True)
    for m in (1, 2, 7):
        select = dp_generator(cfg, torch.device("cpu"), m, 0)
        scalar = [k for k in range(cfg.clients)
                  if float(torch.rand((), generator=select)) < cfg.client_fraction]
        assert select_clients(cfg, m) == scalar and 60 < len(scalar) < 140


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("sampling", [dict(client_fraction=0.25), dict(clients_per_round=5)])
def test_run_epsilon_equals_dp_accountings_for_the_sampled_schedule(sampling, accountant):
    """The whole run's epsilon against dp-accounting composing the events of the schedule
    the run sampled: Poisson at q; fixed K of n at rate K/n with sensitivity 2C."""
    pytest.importorskip("dp_accounting")
    import dp_accounting as dpa
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    cfg = tiny(method=METHOD, clients=20, split="iid", sigma=1.2, rounds=3, local_steps=1,
               accountant=accountant, **sampling)
    result = train(cfg, None, device="cpu")
    rate = 0.25 if "client_fraction" in sampling else 5 / 20
    sigma = 1.2 if "client_fraction" in sampling else 0.6
    assert [e.sigma for e in result.ledger.entries] == [sigma] * 3
    if "clients_per_round" in sampling:
        assert [len(e.participants) for e in result.ledger.entries] == [5, 5, 5]
    event = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(rate, dpa.GaussianDpEvent(sigma)), 3)
    if accountant == "rdp":
        theirs = RdpAccountant(orders=list(DEFAULT_ORDERS)).compose(event).get_epsilon(cfg.delta)
        assert result.summary.privacy.epsilon == pytest.approx(float(theirs), rel=1e-3)
    else:
        theirs = PLDAccountant().compose(event).get_epsilon(cfg.delta)
        assert result.summary.privacy.epsilon == pytest.approx(float(theirs), rel=2e-3)
    from fedlap_privacy.accountant.dp_events import client_level_event

    ours = client_level_event(cfg.sampling, 1.2, 3)
    again = RdpAccountant(orders=list(DEFAULT_ORDERS)).compose(ours).get_epsilon(cfg.delta)
    theirs_rdp = RdpAccountant(orders=list(DEFAULT_ORDERS)).compose(event).get_epsilon(cfg.delta)
    assert float(again) == pytest.approx(float(theirs_rdp), rel=1e-12)
    assert "trusted-server" == result.summary.privacy.threat_model
    assert ("without replacement" in result.summary.privacy.client_sampling) == (
        "clients_per_round" in sampling)


def test_fixed_cohorts_cost_more_than_poisson_at_the_same_rate():
    poisson = ClientSampling(100, 0.1)
    fixed = ClientSampling(100, cohort=10)
    assert poisson.q == fixed.q == 0.1 and fixed.expected_cohort == 10.0
    assert fixed.accounted_sigma(2.0) == 1.0 and poisson.accounted_sigma(2.0) == 2.0
    from fedlap_privacy.accountant import epsilon

    assert epsilon(fixed.schedule(), fixed.accounted_sigma(2.0), 50, 1e-5) > 1.5 * epsilon(
        poisson.schedule(), poisson.accounted_sigma(2.0), 50, 1e-5)


# ---------------------------------------------------------------- it learns
def test_dp_fedavg_client_learns_digits_with_20_clients_at_epsilon_8():
    """20 IID clients (~72 records each), all in every round (Poisson at rate 1), sigma
    planned for epsilon 8 over 10 rounds: about 0.73-0.77 over seeds 0-2 (chance 0.1)."""
    cfg = TrainConfig(method=METHOD, dataset="digits", split="iid", clients=20, rounds=10,
                      target_eps=8.0, sigma=None, clip=1.0, local_steps=5, batch_size=32,
                      lr_local=0.5, width=16, seed=0, split_seed=0)
    result = train(cfg, None, device="cpu")
    assert result.summary.privacy.epsilon == pytest.approx(8.0, rel=1e-3)
    assert result.summary.sigma_planned and result.summary.privacy.sigma > 1.5
    assert result.summary.test_accuracy > 0.5


def test_compare_plans_its_sigma_for_each_target_and_refuses_adaptive_canaries():
    from fedlap_privacy.fl.engine.compare import budget_config
    from fedlap_privacy.fl.run.privacy import with_planned_sigma

    base = tiny(method="fedavg", clients=20, split="iid", clients_per_round=5, rounds=4)
    cfg = budget_config(base, METHOD, 3.0)
    assert cfg.sigma is None and cfg.target_eps == 3.0
    planned = with_planned_sigma(cfg, [70] * 20)
    from fedlap_privacy.accountant import epsilon

    sampling = planned.sampling  # fixed cohorts: planned at sigma / 2, run at sigma
    assert planned.accountant == "pld"  # the default plans with PLD
    assert epsilon(sampling.schedule(), planned.sigma / 2, 4, planned.delta,
                   planned.accountant) == pytest.approx(3.0, rel=1e-3)
    with pytest.raises(ConfigError, match="canary clients upload at a fixed clip"):
        tiny(method=METHOD, clip_quantile=0.5, canaries=10, sigma=1.0).validate()
