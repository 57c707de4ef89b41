"""The accountant against independent oracles (docs/accounting.md).

* mpmath (30-40 digits): Mironov, Talwar, Zhang 2019 Eq. 4 by adaptive quadrature for any
  order, and the exact binomial sum for integer orders; the two are cross-checked here too.
* Opacus's RDP accountant: equal to 1e-6 relative wherever Opacus's own series is sound.
  Opacus sums the signed fractional series until terms drop below e^-30 ABSOLUTE, which
  under-reports for large sigma; such points are found by asking mpmath who is
  right, and are counted and skipped explicitly.
* dp-accounting's RDP accountant (sums the absolute values of the fractional series: an upper
  bound): ours is never above it and within 2% in epsilon.
* dp-accounting's PLD accountant: our PLD adapter agrees to 1% and is never above RDP.
"""

from __future__ import annotations

import itertools
import logging
import math
from functools import cache

import dp_accounting as dpa
import mpmath as mp
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp

from fedlap_privacy.accountant import (
    DEFAULT_ORDERS,
    FedLAPSchedule,
    epsilon,
    rdp_epsilon,
    sgm_rdp,
)
from fedlap_privacy.errors import ConfigError

DELTA = 1e-5
#: ours vs mpmath. The acceptance threshold is 1e-6; the implementation is exact to ~1e-13
#: (float64 round-off), so hold it to 1e-9 relative, with no absolute slack even for RDP
#: values ~1e-12.
RTOL_MPMATH = 1e-9
#: ours vs Opacus (acceptance: 1e-6 relative) ...
RTOL_OPACUS = 1e-6
#: ... plus an absolute slack per sampled Gaussian STEP for tiny RDP values: Opacus sums
#: log A = log(sum of terms ~1), so log A carries an absolute round-off of a few ulp(1)
#: (~1e-15 per term, up to ~64 terms) divided by alpha - 1 >= 0.1: ~1e-13 of RDP.
ATOL_OPACUS_PER_STEP = 1e-13

logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's convergence warnings


# --------------------------------------------------------------------------- mpmath oracles


def _mp_a_minus_1_quad(q: float, sigma: float, alpha: float, dps: int = 30) -> mp.mpf:
    """A_alpha - 1 = E_{z~N(0,s^2)}[(1+u)^a - 1 - a u], u = q (exp((2z-1)/(2 s^2)) - 1).

    Mironov et al. 2019 Eq. 4 with E[u] = 0 subtracted, so the integrand is >= 0 and A - 1 keeps
    full relative precision. Breakpoints at 0, z0 = s^2 log(1/q - 1) + 1/2 (where the two terms
    of (1-q) + q L are equal) and alpha (the peak of phi(z) L^alpha); the integrand is below
    e^-190 relative outside [-20 s, alpha + 20 s].
    """
    with mp.workdps(dps):
        q_, s, a = mp.mpf(q), mp.mpf(sigma), mp.mpf(alpha)
        two_s2 = 2 * s**2
        norm = 1 / (s * mp.sqrt(2 * mp.pi))

        def integrand(z):
            u = q_ * mp.expm1((2 * z - 1) / two_s2)
            return norm * mp.exp(-z * z / two_s2) * ((1 + u) ** a - 1 - a * u)

        z0 = s**2 * mp.log(1 / q_ - 1) + mp.mpf(1) / 2
        lo, hi = -20 * s, a + 20 * s
        inner = sorted(p for p in {mp.mpf(0), z0, a} if lo < p < hi)
        return mp.quad(integrand, [lo, *inner, hi])


def _mp_a_minus_1_binomial(q: float, sigma: float, alpha: int, dps: int = 40) -> mp.mpf:
    """A_alpha - 1 = sum_{k=2..alpha} C(a,k) (1-q)^(a-k) q^k (exp((k^2-k)/(2 s^2)) - 1)."""
    with mp.workdps(dps):
        q_, s = mp.mpf(q), mp.mpf(sigma)
        return mp.fsum(
            mp.binomial(alpha, k)
            * (1 - q_) ** (alpha - k)
            * q_**k
            * mp.expm1(mp.mpf(k * k - k) / (2 * s**2))
            for k in range(2, alpha + 1)
        )


