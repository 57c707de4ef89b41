"""Distributed DP accounting against independent oracles (docs/accounting.md).

* Renyi divergences computed numerically from the pmfs: scipy.stats.skellam for the Skellam
  sum, an explicit discrete Gaussian pmf convolved n times for the distributed discrete
  Gaussian. Every bound must be >= the exact divergence of a 1-D shift by the sensitivity.
* The continuous Gaussian as a floor: at the same noise variance and sensitivity a discrete,
  rounded mechanism is never accounted tighter, and approaches it for large noise.
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import logsumexp
from scipy.stats import skellam

from fedlap_privacy.accountant import DEFAULT_ORDERS, rdp_to_epsilon, sgm_rdp
from fedlap_privacy.accountant.distributed import (
    DistributedMechanism,
    DistributedNoise,
    Quantisation,
    central_gaussian_sigma,
    counted_shares,
    discrete_gaussian_rdp,
    distributed_epsilon,
    grid_step,
    l1_sensitivity,
    l2_sensitivity,
    padded_dimension,
    plan_distributed,
    round_rdp,
    skellam_rdp,
)
from fedlap_privacy.errors import ConfigError

DELTA = 1e-5


def test_imports_without_torch():
    code = ("import sys, fedlap_privacy.accountant.distributed; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def _renyi(log_p: np.ndarray, log_q: np.ndarray, alpha: float) -> float:
    """D_alpha(P || Q) = log(sum p^alpha q^(1-alpha)) / (alpha - 1), in log space, over the
    points where both pmfs are representable; the largest term must lie well inside them
    (the truncated tails are then negligible)."""
    keep = np.isfinite(log_p) & np.isfinite(log_q) & (log_p > -700) & (log_q > -700)
    terms = alpha * log_p[keep] + (1.0 - alpha) * log_q[keep]
    top = int(np.argmax(terms))
    assert 5 < top < terms.size - 5 and terms[[0, -1]].max() < terms[top] - 30
    return float(logsumexp(terms) / (alpha - 1.0))


def _skellam_divergence(mu: float, shift: int, alpha: float) -> float:
    half = int(60 + 40 * math.sqrt(mu) + 4 * alpha * shift)
    k = np.arange(-half, half + 1)
    return _renyi(skellam.logpmf(k - shift, mu, mu), skellam.logpmf(k, mu, mu), alpha)


def _discrete_gaussian_log_pmf(s: float, shares: int, half: int) -> np.ndarray:
    """log pmf of the sum of ``shares`` independent N_Z(0, s^2) on [-half, half]."""
    k = np.arange(-half, half + 1)
    one = np.exp(-(k**2) / (2.0 * s**2))
    one /= one.sum()
    total = one
    for _ in range(shares - 1):
        total = np.convolve(total, one)
    mid = total.size // 2
    return np.log(np.maximum(total[mid - half : mid + half + 1], 1e-300))


def _dg_divergence(s: float, shares: int, shift: int, alpha: float) -> float:
    half = int(40 + 12 * s * math.sqrt(shares) + 4 * alpha * shift)
    log_p = _discrete_gaussian_log_pmf(s, shares, half)
    inner = slice(shift, log_p.size)  # P shifted by `shift`: p(k - shift) vs q(k)
    outer = slice(0, log_p.size - shift)
    return _renyi(log_p[outer], log_p[inner], alpha)


# ---------------------------------------------------------------------------- (a) oracles


@pytest.mark.parametrize("mu", [0.3, 1.0, 4.0, 25.0, 200.0])
@pytest.mark.parametrize("alpha", [2.0, 3.0, 5.0, 10.0, 32.0])
@pytest.mark.parametrize("shift", [1, 2, 4])
def test_skellam_bound_holds_against_exact_divergence(mu, alpha, shift):
    exact = _skellam_divergence(mu, shift, alpha)
    bound = skellam_rdp(float(shift), l1_sensitivity(float(shift), 1), mu, [alpha])[0]
    assert bound >= exact * (1 - 1e-9)
    # and it is not vacuous: within a factor that shrinks as the noise grows
    assert bound <= exact * (3.0 if mu >= 25 else 40.0) + 1e-9


def test_skellam_is_infinite_at_fractional_orders():
    rdp = skellam_rdp(1.0, 1.0, 10.0, [1.5, 2.0])
    assert math.isinf(rdp[0]) and math.isfinite(rdp[1])


def test_naive_discrete_gaussian_formula_is_violated_and_ours_holds():
    """n = 3 shares of s = 0.5, alpha 4, shift 1: exact 2.850, naive alpha/(2 n s^2) 2.667."""
    exact = _dg_divergence(0.5, 3, 1, 4.0)
    assert exact == pytest.approx(2.850, abs=1e-3)
    naive = 4.0 / (2 * 3 * 0.25)
    assert naive < exact
    assert discrete_gaussian_rdp(1.0, 1.0, 0.5, 3, 1, [4.0])[0] >= exact


@pytest.mark.parametrize("s", [0.3, 0.5, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("shares", [1, 2, 3, 5])
@pytest.mark.parametrize("alpha", [1.5, 2.0, 4.0, 10.0, 30.0])
def test_discrete_gaussian_bound_holds_against_exact_divergence(s, shares, alpha):
    shift = 2
    exact = _dg_divergence(s, shares, shift, alpha)
    bound = discrete_gaussian_rdp(float(shift), l1_sensitivity(float(shift), 1), s, shares, 1,
                                  [alpha])[0]
    assert bound >= exact * (1 - 1e-9)


# ------------------------------------------------------------------------------ sensitivities


def test_sensitivities_by_hand():
    # c = 1, gamma = 0.5, d = 4, beta = exp(-0.5): sqrt(1 + 0.25 + 1 * 0.5 * 1.5) = sqrt(2)
    l2 = l2_sensitivity(1.0, 4, 0.5, math.exp(-0.5))
    assert l2 == pytest.approx(math.sqrt(2.0) / 0.5)
    assert l2_sensitivity(1.0, 4, 0.5, 0.0) == pytest.approx(2.0 / 0.5)  # c + gamma sqrt(d)
    assert l1_sensitivity(l2, 4) == pytest.approx(l2 * 2.0)  # min(sqrt(d), l2) = 2
    assert l1_sensitivity(1.5, 1024) == pytest.approx(2.25)  # integers: L1 <= L2^2
    assert [padded_dimension(n) for n in (1, 5, 65536, 65537)] == [1, 8, 65536, 131072]


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-3, 1e3), st.integers(0, 22), st.floats(1e-6, 1e2), st.floats(1e-9, 0.99))
def test_sensitivity_never_below_the_clip_and_conditional_never_worse(clip, log_d, gamma, beta):
    d = 1 << log_d
    conditional = l2_sensitivity(clip, d, gamma, beta)
    unconditional = l2_sensitivity(clip, d, gamma, 0.0)
    assert clip / gamma * (1 - 1e-12) <= conditional <= unconditional * (1 + 1e-12)
    assert l1_sensitivity(conditional, d) >= conditional * (1 - 1e-12) or conditional < 1


@pytest.mark.parametrize(("args", "words"), [
    ((0.0, 4, 0.1, 0.5), "clipping"), ((1.0, 6, 0.1, 0.5), "power of 2"),
    ((1.0, 4, -1.0, 0.5), "gamma"), ((1.0, 4, 0.1, 1.0), "beta"),
])
def test_bad_quantisation_is_one_line_error(args, words):
    with pytest.raises(ConfigError, match=words):
        Quantisation(*args)


# ------------------------------------------------------------- (b) the continuous Gaussian floor


def _dg_variance(s: float) -> float:
    k = np.arange(-int(20 * s + 20), int(20 * s + 20) + 1)
    w = np.exp(-(k**2) / (2.0 * s**2))
    return float(np.sum(w * k**2) / np.sum(w))


def _gaussian_epsilon(sensitivity: float, std: float, rounds: int) -> float:
    rdp = rounds * sgm_rdp(1.0, std / sensitivity, DEFAULT_ORDERS)
    return rdp_to_epsilon(rdp, DEFAULT_ORDERS, DELTA)[0]


@pytest.mark.parametrize("noise", list(DistributedNoise))
@pytest.mark.parametrize("local_std", [0.4, 1.0, 3.0, 30.0, 300.0])
@pytest.mark.parametrize("shares", [2, 10, 100])
def test_never_below_the_continuous_gaussian_at_the_same_variance(noise, local_std, shares):
    """Reference variance: the shares' nominal variance (local_std^2 each). For a discrete
    Gaussian share with local_std >= 1 that is its true variance to 1e-6; below 1 the true
    variance is smaller (see the next test)."""
    q = Quantisation(clip=1.0, dim=1024, gamma=0.01)
    mech = DistributedMechanism(noise, q, local_std)
    rounds = 50
    ours = distributed_epsilon(mech, [shares] * rounds, DELTA).epsilon
    floor = _gaussian_epsilon(q.l2, math.sqrt(shares) * local_std, rounds)
    assert ours >= floor * (1 - 1e-12)
    # the clipped, unrounded Gaussian (sensitivity c / gamma) is lower still
    assert floor >= _gaussian_epsilon(q.clip / q.gamma, math.sqrt(shares) * local_std, rounds)
    if local_std >= 1.0:
        assert _dg_variance(local_std) == pytest.approx(local_std**2, rel=1e-6)


def test_small_discrete_gaussian_is_below_the_gaussian_of_equal_variance():
    """Why the floor uses the nominal variance: N_Z(0, 0.25) has variance 0.2150, and the exact
    divergence of 3 such shares (2.850 at alpha 4) is below the continuous Gaussian's of the
    same variance (alpha / (2 * 3 * 0.2150) = 3.101); the bound (>= 3.88) stays above both."""
    var = 3 * _dg_variance(0.5)
    assert var == pytest.approx(3 * 0.2150, abs=1e-4)
    exact = _dg_divergence(0.5, 3, 1, 4.0)
    assert exact < 4.0 / (2 * var)
    assert discrete_gaussian_rdp(1.0, 1.0, 0.5, 3, 1, [4.0])[0] > 4.0 / (2 * var)


@pytest.mark.parametrize("noise", list(DistributedNoise))
def test_within_five_percent_of_the_gaussian_for_large_noise(noise):
    q = Quantisation(clip=1.0, dim=65536, gamma=1e-4)
    local_std = 3000.0
    mech = DistributedMechanism(noise, q, local_std)
    ours = distributed_epsilon(mech, [100] * 200, DELTA).epsilon
    gauss = _gaussian_epsilon(q.clip / q.gamma, math.sqrt(100) * local_std, 200)
    assert gauss <= ours <= 1.05 * gauss


# ------------------------------------------------------- shares: survivors and colluders


def test_only_surviving_and_honest_shares_count():
    q = Quantisation(clip=1.0, dim=256, gamma=0.01)
    mech = DistributedMechanism(DistributedNoise.SKELLAM, q, 60.0)
    full = distributed_epsilon(mech, [100] * 100, DELTA).epsilon
    dropped = distributed_epsilon(mech, [60] * 100, DELTA).epsilon
    colluded = distributed_epsilon(mech, [100] * 100, DELTA, colluding=40).epsilon
    assert dropped > full
    assert colluded == pytest.approx(dropped)  # 100 received - 40 colluding = 60 honest
    np.testing.assert_allclose(round_rdp(mech, 100, 40), round_rdp(mech, 60))
    mixed = distributed_epsilon(mech, [100] * 50 + [60] * 50, DELTA).epsilon
    assert full < mixed < dropped
    assert counted_shares(10, 3) == 7
    with pytest.raises(ConfigError, match="no honest noise share"):
        counted_shares(5, 5)


def test_dropouts_raise_a_planned_epsilon():
    """Shares sized for 100 clients, 60 survivors: the planned epsilon 4 grows."""
    plan = plan_distributed("skellam", epsilon=4.0, delta=DELTA, model_size=65536, clients=100,
                            rounds=1500, bits=20)
    survivors = distributed_epsilon(plan.mechanism, [60] * 1500, DELTA)
    assert 5.0 < survivors.epsilon < 5.6  # 60% of the planned variance
    assert survivors.fewest_honest_shares == 60 and survivors.participations == 1500


def test_a_plan_at_min_survivors_holds_whatever_survives_above_it():
    """The planner's shares are sized for min_survivors - colluding honest shares: the target
    holds in every released round (the 60-of-100 plan spends 4, not 5.36, at 60 survivors;
    more survivors spend less), at a larger local share than the all-arrive plan's."""
    common = dict(epsilon=4.0, delta=DELTA, model_size=65536, clients=100, rounds=1500,
                  bits=20)
    every = plan_distributed("skellam", **common)
    plan = plan_distributed("skellam", **common, min_survivors=60, colluding=5)
    assert plan.local_sigma == pytest.approx(every.local_sigma * math.sqrt(100 / 55), rel=2e-3)
    for received in (60, 80, 100):
        eps = distributed_epsilon(plan.mechanism, [received] * 1500, DELTA, 5).epsilon
        assert eps <= 4.0 and (received > 60 or eps > 4.0 * (1 - 1e-3))
    with pytest.raises(ConfigError, match="no honest noise share"):
        plan_distributed("skellam", **common, min_survivors=5, colluding=5)


