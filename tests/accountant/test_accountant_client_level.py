"""Client-level sampling and adaptive clipping's noise (accountant/client_level.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedlap_privacy.accountant import FedLAPSchedule, epsilon
from fedlap_privacy.accountant.client_level import ClientSampling, effective_sigma, update_sigma
from fedlap_privacy.errors import ConfigError


def test_poisson_is_the_client_level_sgm_and_fixed_cohorts_double_the_sensitivity():
    poisson = ClientSampling(50, 0.2)
    assert poisson.schedule() == FedLAPSchedule.client_level(50, 0.2)
    assert poisson.accounted_sigma(1.5) == 1.5 and poisson.expected_cohort == pytest.approx(10)
    fixed = ClientSampling(50, cohort=10)
    assert fixed.q == 0.2 and fixed.expected_cohort == 10.0
    assert fixed.accounted_sigma(1.5) == 0.75 and fixed.run_sigma(0.75) == 1.5
    assert "without replacement" in fixed.describe() and "Poisson" in poisson.describe()
    # the same sigma costs more with fixed cohorts (twice the sensitivity)
    assert epsilon(fixed.schedule(), fixed.accounted_sigma(1.5), 20, 1e-5) > epsilon(
        poisson.schedule(), poisson.accounted_sigma(1.5), 20, 1e-5)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(clients=5, cohort=6), "between 1 and the 5 clients"),
    (dict(clients=5, cohort=0), "between 1 and the 5 clients"),
    (dict(clients=5, rate=0.0), r"client fraction 0.0 must be in \(0, 1\]"),
    (dict(clients=5, rate=1.5), r"client fraction 1.5 must be in \(0, 1\]"),
    (dict(clients=0), "clients 0 must be a positive integer"),
])
def test_bad_sampling_is_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ClientSampling(**kwargs)


@pytest.mark.parametrize(("sigma", "count"), [(1.0, 5.0), (1.0, 0.6), (2.5, 10.0), (0.7, 0.36)])
def test_update_sigma_inverts_andrew_et_als_effective_sigma(sigma, count):
    u = update_sigma(sigma, count)
    assert u > sigma and effective_sigma(u, count) == pytest.approx(sigma, rel=1e-12)
    # (sigma_u^-2 + (2 sigma_b)^-2)^-1/2 written out
    assert (u**-2 + (2 * count) ** -2) ** -0.5 == pytest.approx(sigma, rel=1e-12)


def test_a_count_noise_at_or_below_half_sigma_is_refused():
    with pytest.raises(ConfigError, match=r"clip_count_sigma 0.5 must exceed sigma/2 = 0.5"):
        update_sigma(1.0, 0.5)


def test_imports_without_torch():
    code = ("import sys, fedlap_privacy.accountant.client_level; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def _worst_case_delta(eps: float, sigma: float, q: float) -> float:
    """The exact delta(eps) of one round with a fixed cohort of K of n clients (q = K/n)
    between the dataset with client x (update +C) and without it, every other client at -C,
    in units of C: with x the cohort sum is -KC + 2C with probability K/n, else -KC; without
    x it is -KC. Both directions of the hockey-stick divergence, integrated on a fine grid."""
    import numpy as np
    from scipy.stats import norm

    z = np.linspace(-14 * sigma, 2 + 14 * sigma, 400_001)
    without = norm.pdf(z, 0, sigma)
    with_x = (1 - q) * without + q * norm.pdf(z, 2, sigma)
    return max(np.trapezoid(np.maximum(with_x - np.exp(eps) * without, 0), z),
               np.trapezoid(np.maximum(without - np.exp(eps) * with_x, 0), z))


@pytest.mark.parametrize(("sigma", "q"), [(1.0, 0.1), (2.0, 0.25), (0.8, 0.5)])
def test_fixed_cohort_accounting_is_tight_on_the_worst_case_and_the_naive_one_is_not(sigma, q):
    """Fault injection on the accounting: the event we compose for fixed-size cohorts
    (Poisson at K/n, multiplier sigma / 2) gives exactly the worst case's delta; pricing
    them as Poisson at K/n with the run's sigma (sensitivity C) under-reports it (2.7x to
    1e8x on these cases)."""
    import dp_accounting as dpa
    from dp_accounting.pld import PLDAccountant

    from fedlap_privacy.accountant.dp_events import client_level_event

    n = 100
    sampling = ClientSampling(n, cohort=round(q * n))
    for eps in (0.5, 1.0, 2.0):
        truth = _worst_case_delta(eps, sigma, q)
        ours = PLDAccountant().compose(client_level_event(sampling, sigma)).get_delta(eps)
        naive = PLDAccountant().compose(dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), 1)).get_delta(eps)
        assert ours == pytest.approx(truth, rel=1e-6)
        assert naive < truth / 2.5