@cache
def mp_rdp(q: float, sigma: float, alpha: float) -> float:
    """RDP of one SGM step, log(A)/(alpha - 1), from mpmath (exact sum for integer orders)."""
    if float(alpha).is_integer():
        am1 = _mp_a_minus_1_binomial(q, sigma, int(alpha))
    else:
        am1 = _mp_a_minus_1_quad(q, sigma, alpha)
    with mp.workdps(40):
        return float(mp.log1p(am1) / (mp.mpf(alpha) - 1))


GRID_Q = (1e-4, 0.01, 0.0256, 0.1, 0.4, 0.9)
GRID_SIGMA = (0.5, 1.0, 3.0, 12.0, 20.0)
GRID_ORDERS = (1.1, 1.5, 2.0, 3.3, 10.9, 32.0, 58.75, 63.0)


@pytest.mark.parametrize(
    ("q", "sigma", "alpha"),
    [(1e-4, 20.0, 2), (0.0256, 1.0, 32), (0.4, 12.0, 63), (0.9, 0.5, 3)],
)
def test_mpmath_quadrature_oracle_agrees_with_exact_binomial_sum(q, sigma, alpha) -> None:
    """The two oracles are independent; at integer orders they must coincide to ~30 digits."""
    quad = _mp_a_minus_1_quad(q, sigma, float(alpha))
    exact = _mp_a_minus_1_binomial(q, sigma, alpha)
    assert abs(float(quad / exact) - 1) < 1e-25


def _grid_points(default_run: bool) -> list[tuple[float, float, float]]:
    """Integer orders (exact sums, cheap) always; the fractional orders (quadrature, ~0.1 s
    each) on a diagonal pattern: a third in the default run, so that every q, sigma and order
    is still covered, and the other two thirds with ``-m slow``."""
    points = []
    for (i, q), (j, sigma), (k, alpha) in itertools.product(
        enumerate(GRID_Q), enumerate(GRID_SIGMA), enumerate(GRID_ORDERS)
    ):
        fractional = not float(alpha).is_integer()
        in_default = not fractional or (i + j + k) % 3 == 0
        if in_default == default_run:
            points.append((q, sigma, alpha))
    return points


def _check_against_mpmath(points: list[tuple[float, float, float]]) -> float:
    bad, worst = [], 0.0
    for q, sigma, alpha in points:
        ours = float(sgm_rdp(q, sigma, [alpha])[0])
        ref = mp_rdp(q, sigma, alpha)
        rel = abs(ours / ref - 1)
        worst = max(worst, rel)
        if not rel <= RTOL_MPMATH:
            bad.append((q, sigma, alpha, ours, ref))
    assert not bad, f"ours vs mpmath beyond {RTOL_MPMATH} (q, sigma, alpha, ours, mpmath): {bad}"
    return worst


def test_rdp_matches_mpmath_on_grid() -> None:
    """Acceptance 2: q x sigma x orders grid, fractional and integer orders (default part)."""
    points = _grid_points(default_run=True)
    for axis, values in enumerate((GRID_Q, GRID_SIGMA, GRID_ORDERS)):
        fractional = [p for p in points if not float(p[2]).is_integer()]
        assert {p[axis] for p in fractional} >= set(values) - {2.0, 32.0, 63.0}
    assert _check_against_mpmath(points) <= RTOL_MPMATH


@pytest.mark.slow
def test_rdp_matches_mpmath_on_grid_rest() -> None:
    assert _check_against_mpmath(_grid_points(default_run=False)) <= RTOL_MPMATH


def test_known_defect_point_log_a_positive_and_exact() -> None:
    """q=0.4, sigma=12, alpha=58.75: log A > 0 (an absolute cut-off gives log A ~ -30)."""
    with mp.workdps(40):
        ref = mp.log1p(_mp_a_minus_1_quad(0.4, 12.0, 58.75, dps=40))
    assert ref > 0
    ours = float(sgm_rdp(0.4, 12.0, [58.75])[0]) * 57.75
    assert ours > 0
    assert ours == pytest.approx(float(ref), rel=RTOL_MPMATH)