# ---------------------------------------------------------------------- (c) properties


@settings(max_examples=150, deadline=None)
@given(st.floats(0.1, 1e4), st.floats(1.0, 1e3), st.floats(1.1, 5.0), st.integers(2, 60))
def test_skellam_monotone_and_above_gaussian(mu, l2, more, alpha):
    l1 = l1_sensitivity(l2, 1 << 16)
    r = skellam_rdp(l2, l1, mu, [float(alpha)])[0]
    assert r >= alpha * l2**2 / (4 * mu)  # Gaussian of variance 2 mu
    assert skellam_rdp(l2, l1, mu * more, [float(alpha)])[0] <= r


@settings(max_examples=150, deadline=None)
@given(st.floats(0.2, 1e3), st.integers(1, 200), st.floats(0.5, 50.0), st.floats(1.1, 60.0))
def test_discrete_gaussian_above_its_nominal_gaussian(s, n, l2, alpha):
    r = discrete_gaussian_rdp(l2, l1_sensitivity(l2, 1024), s, n, 1024, [alpha])[0]
    assert r >= alpha * l2**2 / (2 * n * s**2) * (1 - 1e-12)


# ------------------------------------------------------------------------- (d) planning


@pytest.mark.parametrize("noise", list(DistributedNoise))
@pytest.mark.parametrize(("bits", "target"), [(18, 4.0), (20, 1.0)])
def test_plan_round_trip(noise, bits, target):
    plan = plan_distributed(noise, epsilon=target, delta=DELTA, model_size=50_000, clients=100,
                            rounds=300, bits=bits)
    again = distributed_epsilon(plan.mechanism, [100] * 300, DELTA).epsilon
    assert again == pytest.approx(plan.epsilon)
    assert target * (1 - 1e-3) <= again <= target
    assert plan.mechanism.quantisation.dim == 65536
    assert plan.ratio >= 1.0
    # the sum fits the modulus: k = 3.9 standard deviations of a coordinate of the sum
    q = plan.mechanism.quantisation
    spread = math.sqrt(100**2 / q.dim + 100 / 4 + 100 * plan.mechanism.local_std**2)
    assert 2 * 3.89 * spread <= plan.modulus * 1.001


