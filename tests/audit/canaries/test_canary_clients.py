"""Canary-client epsilon estimation (Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, ICLR 2024).

Reference values: the authors' released tests (two Gaussians, and the closed-form null
with mean = std = d^-1/2 at delta 1e-2: 2.317789 for d = 2000, 2.375326 for d = 200).
The d = 200 value uses the exact cosine law with threshold tests (their code switches to
it below d = 1000); with the N(0, 1/d) null both dimensions give 2.317789, since the two
Gaussians then have equal variances and are one standard deviation apart.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.integrate import trapezoid
from scipy.stats import norm

from fedlap_privacy.audit import (
    CanaryClientEstimate,
    canary_client_epsilon,
    canary_cosines,
    cosine_null_threshold_epsilon,
    gaussian_epsilon,
    gaussian_pair_epsilon,
    max_cosines_over_rounds,
)
from fedlap_privacy.errors import ConfigError


def _sample_with(mean: float, std: float, n: int = 100) -> np.ndarray:
    """A sample whose mean and unbiased standard deviation are exactly ``mean``, ``std``."""
    z = np.random.default_rng(0).normal(size=n)
    z = (z - z.mean()) / z.std(ddof=1)
    return mean + std * z


def _hockey_stick(mu1: float, s1: float, mu2: float, s2: float, eps: float) -> float:
    """``int max(0, f1 - e^eps f2)`` on a fine grid (independent of the module's roots)."""
    lo = min(mu1 - 15 * s1, mu2 - 15 * s2)
    hi = max(mu1 + 15 * s1, mu2 + 15 * s2)
    y = np.linspace(lo, hi, 200_001)
    gap = np.maximum(0.0, norm.pdf(y, mu1, s1) - np.exp(eps + norm.logpdf(y, mu2, s2)))
    return float(trapezoid(gap, y))


# ------------------------------------------------------------- reference values


def test_reference_values_of_the_closed_form_null() -> None:
    for d, expected in ((2000, 2.317789), (200, 2.375326)):
        s = d**-0.5
        estimate = canary_client_epsilon(_sample_with(s, s), d, 1e-2)
        assert estimate.epsilon == pytest.approx(expected, abs=5e-7)
        assert estimate.null_law == ("gaussian" if d >= 1000 else "exact-cosine")
        assert (estimate.mean, estimate.std) == (pytest.approx(s), pytest.approx(s))
    # The N(0, 1/d) null does not depend on d here (equal variances, one std apart) ...
    for d in (200, 2000):
        s = d**-0.5
        assert gaussian_pair_epsilon(0, s, s, s, 1e-2) == pytest.approx(2.317789, abs=5e-7)
        forced = canary_client_epsilon(_sample_with(s, s), d, 1e-2, exact_null=False)
        assert forced.epsilon == pytest.approx(2.317789, abs=5e-7)
    # ... the exact law is lighter-tailed for small d and converges to it as d grows.
    exact = [cosine_null_threshold_epsilon(d**-0.5, d**-0.5, d, 1e-2) for d in (200, 2000, 20000)]
    assert exact[0] == pytest.approx(2.375326, abs=5e-7)
    assert exact[0] > exact[1] > exact[2] > 2.317789
    assert exact[2] == pytest.approx(2.317789, abs=1e-3)


def test_gaussian_mechanism_epsilons() -> None:
    # Analytic Gaussian mechanism, delta 1e-5 (the audit literature quotes 9.99 / 4.37 /
    # 1.99 / 0.92 for sigma 0.5 / 1 / 2 / 4, truncated to 2 decimals).
    for sigma, quoted in ((0.5, 9.99), (1.0, 4.37), (2.0, 1.99), (4.0, 0.92)):
        eps = gaussian_epsilon(sigma, 1e-5)
        assert math.floor(eps * 100) / 100 == quoted
        mu = 1 / sigma
        delta = norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu)
        assert delta == pytest.approx(1e-5, rel=1e-8)
    assert gaussian_epsilon(1.0, 1e-5) == pytest.approx(4.377178, abs=1e-6)
    assert gaussian_epsilon(100.0, 0.5) == 0.0