def test_special_cases_match_the_limits() -> None:
    orders = np.array(GRID_ORDERS)
    assert np.all(sgm_rdp(0.0, 1.0, orders) == 0.0)
    np.testing.assert_allclose(sgm_rdp(1.0, 3.0, orders), orders / 18.0, rtol=1e-15)
    assert np.all(np.isinf(sgm_rdp(0.3, 0.0, orders)))
    # continuity towards q -> 1: the mpmath value at q = 1 - 1e-9 is within 1e-6 of alpha/2s^2
    for a in (2.0, 10.9):
        assert mp_rdp(1 - 1e-9, 3.0, a) == pytest.approx(a / 18.0, rel=1e-6)


@pytest.mark.parametrize("sigma", [1e-3, 3e-3, 0.0099])
def test_tiny_sigma_matches_mpmath(sigma: float) -> None:
    """Below sigma 0.01 the fractional orders take the two-bump grid (a uniform grid would
    need ~alpha / sigma^2 points: minutes and gigabytes at sigma 0.001)."""
    points = [(q, sigma, a) for q in (1e-4, 0.04, 0.9) for a in (1.1, 2.5, 10.9)]
    assert _check_against_mpmath(points) <= RTOL_MPMATH


def test_two_bump_grid_equals_the_uniform_grid_where_both_run() -> None:
    """At sigma 0.0099, just below the switch, the uniform grid is still affordable."""
    from fedlap_privacy.accountant import rdp

    orders = np.array([1.1, 2.5, 10.9])
    two_bump = rdp._log_a_minus_1_fractional(0.04, 0.0099, orders)
    try:
        rdp._NARROW_SIGMA = 0.001
        uniform = rdp._log_a_minus_1_fractional(0.04, 0.0099, orders)
    finally:
        rdp._NARROW_SIGMA = 0.01
    np.testing.assert_allclose(two_bump, uniform, rtol=1e-13)


# --------------------------------------------------------------------------- Opacus

OPACUS_Q = (1e-4, 1e-3, 0.01, 0.0256, 0.1, 0.4, 0.9, 1.0)
OPACUS_SIGMA = (0.5, 0.8, 1.0, 2.0, 5.0, 12.0, 20.0)
#: the paper's grid plus three large fractional orders, where Opacus's cut-off can bite
OPACUS_ORDERS = np.concatenate([DEFAULT_ORDERS, [15.5, 32.25, 58.75]])


def _close(a, b, steps: float = 1.0) -> np.ndarray:
    return np.isclose(a, b, rtol=RTOL_OPACUS, atol=ATOL_OPACUS_PER_STEP * steps)