def test_plan_ratios_against_central_dp():
    """100 clients a round, 1,500 rounds, epsilon 4: the price of distributing the noise."""
    central = central_gaussian_sigma(4.0, DELTA, 1500)
    assert _gaussian_epsilon(1.0, central, 1500) == pytest.approx(4.0, rel=1e-3)
    ratios = {b: plan_distributed("skellam", epsilon=4.0, delta=DELTA, model_size=65536,
                                  clients=100, rounds=1500, bits=b).ratio for b in (16, 18, 20)}
    assert 1.3 < ratios[16] < 1.5
    assert 1.0 < ratios[18] < 1.02
    assert 1.0 < ratios[20] < 1.002
    with pytest.raises(ConfigError, match=r"cannot reach epsilon 4 .* at any noise"):
        plan_distributed("skellam", epsilon=4.0, delta=DELTA, model_size=2**20, clients=100,
                         rounds=1500, bits=16)


def test_grid_step_refuses_too_few_bits():
    with pytest.raises(ConfigError, match="cannot hold"):
        grid_step(1.0, 1024, 1000, 4, 1.0)
    assert grid_step(1.0, 1024, 10, 20, 0.0) < grid_step(1.0, 1024, 10, 16, 0.0)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"noise": "laplace"}, "not one of: skellam, discrete-gaussian"),
    ({"bits": 1}, "bits 1 must be"),
    ({"bits": 4}, "cannot hold"),
    ({"bits": 8}, "cannot reach epsilon"),
    ({"epsilon": -1.0}, "epsilon"),
    ({"delta": 1.0}, "delta"),
    ({"rounds": 0}, "rounds"),
    ({"model_size": 0}, "model size"),
])
def test_bad_plans_are_one_line_errors(kwargs, words):
    args = {"noise": "skellam", "epsilon": 4.0, "delta": DELTA, "model_size": 1000,
            "clients": 100, "rounds": 10, "bits": 20} | kwargs
    noise = args.pop("noise")
    with pytest.raises(ConfigError, match=words):
        plan_distributed(noise, **args)
