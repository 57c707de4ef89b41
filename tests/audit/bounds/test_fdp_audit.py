"""f-DP one-run audit (Mahloujifar, Melis, Chaudhuri, ICML 2025) and the claim-curve test.

The reference implementation below writes the paper's recursion term by term, with no early
stop, the normal CDF of the standard library, and ``mu`` found by scanning a fine grid: it
shares no code with :mod:`fedlap_privacy.audit.bounds.fdp`. The idealised Gaussian mechanism is
simulated as in test_one_run_audit.py: a canary's score is ``N(S_i / sigma, 1)``.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from fedlap_privacy.accountant import FedLAPSchedule, epsilon
from fedlap_privacy.audit import gaussian_epsilon, one_run_audit, one_run_lower_bound
from fedlap_privacy.audit.bounds.claim_curve import ClaimCurve, claim_curve_test
from fedlap_privacy.audit.bounds.fdp import (
    curve_p_value,
    fdp_lower_bound,
    gaussian_inverse,
    gdp_epsilon,
    gdp_mu,
    gdp_mu_lower_bound,
)
from fedlap_privacy.audit.bounds.one_run import one_run_candidate_counts, one_run_ceiling
from fedlap_privacy.errors import ConfigError

DELTA = 1e-5
_N = NormalDist()


def _direct_rejects(mu: float, m: int, k: int, c: int, tau: float) -> bool:
    """The paper's recursion, every step, no shortcut."""
    r, h = tau * c / m, tau * (k - c) / m
    for i in range(c - 1, -1, -1):
        inv = _N.cdf(_N.inv_cdf(r) - mu) if 0.0 < r < 1.0 else (0.0 if r <= 0.0 else 1.0)
        h_next = max(h, inv)
        r = min(1.0, r + i / (k - i) * (h_next - h))
        h = h_next
    return c > 0 and r + h > k / m


def _direct_mu(m: int, k: int, c: int, level: float, step: float = 0.002) -> float:
    """The largest mu on a grid of ``step`` that the direct recursion rejects."""
    grid = np.arange(0.0, 12.0, step)
    rejected = [mu for mu in grid if _direct_rejects(float(mu), m, k, c, level)]
    return float(max(rejected)) if rejected else 0.0


@pytest.mark.parametrize(("m", "k", "c"), [
    (1000, 1000, 1000), (1000, 100, 100), (1000, 200, 190), (1000, 1000, 700),
    (100, 50, 45), (1000, 16, 16),
])
def test_mu_matches_a_direct_scan_of_the_papers_recursion(m: int, k: int, c: int) -> None:
    direct = _direct_mu(m, k, c, 0.05)
    assert gdp_mu_lower_bound(m, k, c, 0.05) == pytest.approx(direct, abs=0.0021)
    assert direct > 0.3


def test_reference_fdp_ceilings_and_gdp_conversion() -> None:
    # Dong, Roth, Su: 1-GDP is (4.38, 1e-5)-DP, 2-GDP (10.00, 1e-5)-DP (analytic Gaussian)
    assert gdp_epsilon(1.0, DELTA) == pytest.approx(4.3772, abs=1e-3)
    assert gdp_epsilon(2.0, DELTA) == pytest.approx(gaussian_epsilon(0.5, DELTA), rel=1e-9)
    assert gdp_mu(gdp_epsilon(1.7, DELTA), DELTA) == pytest.approx(1.7, rel=1e-8)
    # all guesses right among 1000 canaries, 95%: Steinke 5.78 (r = 1000), 3.47 (r = 100)
    assert one_run_ceiling(1000, 1000, DELTA, method="fdp") == pytest.approx(12.335, abs=2e-3)
    assert one_run_ceiling(1000, 100, DELTA, method="fdp") == pytest.approx(5.549, abs=2e-3)
    assert one_run_ceiling(1000, 1000, DELTA) == pytest.approx(5.78, abs=0.01)


def test_p_value_matches_a_direct_scan() -> None:
    inverse = gaussian_inverse(0.8)
    for m, k, c in [(1000, 200, 150), (1000, 100, 95), (500, 500, 330)]:
        taus = np.exp(np.linspace(math.log(1e-12), 0.0, 3000))
        direct = next((t for t in taus if _direct_rejects(0.8, m, k, c, float(t))), 1.0)
        assert curve_p_value(inverse, m, k, c) == pytest.approx(direct, rel=0.01)
    assert curve_p_value(inverse, 1000, 200, 100) == 1.0  # chance accuracy: nothing shown