@cache
def opacus_vs_ours(q: float, sigma: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ours, opacus, sound) per order of OPACUS_ORDERS for one SGM step.

    Where ours and Opacus differ beyond tolerance, mpmath decides: the point is Opacus-
    unsound if Opacus is off the mpmath value; if instead ours is off, that is a failure.
    """
    ours = sgm_rdp(q, sigma, OPACUS_ORDERS)
    theirs = np.asarray(
        compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(OPACUS_ORDERS))
    )
    sound = np.ones(OPACUS_ORDERS.size, dtype=bool)
    for i in np.flatnonzero(~_close(ours, theirs)):
        ref = mp_rdp(q, sigma, float(OPACUS_ORDERS[i]))
        assert ours[i] == pytest.approx(ref, rel=RTOL_MPMATH), (
            f"ours differs from Opacus AND from mpmath at q={q} sigma={sigma} "
            f"alpha={OPACUS_ORDERS[i]}: ours {ours[i]!r} opacus {theirs[i]!r} mpmath {ref!r}"
        )
        assert not _close(theirs[i], ref), "Opacus agrees with mpmath but not with us"
        sound[i] = False
    return ours, theirs, sound


def test_rdp_equals_opacus_where_opacus_is_sound() -> None:
    """Acceptance 3, per order: 8 q x 7 sigma x 154 orders; unsound points counted."""
    total = unsound = 0
    for q, sigma in itertools.product(OPACUS_Q, OPACUS_SIGMA):
        ours, theirs, sound = opacus_vs_ours(q, sigma)
        assert np.all(_close(ours[sound], theirs[sound]))
        total += sound.size
        unsound += int((~sound).sum())
    # the known defect: Opacus reports log A ~ -30 at q=0.4, sigma=12, alpha=58.75
    j = int(np.flatnonzero(OPACUS_ORDERS == 58.75)[0])
    assert not opacus_vs_ours(0.4, 12.0)[2][j]
    assert opacus_vs_ours(0.4, 12.0)[1][j] < 0 < opacus_vs_ours(0.4, 12.0)[0][j]
    assert 1 <= unsound <= total // 20, f"{unsound} of {total} points Opacus-unsound"


SCHEDULES = [  # (schedule, sigma, rounds): client fraction < 1 included
    (FedLAPSchedule(batch_size=256, client_size=10000, local_steps=200), 1.0, 15),
    (FedLAPSchedule(batch_size=256, client_size=10000, local_steps=200), 1.0, 27),
    (FedLAPSchedule(batch_size=64, client_size=600, local_steps=50, client_fraction=0.2), 1.5, 30),
    (
        FedLAPSchedule(batch_size=32, client_size=50000, local_steps=1000, client_fraction=0.5),
        2.0,
        100,
    ),
    (FedLAPSchedule(batch_size=10, client_size=100, local_steps=5, client_fraction=0.1), 5.0, 10),
    (FedLAPSchedule(batch_size=40, client_size=100, local_steps=3, client_fraction=0.5), 12.0, 50),
    (FedLAPSchedule(batch_size=1, client_size=10000, local_steps=1), 0.5, 1000),
    (FedLAPSchedule(batch_size=900, client_size=1000, local_steps=4, client_fraction=0.3), 3.0, 7),
]


@pytest.mark.parametrize(("schedule", "sigma", "rounds"), SCHEDULES)
def test_schedule_equals_opacus_two_entry_history(schedule, sigma, rounds) -> None:
    """Acceptance 3: RDP per order and epsilon vs Opacus's RDPAccountant."""
    steps_2 = rounds * (schedule.local_steps - 1)
    history = [(sigma, schedule.q1, rounds)] + ([(sigma, schedule.q2, steps_2)] if steps_2 else [])
    orders = list(DEFAULT_ORDERS)
    theirs = sum(
        np.asarray(compute_rdp(q=q, noise_multiplier=s, steps=n, orders=orders))
        for s, q, n in history
    )
    ours = rounds * schedule.rdp_per_round(sigma, DEFAULT_ORDERS)
    # orders where Opacus is unsound for either rate (decided by mpmath) are skipped explicitly
    n_default = DEFAULT_ORDERS.size
    sound_1 = opacus_vs_ours(schedule.q1, sigma)[2][:n_default]
    sound = sound_1 & opacus_vs_ours(schedule.q2, sigma)[2][:n_default]
    assert sound.sum() >= n_default - 5
    np.testing.assert_allclose(
        ours[sound], theirs[sound], rtol=RTOL_OPACUS, atol=ATOL_OPACUS_PER_STEP * (rounds + steps_2)
    )
    accountant = RDPAccountant()
    accountant.history = list(history)
    eps_opacus = accountant.get_epsilon(delta=DELTA)
    eps_ours, order = rdp_epsilon(schedule, sigma, rounds, DELTA)
    assert sound[np.flatnonzero(DEFAULT_ORDERS == order)[0]], "optimal order Opacus-unsound"
    assert eps_ours == pytest.approx(eps_opacus, rel=RTOL_OPACUS)


# --------------------------------------------------------------------------- dp-accounting


def fedlap_event(schedule: FedLAPSchedule, sigma: float, rounds: int) -> dpa.DpEvent:
    """Theorem 5.8 as a DpEvent: (SGM(q1) o SGM(q2)^(T-1))^M."""
    gaussian = dpa.GaussianDpEvent(sigma)
    parts: list[dpa.DpEvent] = [dpa.PoissonSampledDpEvent(schedule.q1, gaussian)]
    if schedule.local_steps > 1:
        parts.append(
            dpa.SelfComposedDpEvent(
                dpa.PoissonSampledDpEvent(schedule.q2, gaussian), schedule.local_steps - 1
            )
        )
    return dpa.SelfComposedDpEvent(dpa.ComposedDpEvent(parts), rounds)


