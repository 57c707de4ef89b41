"""RDP of one sampled Gaussian step and its (epsilon, delta) conversion
(docs/accounting.md#rdp-of-one-step, #rdp-to-epsilon-delta).

Exactness against independent oracles (mpmath, Opacus, dp-accounting) lives in
test_accountant_oracles.py; this file pins the closed forms, special cases and edge cases.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedlap_privacy.accountant import (
    DEFAULT_ORDERS,
    EXTENDED_ORDERS,
    rdp_to_epsilon,
    sgm_rdp,
)

MIXED_ORDERS = np.array([1.1, 1.5, 2.0, 3.3, 10.9, 32.0, 58.75, 63.0])


def test_default_orders_are_the_papers_grid() -> None:
    expected = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    assert DEFAULT_ORDERS.shape == (151,)
    np.testing.assert_array_equal(DEFAULT_ORDERS, np.array(expected, dtype=float))


def test_extended_orders_add_dp_accounting_orders() -> None:
    assert set(EXTENDED_ORDERS) == set(DEFAULT_ORDERS) | {11.0, 128.0, 256.0, 512.0, 1024.0}
    assert np.all(np.diff(EXTENDED_ORDERS) > 0)


@pytest.mark.parametrize("sigma", [0.3, 1.0, 12.0])
def test_q_zero_is_zero(sigma: float) -> None:
    np.testing.assert_array_equal(sgm_rdp(0.0, sigma, MIXED_ORDERS), np.zeros(MIXED_ORDERS.size))


@pytest.mark.parametrize("sigma", [0.3, 1.0, 12.0])
def test_q_one_is_the_gaussian_mechanism(sigma: float) -> None:
    np.testing.assert_allclose(
        sgm_rdp(1.0, sigma, MIXED_ORDERS), MIXED_ORDERS / (2 * sigma**2), rtol=1e-15
    )


@pytest.mark.parametrize("q", [1e-3, 0.5, 1.0])
def test_sigma_zero_is_infinite(q: float) -> None:
    assert np.all(np.isposinf(sgm_rdp(q, 0.0, MIXED_ORDERS)))


def test_order_two_closed_form() -> None:
    # A_2 = 1 + q^2 (exp(1/sigma^2) - 1): RDP at order 2 is log(A_2)
    for q in (1e-4, 0.0256, 0.4, 0.9):
        for sigma in (0.5, 1.0, 7.0):
            expected = math.log1p(q * q * math.expm1(1 / sigma**2))
            got = float(sgm_rdp(q, sigma, [2.0])[0])
            assert got == pytest.approx(expected, rel=1e-13)


def test_order_three_closed_form() -> None:
    # A_3 - 1 = 3 q^2 (1-q) (e^{1/s^2} - 1) + q^3 (e^{3/s^2} - 1)
    for q in (1e-3, 0.1, 0.7):
        for sigma in (0.8, 2.0, 20.0):
            a3m1 = 3 * q * q * (1 - q) * math.expm1(1 / sigma**2)
            a3m1 += q**3 * math.expm1(3 / sigma**2)
            assert float(sgm_rdp(q, sigma, [3.0])[0]) == pytest.approx(
                math.log1p(a3m1) / 2, rel=1e-13
            )


def test_small_q_limit_is_q_squared_alpha_over_sigma_squared() -> None:
    # for q -> 0 and moderate alpha/sigma: xi ~ q^2 alpha (e^{1/s^2} - 1) / 2 (leading term)
    q, sigma = 1e-6, 2.0
    got = sgm_rdp(q, sigma, MIXED_ORDERS[:5])
    lead = q * q * MIXED_ORDERS[:5] * math.expm1(1 / sigma**2) / 2
    np.testing.assert_allclose(got, lead, rtol=1e-4)


def test_large_sigma_fractional_order_is_positive() -> None:
    """The known defect point (docs/accounting.md#fractional-orders).
    log A_alpha > 0 and the mpmath value.

    Reference: mpmath (dps 40) quadrature of Mironov et al. Eq. 4, see
    test_accountant_oracles.py: log A = 2.0906741152138718167..., xi = log A / 57.75.
    """
    xi = float(sgm_rdp(0.4, 12.0, [58.75])[0])
    log_a = xi * 57.75
    assert log_a > 0
    assert log_a == pytest.approx(2.0906741152138718167, rel=1e-10)


def test_rdp_increases_with_q_and_order_and_falls_with_sigma() -> None:
    orders = DEFAULT_ORDERS
    for sigma in (0.5, 1.0, 5.0):
        lo, hi = sgm_rdp(0.01, sigma, orders), sgm_rdp(0.02, sigma, orders)
        assert np.all(hi > lo)
        assert np.all(np.diff(lo) > 0)  # Rényi divergence grows with the order
    assert np.all(sgm_rdp(0.05, 1.0, orders) > sgm_rdp(0.05, 1.1, orders))


def test_huge_orders_and_rdp_are_finite() -> None:
    # log(binom) overflow near alpha ~ 1000 must not happen (docs/accounting.md#integer-orders)
    rdp = sgm_rdp(0.0256, 1.0, EXTENDED_ORDERS)
    assert np.all(np.isfinite(rdp)) and np.all(rdp > 0)
    # at q close to 1 and large alpha, RDP approaches the Gaussian's alpha / (2 sigma^2)
    big = sgm_rdp(0.999, 0.5, [1024.0, 1000.5])
    assert np.all(np.isfinite(big))
    np.testing.assert_array_less(big, np.array([1024.0, 1000.5]) / (2 * 0.25))
    assert big[0] > 0.99 * 1024.0 / 0.5


def test_accepts_lists_scalars_and_arrays() -> None:
    a = sgm_rdp(0.1, 1.0, [2.5, 3.0])
    b = sgm_rdp(0.1, 1.0, np.array([2.5, 3.0]))
    np.testing.assert_array_equal(a, b)
    assert sgm_rdp(0.1, 1.0, 2.5).shape == (1,)
    assert float(sgm_rdp(0.1, 1.0, 2.5)[0]) == a[0]


@pytest.mark.parametrize(
    ("q", "sigma", "orders", "needle"),
    [
        (-0.1, 1.0, [2.0], "q=-0.1"),
        (1.5, 1.0, [2.0], "q=1.5"),
        (float("nan"), 1.0, [2.0], "q=nan"),
        (0.1, -1.0, [2.0], "sigma=-1.0"),
        (0.1, float("inf"), [2.0], "sigma=inf"),
        (0.1, 1.0, [1.0], "orders"),
        (0.1, 1.0, [0.5, 2.0], "orders"),
        (0.1, 1.0, [], "orders"),
        (0.1, 1.0, [float("inf")], "orders"),
    ],
)
def test_sgm_rdp_rejects_bad_arguments(q, sigma, orders, needle) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        sgm_rdp(q, sigma, orders)


def test_rdp_to_epsilon_is_balle_theorem_21() -> None:
    orders = np.array([1.5, 2.0, 8.0, 32.0])
    rdp = np.array([0.3, 0.5, 2.0, 9.0])
    delta = 1e-5
    per_order = [
        r + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
        for a, r in zip(orders, rdp, strict=True)
    ]
    eps, order = rdp_to_epsilon(rdp, orders, delta)
    assert eps == pytest.approx(min(per_order), rel=1e-14)
    assert order == orders[int(np.argmin(per_order))] == 8.0


def test_rdp_to_epsilon_clamps_at_zero() -> None:
    eps, _ = rdp_to_epsilon(np.zeros(3), [2.0, 10.0, 1000.0], 0.5)
    assert eps == 0.0  # the formula itself is negative here
    per_order_10 = math.log(0.9) - (math.log(0.5) + math.log(10)) / 9
    assert per_order_10 < 0


def test_rdp_to_epsilon_of_gaussian_matches_known_value() -> None:
    # Gaussian mechanism sigma = 1, 1 step: rdp = alpha / 2; on a fine grid the optimum of
    # alpha/2 + log(1-1/alpha) - (log delta + log alpha)/(alpha - 1) at delta 1e-5.
    orders = np.linspace(1.01, 60, 200_000)
    eps, order = rdp_to_epsilon(orders / 2, orders, 1e-5)
    # independent evaluation by a scalar minimiser
    from scipy.optimize import minimize_scalar

    def f(a: float) -> float:
        return a / 2 + math.log1p(-1 / a) - (math.log(1e-5) + math.log(a)) / (a - 1)

    res = minimize_scalar(f, bounds=(1.01, 60), method="bounded", options={"xatol": 1e-10})
    assert eps == pytest.approx(res.fun, abs=1e-8)
    assert order == pytest.approx(res.x, abs=1e-3)