@pytest.mark.parametrize("sigma", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("delta", [1e-6, 1e-2])
def test_equal_variances_reduce_to_the_analytic_gaussian_mechanism(
    sigma: float, delta: float
) -> None:
    expected = gaussian_epsilon(sigma, delta)
    assert gaussian_pair_epsilon(0.0, sigma, 1.0, sigma, delta) == pytest.approx(expected, rel=1e-9)
    assert gaussian_pair_epsilon(3.0, 2 * sigma, 1.0, 2 * sigma, delta) == pytest.approx(
        expected, rel=1e-9
    )
    # Numerically equal but not identical variances go through the quadratic: continuous.
    for tiny in (1e-12, -1e-9):
        assert gaussian_pair_epsilon(0.0, sigma, 1.0, sigma * (1 + tiny), delta) == pytest.approx(
            expected, rel=1e-6
        )


def test_unequal_variances_solve_the_hockey_stick_exactly() -> None:
    rng = np.random.default_rng(7)
    for _ in range(6):
        mu1, mu2 = rng.uniform(0, 3, 2)
        s1, s2 = rng.uniform(0.5, 2, 2)
        delta = float(rng.choice([1e-5, 1e-3, 0.05]))
        eps = gaussian_pair_epsilon(mu1, s1, mu2, s2, delta)
        assert eps > 0
        worst = max(_hockey_stick(mu1, s1, mu2, s2, eps), _hockey_stick(mu2, s2, mu1, s1, eps))
        assert worst == pytest.approx(delta, rel=1e-5)
        # Symmetric in the two distributions, invariant to an affine change of scale.
        assert gaussian_pair_epsilon(mu2, s2, mu1, s1, delta) == pytest.approx(eps, rel=1e-9)
        assert gaussian_pair_epsilon(
            2.7 * mu1 + 3.1, 2.7 * s1, 2.7 * mu2 + 3.1, 2.7 * s2, delta
        ) == pytest.approx(eps, rel=1e-7)
    assert gaussian_pair_epsilon(0, 1, 0, 1, 1e-5) == 0.0


def test_gaussian_pair_rejects_bad_input() -> None:
    with pytest.raises(ConfigError):
        gaussian_pair_epsilon(0, 0.0, 1, 1, 1e-5)
    with pytest.raises(ConfigError):
        gaussian_pair_epsilon(0, 1, 1, 1, 0.0)
    with pytest.raises(ConfigError):
        gaussian_pair_epsilon(math.inf, 1, 1, 1, 1e-5)
    with pytest.raises(ConfigError):
        gaussian_epsilon(-1.0, 1e-5)


# ---------------------------------------------------------------- cosine statistics


def test_cosines_and_all_iterates() -> None:
    directions = np.array([[1.0, 0, 0], [0, 2.0, 0], [1.0, 1.0, 0]])
    delta = np.array([3.0, 0, 0])
    assert canary_cosines(directions, delta) == pytest.approx([1.0, 0.0, 2**-0.5])
    deltas = np.array([[3.0, 0, 0], [0, -1.0, 0], [0, 0, 5.0]])
    assert max_cosines_over_rounds(directions, deltas) == pytest.approx([1.0, 0.0, 2**-0.5])
    rng = np.random.default_rng(0)
    c, many = rng.normal(size=(20, 50)), rng.normal(size=(7, 50))
    per_round = np.stack([canary_cosines(c, row) for row in many], axis=1)
    assert max_cosines_over_rounds(c, many) == pytest.approx(per_round.max(axis=1))
    assert canary_cosines(5 * c, 0.1 * many[0]) == pytest.approx(per_round[:, 0])
    with pytest.raises(ConfigError):
        canary_cosines(c, np.zeros(50))
    with pytest.raises(ConfigError):
        canary_cosines(c, np.ones(49))
    with pytest.raises(ConfigError):
        max_cosines_over_rounds(np.zeros((2, 50)), many)


def test_exact_cosine_null_matches_random_directions() -> None:
    # Unobserved canaries: cosines of random directions with a fixed vector in R^d.
    d = 30
    rng = np.random.default_rng(1)
    c = rng.normal(size=(40_000, d))
    cos = canary_cosines(c, rng.normal(size=d))
    assert cos.var() == pytest.approx(1 / d, rel=0.03)
    from fedlap_privacy.audit.canaries.canary_clients import _cosine_log_sf

    for t in (-0.2, 0.0, 0.2, 0.4):
        assert math.exp(_cosine_log_sf(np.array([t]), d)[0]) == pytest.approx(
            (cos >= t).mean(), abs=0.006
        )


# --------------------------------------------------------------------- estimates


def test_empirical_null_and_record() -> None:
    d = 5000
    s = d**-0.5
    observed = _sample_with(1.5 * s, s, 200)
    unobserved = _sample_with(0.0, s, 300)
    closed = canary_client_epsilon(observed, d, 1e-5)
    empirical = canary_client_epsilon(observed, d, 1e-5, "empirical", unobserved)
    assert isinstance(empirical, CanaryClientEstimate)
    assert empirical.epsilon == pytest.approx(closed.epsilon, rel=1e-9)
    assert empirical.epsilon == pytest.approx(gaussian_epsilon(1 / 1.5, 1e-5), rel=1e-9)
    record = empirical.to_json()
    assert record["null"] == "empirical" and record["unobserved"] == 300
    assert record["observed"] == 200 and record["null_std"] == pytest.approx(s)
    with pytest.raises(ConfigError):
        canary_client_epsilon(observed, d, 1e-5, "empirical")  # no unobserved canaries
    with pytest.raises(ConfigError):
        canary_client_epsilon(observed, None, 1e-5)  # closed form needs d
    with pytest.raises(ConfigError):
        canary_client_epsilon(observed[:1], d, 1e-5)
    with pytest.raises(ConfigError):
        canary_client_epsilon(observed, d, 1e-5, "guess")  # type: ignore[arg-type]


def test_estimate_recovers_a_client_level_gaussian_mechanism() -> None:
    # The final model delta of client-level DP-FedAvg seen as one Gaussian mechanism: the
    # clipped (unit-norm) canary updates plus N(0, sigma^2 I). Each inserted canary then has
    # cosine ~ N(1/R, (sigma^2 + (n-1)/d)/R^2) and an unobserved one ~ N(0, 1/d) with
    # R^2 ~ n + sigma^2 d, i.e. a Gaussian mechanism with noise sqrt(sigma^2 + (n-1)/d).
    # The estimate is a noisy estimator: a 2% error in the fitted std moves it by ~10% at
    # delta 1e-3 (more at smaller delta), hence the tolerances.
    d, n, sigma, delta = 10_000, 1000, 1.0, 1e-3
    rng = np.random.default_rng(2)
    inserted = rng.normal(size=(n, d))
    inserted /= np.linalg.norm(inserted, axis=1, keepdims=True)
    model_delta = inserted.sum(axis=0) + rng.normal(0.0, sigma, d)
    observed = canary_cosines(inserted, model_delta)
    truth = gaussian_epsilon(math.sqrt(sigma**2 + (n - 1) / d), delta)
    estimate = canary_client_epsilon(observed, d, delta)
    assert estimate.epsilon == pytest.approx(truth, rel=0.15)
    unobserved = canary_cosines(rng.normal(size=(n, d)), model_delta)
    empirical = canary_client_epsilon(observed, d, delta, "empirical", unobserved)
    assert empirical.epsilon == pytest.approx(truth, rel=0.25)
