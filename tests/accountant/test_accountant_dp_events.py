"""Theorem 5.8 schedules exported as dp-accounting events (fedlap_privacy.accountant.dp_events).

* dp-accounting's RdpAccountant on the exported event: at integer orders (where its RDP of the
  sampled Gaussian is an exact finite sum) the RDP of every order equals ours to 1e-9 and the
  epsilon to 1e-6 relative. On our default grid it agrees to 1e-6 whenever its optimal order
  is an integer; at fractional orders it sums absolute values of the series (an upper bound),
  so its epsilon is never below ours — on the paper's reference configuration it is 1e-4
  above, and Opacus' series (sound at sigma = 1) sides with ours at those orders.
* dp-accounting's PLDAccountant on the event equals our PLD accountant to 0.2% (ours runs on
  an adaptive grid, docs/accounting.md#pld-accounting; tests/accountant/test_accountant_pld.py
  holds it to dp-accounting over a grid of cases).
* Rounds with different schedules (per-round T, client fraction): the same, against
  ``composed_epsilon``.
"""

from __future__ import annotations

import logging

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from fedlap_privacy.accountant import (
    DEFAULT_ORDERS,
    FedLAPSchedule,
    composed_epsilon,
    epsilon,
    rdp_epsilon,
)
from fedlap_privacy.accountant.dp_events import composed_event, schedule_event, step_counts
from fedlap_privacy.errors import ConfigError

DELTA = 1e-5
RTOL = 1e-6
PLD_RTOL = 2e-3
INTEGER_ORDERS = np.arange(2.0, 129.0)

logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's convergence warnings

REFERENCE = FedLAPSchedule(batch_size=256, client_size=10000, local_steps=200)
CASES = {
    # the paper's reference configuration: q1 = q2, the optimal order is fractional (3.2)
    "reference": (REFERENCE, 1.0, 15),
    # client sampling: q1 = q2 / 10; the optimal order is fractional
    "client-sampling": (
        FedLAPSchedule(batch_size=64, client_size=5000, local_steps=50, client_fraction=0.1),
        1.5,
        40,
    ),
    "small-client": (
        FedLAPSchedule(batch_size=32, client_size=600, local_steps=20, client_fraction=0.3),
        0.8,
        30,
    ),
    "large-sigma": (REFERENCE, 5.0, 15),  # optimal order 16
}
HETEROGENEOUS = (
    [FedLAPSchedule(batch_size=64, client_size=5000, local_steps=20, client_fraction=0.2)] * 6
    + [FedLAPSchedule(batch_size=64, client_size=5000, local_steps=35, client_fraction=0.2)] * 4
    + [FedLAPSchedule(batch_size=64, client_size=5000, local_steps=1)] * 3
    + [FedLAPSchedule(batch_size=64, client_size=5000, local_steps=35, client_fraction=0.2)] * 2
)
HETERO_SIGMA = 1.2


def _rdp_accountant(event: dpa.DpEvent, orders: np.ndarray) -> RdpAccountant:
    acc = RdpAccountant(orders=list(orders))
    acc.compose(event)
    return acc


def test_event_structure() -> None:
    event = schedule_event(REFERENCE, 1.0, 15)
    gaussian = dpa.GaussianDpEvent(1.0)
    assert event == dpa.ComposedDpEvent(
        [dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.0256, gaussian), 15 * 200)]
    )
    schedule, sigma, rounds = CASES["client-sampling"]
    assert schedule_event(schedule, sigma, rounds).events == [
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(1.5)), n)
        for q, n in ((schedule.q1, 40), (schedule.q2, 40 * 49))
    ]
    # M equal rounds as a list: the same event
    assert composed_event([schedule] * rounds, sigma) == schedule_event(schedule, sigma, rounds)
    # heterogeneous: q1 = 0.00256 from 12 rounds, q2 = 0.0128 from 6*19 + 6*34 + 3 steps
    assert step_counts((s, 1) for s in HETEROGENEOUS) == {0.00256: 12, 0.0128: 6 * 19 + 6 * 34 + 3}


@pytest.mark.parametrize("case", CASES)
def test_rdp_accountant_equals_ours_at_integer_orders(case: str) -> None:
    schedule, sigma, rounds = CASES[case]
    acc = _rdp_accountant(schedule_event(schedule, sigma, rounds), INTEGER_ORDERS)
    ours_rdp = rounds * schedule.rdp_per_round(sigma, INTEGER_ORDERS)
    np.testing.assert_allclose(acc.rdp, ours_rdp, rtol=1e-9)
    ours = epsilon(schedule, sigma, rounds, DELTA, orders=INTEGER_ORDERS)
    assert float(acc.get_epsilon(DELTA)) == pytest.approx(ours, rel=RTOL)