@pytest.mark.parametrize(("schedule", "sigma", "rounds"), SCHEDULES)
def test_never_above_dp_accounting_rdp_and_within_two_percent(schedule, sigma, rounds) -> None:
    accountant = RdpAccountant(list(DEFAULT_ORDERS))
    accountant.compose(fedlap_event(schedule, sigma, rounds))
    ours_rdp = rounds * schedule.rdp_per_round(sigma, DEFAULT_ORDERS)
    their_rdp = np.asarray(accountant._rdp)  # per order; inf where their series gave up
    steps = rounds * schedule.local_steps  # their float round-off, as for Opacus above
    assert np.all(ours_rdp <= their_rdp * (1 + 1e-9) + ATOL_OPACUS_PER_STEP * steps)
    eps_ours, _ = rdp_epsilon(schedule, sigma, rounds, DELTA)
    eps_theirs = accountant.get_epsilon(DELTA)
    assert eps_ours <= eps_theirs * (1 + 1e-9)
    assert eps_ours >= 0.98 * eps_theirs


def test_dp_accounting_gives_up_where_we_do_not() -> None:
    """dp-accounting's fractional series fails to converge (-> inf, order dropped) at q~0.1,
    sigma 0.8, small orders; its epsilon is then 10% high. Ours stays exact (mpmath)."""
    schedule = FedLAPSchedule(batch_size=64, client_size=600, local_steps=50, client_fraction=0.2)
    accountant = RdpAccountant(list(DEFAULT_ORDERS))
    accountant.compose(fedlap_event(schedule, 0.8, 30))
    assert np.isinf(np.asarray(accountant._rdp)).any()
    ours = epsilon(schedule, 0.8, 30, DELTA)
    assert ours < accountant.get_epsilon(DELTA)
    assert float(sgm_rdp(schedule.q2, 0.8, [1.1])[0]) == pytest.approx(
        mp_rdp(schedule.q2, 0.8, 1.1), rel=RTOL_MPMATH
    )


PLD_CASES = [
    (FedLAPSchedule(batch_size=256, client_size=10000, local_steps=200), 1.0, 15),
    (FedLAPSchedule(batch_size=10, client_size=100, local_steps=5, client_fraction=0.1), 5.0, 10),
    (FedLAPSchedule(batch_size=16, client_size=500, local_steps=4, client_fraction=0.5), 3.0, 6),
]


@cache
def pld_epsilon(schedule: FedLAPSchedule, sigma: float, rounds: int) -> float:
    return epsilon(schedule, sigma, rounds, DELTA, accountant="pld")


@pytest.mark.parametrize(("schedule", "sigma", "rounds"), PLD_CASES)
def test_pld_matches_dp_accounting_pld_and_is_below_rdp(schedule, sigma, rounds) -> None:
    ours = pld_epsilon(schedule, sigma, rounds)
    accountant = PLDAccountant()
    accountant.compose(fedlap_event(schedule, sigma, rounds))
    theirs = accountant.get_epsilon(DELTA)
    assert ours == pytest.approx(theirs, rel=0.01)
    assert ours <= epsilon(schedule, sigma, rounds, DELTA)


def test_pld_refuses_a_sigma_it_cannot_discretise() -> None:
    """dp-accounting would try to allocate ~40 GB at sigma 0.001; RDP answers in milliseconds."""
    schedule = FedLAPSchedule(batch_size=64, client_size=1600, local_steps=10)
    with pytest.raises(ConfigError, match=r"cannot discretise sigma 0\.001"):
        pld_epsilon(schedule, 0.001, 1)
    assert math.isfinite(epsilon(schedule, 0.001, 1, DELTA))


def test_pld_is_about_eight_percent_tighter_on_the_reference() -> None:
    """PLD about 8% below RDP on the reference configuration (15 rounds)."""
    schedule = FedLAPSchedule(batch_size=256, client_size=10000, local_steps=200)
    pld = pld_epsilon(schedule, 1.0, 15)
    rdp = epsilon(schedule, 1.0, 15, DELTA)
    assert 0.90 < pld / rdp < 0.95
    assert math.isfinite(pld)
