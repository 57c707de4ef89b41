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