@pytest.mark.parametrize("case", CASES)
def test_rdp_accountant_on_our_default_grid(case: str) -> None:
    schedule, sigma, rounds = CASES[case]
    acc = _rdp_accountant(schedule_event(schedule, sigma, rounds), DEFAULT_ORDERS)
    ours_rdp = rounds * schedule.rdp_per_round(sigma, DEFAULT_ORDERS)
    integer = DEFAULT_ORDERS == np.round(DEFAULT_ORDERS)
    np.testing.assert_allclose(acc.rdp[integer], ours_rdp[integer], rtol=1e-9)
    assert np.all(acc.rdp[~integer] >= ours_rdp[~integer] * (1 - 1e-12))  # its upper bound
    theirs, their_order = acc.get_epsilon_and_optimal_order(DELTA)
    ours, our_order = rdp_epsilon(schedule, sigma, rounds, DELTA)
    assert ours == epsilon(schedule, sigma, rounds, DELTA)
    assert ours <= float(theirs) * (1 + 1e-12)
    if float(their_order).is_integer():
        assert float(theirs) == pytest.approx(ours, rel=RTOL)
        assert our_order == their_order
    else:
        assert float(theirs) < ours * 1.01  # the bound is loose by well under 1%


def test_reference_gap_is_dp_accountings_fractional_bound() -> None:
    """On the paper's configuration dp-accounting reports 10.18401 and we 10.18299 (order
    3.2 vs 3.1): at fractional orders Opacus' signed series, sound at sigma = 1, agrees with
    ours to 1e-6 while dp-accounting's absolute-value series is above both — by 19% at order
    1.1, 5e-4 around the optimum, fading to round-off by order 10.9."""
    from opacus.accountants.analysis.rdp import compute_rdp

    schedule, sigma, rounds = CASES["reference"]
    fractional = DEFAULT_ORDERS[DEFAULT_ORDERS != np.round(DEFAULT_ORDERS)]
    acc = _rdp_accountant(schedule_event(schedule, sigma, rounds), fractional)
    ours = rounds * schedule.rdp_per_round(sigma, fractional)
    steps = rounds * schedule.local_steps
    opacus = compute_rdp(q=schedule.q2, noise_multiplier=sigma, steps=steps, orders=fractional)
    np.testing.assert_allclose(ours, opacus, rtol=RTOL)
    assert np.all(acc.rdp >= ours * (1 - 1e-12))
    low = fractional < 6
    assert np.all(acc.rdp[low] > ours[low] * (1 + 1e-5))
    eps_theirs = float(
        _rdp_accountant(schedule_event(schedule, sigma, rounds), DEFAULT_ORDERS).get_epsilon(DELTA)
    )
    eps_ours = epsilon(schedule, sigma, rounds, DELTA)
    assert round(eps_ours, 5) == 10.18299 and round(eps_theirs, 5) == 10.18401


@pytest.mark.parametrize("case", ["reference", "client-sampling", "large-sigma"])
def test_pld_accountant_equals_our_pld(case: str) -> None:
    schedule, sigma, rounds = CASES[case]
    acc = PLDAccountant()
    acc.compose(schedule_event(schedule, sigma, rounds))
    ours = epsilon(schedule, sigma, rounds, DELTA, accountant="pld")
    assert float(acc.get_epsilon(DELTA)) == pytest.approx(ours, rel=PLD_RTOL)


def test_heterogeneous_rounds() -> None:
    event = composed_event(HETEROGENEOUS, HETERO_SIGMA)
    for orders in (INTEGER_ORDERS, DEFAULT_ORDERS):
        theirs = float(_rdp_accountant(event, orders).get_epsilon(DELTA))
        ours = composed_epsilon(HETEROGENEOUS, HETERO_SIGMA, DELTA, orders=orders)
        assert ours <= theirs * (1 + 1e-12)
        if orders is INTEGER_ORDERS:
            assert theirs == pytest.approx(ours, rel=RTOL)
    pld = PLDAccountant()
    pld.compose(event)
    ours_pld = composed_epsilon(HETEROGENEOUS, HETERO_SIGMA, DELTA, accountant="pld")
    assert float(pld.get_epsilon(DELTA)) == pytest.approx(ours_pld, rel=PLD_RTOL)


def test_empty_and_invalid() -> None:
    empty = composed_event([], 1.0)
    assert empty == dpa.ComposedDpEvent([])
    assert float(_rdp_accountant(empty, DEFAULT_ORDERS).get_epsilon(DELTA)) == 0.0
    with pytest.raises(ConfigError, match="sigma"):
        schedule_event(REFERENCE, 0.0, 3)
    with pytest.raises(ConfigError, match="rounds"):
        schedule_event(REFERENCE, 1.0, 0)