def test_fdp_is_at_least_steinke_on_the_same_counts_except_near_zero() -> None:
    """The paper's claim that the f-DP analysis dominates, checked on a grid of counts:
    it holds wherever Steinke's bound is at least 0.07; just above chance (both bounds
    below 0.07) the Gaussian-family bound can be the smaller."""
    below = []
    for m in (100, 1000, 10000):
        for r in sorted({16, 100, 500, m // 2, m} - {0}):
            if r > m:
                continue
            for v in {round(f * r) for f in np.linspace(0.5, 1.0, 21)}:
                s = one_run_lower_bound(m, r, v, DELTA)
                f = one_run_lower_bound(m, r, v, DELTA, method="fdp")
                if f < s:
                    below.append((m, r, v, s))
                    assert s < 0.07, (m, r, v, s, f)
                else:
                    assert f >= s
    assert (1000, 16, 12, pytest.approx(0.047, abs=1e-3)) in below


@pytest.mark.parametrize(("k", "c"), [(16, 12), (16, 14), (100, 62), (250, 160)])
def test_near_chance_the_papers_recursion_is_looser_than_the_exact_binomial(k: int,
                                                                            c: int) -> None:
    """Why the f-DP bound can fall below Steinke's just above chance: not our threshold
    selection, discretisation or confidence, but the paper's recursion itself. At mu = 0 (a
    mechanism that leaks nothing) the correct guesses are exactly Binomial(k, 1/2), whose
    tail is what Steinke's p-value tends to as eps -> 0; the recursion's p-value there is a
    few per cent above that exact tail (12 of 16: 0.0415 against 0.0384), sound but looser,
    so a tiny mu is rejected later than a tiny eps. The audit reports the larger valid
    bound; each test runs at its Bonferroni share of the level, so the larger one holds at
    the audit's confidence (tests/audit/canaries/test_canary_audit.py)."""
    from scipy.stats import binom

    exact = float(binom.sf(c - 1, k, 0.5))
    recursion = curve_p_value(gaussian_inverse(0.0), 1000, k, c, rtol=1e-4)
    assert exact <= recursion <= 1.2 * exact


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0])
def test_fdp_bound_never_exceeds_the_gaussian_mechanisms_epsilon(sigma: float) -> None:
    true_eps = gaussian_epsilon(sigma, DELTA)
    fdp, steinke = [], []
    for seed in range(25):
        rng = np.random.default_rng(seed)
        included = rng.random(1000) < 0.5
        scores = included / sigma + rng.standard_normal(1000)
        fdp.append(one_run_audit(scores, included, DELTA, method="fdp").epsilon_lower_bound)
        steinke.append(one_run_audit(scores, included, DELTA).epsilon_lower_bound)
    assert max(fdp) < true_eps, (fdp, true_eps)
    assert np.mean(fdp) > 1.3 * np.mean(steinke)  # measured: 1.4-1.7x


def test_fdp_audit_reports_its_method_and_ceiling() -> None:
    rng = np.random.default_rng(0)
    included = rng.random(1000) < 0.5
    scores = included * 100.0 + rng.standard_normal(1000)  # no noise to speak of
    result = one_run_audit(scores, included, DELTA, method="fdp")
    assert result.method == "fdp" and result.to_json()["method"] == "fdp"
    assert result.epsilon_lower_bound == pytest.approx(result.ceiling)
    assert result.ceiling > one_run_audit(scores, included, DELTA).ceiling
    split = one_run_audit(scores, included, DELTA, method="fdp", selection="split")
    assert split.canaries == 500 and split.epsilon_lower_bound > 5.0


def test_fdp_rejects_bad_input() -> None:
    with pytest.raises(ConfigError, match="delta > 0"):
        one_run_lower_bound(100, 10, 10, 0.0, method="fdp")
    with pytest.raises(ConfigError, match="method must be one of"):
        one_run_lower_bound(100, 10, 10, DELTA, method="gdp")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="0 < delta < 1"):
        fdp_lower_bound(100, 10, 10, 0.0, 0.05)


def test_claim_curve_matches_the_accountant_and_the_gaussian() -> None:
    schedule = FedLAPSchedule(batch_size=8, client_size=32, local_steps=40)
    curve = ClaimCurve.from_steps({(2.0, 0.25): 40}, DELTA)
    assert curve.epsilon(DELTA) == pytest.approx(
        epsilon(schedule, 2.0, 1, DELTA, accountant="pld"), abs=0.02)
    single = ClaimCurve.from_steps({(1.0, 1.0): 1}, DELTA)  # the Gaussian mechanism: 1-GDP
    gaussian = gaussian_inverse(1.0)
    for r in (0.01, 0.1, 0.5, 0.9, 0.99):
        assert single.inverse(r) <= gaussian(r) + 1e-12  # errs towards the claim
        assert single.inverse(r) == pytest.approx(gaussian(r), rel=0.02, abs=1e-4)
    with pytest.raises(ConfigError, match="no noisy step"):
        ClaimCurve.from_steps({(1.0, 0.0): 3})


def test_claim_curve_test_on_a_gaussian_mechanism() -> None:
    """Claim: 1-GDP (a Gaussian step at sigma 1, q = 1). The run's noise matches (never a
    violation over seeds) or is 40% of it (always caught at 1000 canaries; measured median
    p-value 3e-3; at half the noise the median is 0.04 and 2 of 10 seeds escape)."""
    curve = ClaimCurve.from_steps({(1.0, 1.0): 1}, DELTA)
    verdicts: dict[float, list[tuple[str, float]]] = {1.0: [], 0.4: []}
    for seed in range(10):
        rng = np.random.default_rng(seed)
        included = rng.random(1000) < 0.5
        noise = rng.standard_normal(1000)
        for sigma in verdicts:
            scores = included / sigma + noise
            test = claim_curve_test(curve, 1000, one_run_candidate_counts(scores, included),
                                    0.95, included=int(included.sum()))
            verdicts[sigma].append((test.verdict, test.p_value))
    assert all(v != "violation" for v, _ in verdicts[1.0]), verdicts[1.0]
    assert all(v == "violation" for v, _ in verdicts[0.4]), verdicts[0.4]
    assert np.median([p for _, p in verdicts[0.4]]) < 0.005
