"""FedLAP-DP's two-rate composition, epsilon and planning (docs/accounting.md#theorem-58).

Paper numbers, monotonicity and round-trip properties (hypothesis), and input validation.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fedlap_privacy.accountant import (
    DEFAULT_ORDERS,
    EXTENDED_ORDERS,
    FedLAPSchedule,
    epsilon,
    epsilon_curve,
    plan_rounds,
    plan_sigma,
    rdp_epsilon,
    sgm_rdp,
)
from fedlap_privacy.accountant.planning import (
    MAX_PLD_CURVE_ROUNDS,
    SIGMA_RANGE,
    curve_rounds_limit,
)
from fedlap_privacy.accountant.report import privacy_plan
from fedlap_privacy.errors import ConfigError

DELTA = 1e-5
REFERENCE = FedLAPSchedule(batch_size=256, client_size=10000, local_steps=200)
FAST = settings(max_examples=30, deadline=None, derandomize=True)

# ----------------------------------------------------------------- acceptance 1: the paper


def test_reference_schedule_rates() -> None:
    assert REFERENCE.q1 == REFERENCE.q2 == 0.0256
    assert REFERENCE.client_fraction == 1.0


def test_reproduces_the_paper() -> None:
    """The paper's numbers: 2.79 after round 1 and 10.18 after round 15 (sigma 1, delta 1e-5)."""
    assert round(epsilon(REFERENCE, 1.0, 1, DELTA), 2) == 2.79
    assert round(epsilon(REFERENCE, 1.0, 15, DELTA), 2) == 10.18


def test_reference_unrounded_values() -> None:
    """10.1830 after 15 rounds and 14.306 after 27 (signed series, exact;
    docs/accounting.md#fractional-orders)."""
    assert epsilon(REFERENCE, 1.0, 15, DELTA) == pytest.approx(10.1830, abs=5e-5)
    assert epsilon(REFERENCE, 1.0, 27, DELTA) == pytest.approx(14.306, abs=5e-4)
    # the absolute-value bound of the series would give 14.336: we are clearly below it
    assert epsilon(REFERENCE, 1.0, 27, DELTA) < 14.32


def test_reference_curve() -> None:
    curve = epsilon_curve(REFERENCE, 1.0, 27, DELTA)
    assert curve.shape == (27,)
    assert [round(float(c), 2) for c in curve[[0, 14]]] == [2.79, 10.18]
    assert curve[26] == pytest.approx(14.306, abs=5e-4)
    assert np.all(np.diff(curve) > 0)


def test_reference_plan_rounds() -> None:
    assert plan_rounds(REFERENCE, 1.0, 10.19, DELTA) == 15
    assert plan_rounds(REFERENCE, 1.0, 10.18, DELTA) == 14


def test_reference_plan_sigma_inverts_the_paper() -> None:
    sigma = plan_sigma(REFERENCE, 15, 10.19, DELTA)
    assert sigma <= 1.0  # sigma = 1 already meets 10.19 in 15 rounds
    assert sigma == pytest.approx(1.0, rel=2e-3)
    assert epsilon(REFERENCE, sigma, 15, DELTA) <= 10.19


def test_reference_optimal_order_and_rdp_epsilon() -> None:
    eps, order = rdp_epsilon(REFERENCE, 1.0, 15, DELTA)
    assert eps == epsilon(REFERENCE, 1.0, 15, DELTA)
    assert order in DEFAULT_ORDERS
    assert 2.0 < order < 6.0


def test_epsilon_is_theorem_5_8_by_hand() -> None:
    """eps(M) = min_a M xi(a|q1) + M (T-1) xi(a|q2) + log((a-1)/a) - (log d + log a)/(a-1)."""
    s = FedLAPSchedule(batch_size=64, client_size=2000, local_steps=30, client_fraction=0.4)
    assert s.q1 == pytest.approx(0.4 * 64 / 2000) and s.q2 == pytest.approx(64 / 2000)
    m, sigma, delta = 12, 1.3, 1e-6
    a = DEFAULT_ORDERS
    rho = m * sgm_rdp(s.q1, sigma, a) + m * 29 * sgm_rdp(s.q2, sigma, a)
    by_hand = np.min(rho + np.log((a - 1) / a) - (math.log(delta) + np.log(a)) / (a - 1))
    assert epsilon(s, sigma, m, delta) == pytest.approx(float(by_hand), rel=1e-13)


def test_client_fraction_one_equals_a_single_rate() -> None:
    s = FedLAPSchedule(batch_size=100, client_size=5000, local_steps=10)
    rho = 7 * 10 * sgm_rdp(100 / 5000, 2.0, DEFAULT_ORDERS)
    a = DEFAULT_ORDERS
    by_hand = np.min(rho + np.log1p(-1 / a) - (math.log(DELTA) + np.log(a)) / (a - 1))
    assert epsilon(s, 2.0, 7, DELTA) == pytest.approx(float(by_hand), rel=1e-13)


def test_extended_orders_never_worse() -> None:
    for rounds in (1, 15, 100):
        assert epsilon(REFERENCE, 1.0, rounds, DELTA, orders=EXTENDED_ORDERS) <= epsilon(
            REFERENCE, 1.0, rounds, DELTA
        )


# ----------------------------------------------------------------- acceptance 4: properties

batch_sizes = st.integers(min_value=1, max_value=512)
client_sizes = st.integers(min_value=512, max_value=100_000)
local_steps = st.integers(min_value=1, max_value=400)
fractions = st.floats(min_value=0.01, max_value=1.0)
sigmas = st.floats(min_value=0.5, max_value=20.0)
deltas = st.floats(min_value=1e-10, max_value=1e-2)  # large delta: epsilon may clamp to 0
rounds_st = st.integers(min_value=1, max_value=300)


def assert_below(lo: float, hi: float) -> None:
    """lo < hi, unless both are clamped at epsilon 0 (large delta, tiny rate)."""
    assert lo <= hi
    if hi > 0:
        assert lo < hi


@st.composite
def schedules(draw) -> FedLAPSchedule:
    return FedLAPSchedule(
        batch_size=draw(batch_sizes),
        client_size=draw(client_sizes),
        local_steps=draw(local_steps),
        client_fraction=draw(fractions),
    )


@FAST
@given(schedules(), sigmas, deltas, rounds_st, st.integers(min_value=1, max_value=100))
def test_epsilon_grows_with_rounds(s, sigma, delta, rounds, extra) -> None:
    assert_below(epsilon(s, sigma, rounds, delta), epsilon(s, sigma, rounds + extra, delta))


@FAST
@given(schedules(), sigmas, deltas, rounds_st, st.integers(min_value=1, max_value=100))
def test_epsilon_grows_with_local_steps(s, sigma, delta, rounds, extra) -> None:
    more = FedLAPSchedule(
        batch_size=s.batch_size,
        client_size=s.client_size,
        local_steps=s.local_steps + extra,
        client_fraction=s.client_fraction,
    )
    assert_below(epsilon(s, sigma, rounds, delta), epsilon(more, sigma, rounds, delta))


@FAST
@given(schedules(), sigmas, deltas, rounds_st, st.floats(min_value=1.01, max_value=4.0))
def test_epsilon_grows_with_batch_size_and_falls_with_client_size(s, sigma, delta, rounds, k):
    bigger_batch = min(s.batch_size * k, s.client_size)
    assume(bigger_batch > s.batch_size * 1.001)
    base = epsilon(s, sigma, rounds, delta)
    b = FedLAPSchedule(
        batch_size=bigger_batch,
        client_size=s.client_size,
        local_steps=s.local_steps,
        client_fraction=s.client_fraction,
    )
    n = FedLAPSchedule(
        batch_size=s.batch_size,
        client_size=math.ceil(s.client_size * k),
        local_steps=s.local_steps,
        client_fraction=s.client_fraction,
    )
    assert_below(base, epsilon(b, sigma, rounds, delta))
    assert_below(epsilon(n, sigma, rounds, delta), base)


@FAST
@given(schedules(), sigmas, deltas, rounds_st, st.floats(min_value=0.05, max_value=0.95))
def test_epsilon_grows_with_client_fraction(s, sigma, delta, rounds, shrink) -> None:
    fewer = FedLAPSchedule(
        batch_size=s.batch_size,
        client_size=s.client_size,
        local_steps=s.local_steps,
        client_fraction=s.client_fraction * shrink,
    )
    assert_below(epsilon(fewer, sigma, rounds, delta), epsilon(s, sigma, rounds, delta))


@FAST
@given(schedules(), sigmas, deltas, rounds_st, st.floats(min_value=1.01, max_value=3.0))
def test_epsilon_falls_with_sigma(s, sigma, delta, rounds, k) -> None:
    assert_below(epsilon(s, sigma * k, rounds, delta), epsilon(s, sigma, rounds, delta))


@FAST
@given(schedules(), sigmas, deltas, rounds_st, st.floats(min_value=1.5, max_value=1e3))
def test_epsilon_falls_with_delta(s, sigma, delta, rounds, k) -> None:
    larger = min(delta * k, 0.5)
    assert_below(epsilon(s, sigma, rounds, larger), epsilon(s, sigma, rounds, delta))


@FAST
@given(schedules(), sigmas, deltas, st.integers(min_value=1, max_value=60))
def test_epsilon_curve_equals_pointwise_epsilon(s, sigma, delta, rounds) -> None:
    curve = epsilon_curve(s, sigma, rounds, delta)
    pointwise = [epsilon(s, sigma, m, delta) for m in range(1, rounds + 1)]
    np.testing.assert_allclose(curve, pointwise, rtol=1e-13, atol=0)


@settings(max_examples=20, deadline=None, derandomize=True)  # ~20 epsilon evaluations each
@given(schedules(), deltas, rounds_st, st.floats(min_value=0.5, max_value=30.0))
def test_plan_sigma_round_trip(s, delta, rounds, eps) -> None:
    sigma = plan_sigma(s, rounds, eps, delta)
    assert SIGMA_RANGE[0] <= sigma <= SIGMA_RANGE[1]
    assert epsilon(s, sigma, rounds, delta) <= eps  # meets the target
    if sigma > SIGMA_RANGE[0]:  # ... and is minimal to relative precision 1e-4
        assert epsilon(s, sigma / (1 + 2e-4), rounds, delta) > eps


@FAST
@given(schedules(), st.floats(min_value=0.5, max_value=5.0), deltas, st.floats(0.3, 30.0))
def test_plan_rounds_round_trip(s, sigma, delta, eps) -> None:
    rounds = plan_rounds(s, sigma, eps, delta)
    assume(rounds < 10**11)  # far beyond any real run; the search caps at 1e12
    if rounds == 0:
        assert epsilon(s, sigma, 1, delta) > eps
    else:
        assert epsilon(s, sigma, rounds, delta) <= eps
        assert epsilon(s, sigma, rounds + 1, delta) > eps


@FAST
@given(schedules(), sigmas, deltas)
def test_plan_rounds_zero_when_one_round_exceeds(s, sigma, delta) -> None:
    one = epsilon(s, sigma, 1, delta)
    assume(one > 0)  # epsilon is clamped at 0 for large delta
    assert plan_rounds(s, sigma, one * (1 - 1e-6), delta) == 0
    assert plan_rounds(s, sigma, one * (1 + 1e-9), delta) >= 1


def test_plan_sigma_returns_floor_when_any_sigma_works() -> None:
    tiny = FedLAPSchedule(batch_size=1, client_size=100_000, local_steps=1, client_fraction=0.01)
    orders = [2.0, 3.0, 8.0]  # integer orders: cheap at sigma 0.05 (fractional ones cost more)
    at_floor = epsilon(tiny, SIGMA_RANGE[0], 1, DELTA, orders=orders)
    assert plan_sigma(tiny, 1, at_floor * 1.01, DELTA, orders=orders) == SIGMA_RANGE[0]
    just_above = plan_sigma(tiny, 1, at_floor * 0.99, DELTA, orders=orders)
    assert SIGMA_RANGE[0] < just_above < 1.01 * SIGMA_RANGE[0]


def test_plan_sigma_on_the_reference() -> None:
    sigma = plan_sigma(REFERENCE, 30, 10.0, DELTA)
    assert epsilon(REFERENCE, sigma, 30, DELTA) <= 10.0
    assert epsilon(REFERENCE, sigma / (1 + 2e-4), 30, DELTA) > 10.0
    assert 1.2 < sigma < 1.35


def test_pld_planning_round_trips_on_a_cheap_schedule() -> None:
    s = FedLAPSchedule(batch_size=10, client_size=100, local_steps=5, client_fraction=0.1)
    rounds = plan_rounds(s, 5.0, 0.6, DELTA, accountant="pld")
    assert rounds >= plan_rounds(s, 5.0, 0.6, DELTA)  # PLD is tighter than RDP
    assert epsilon(s, 5.0, rounds, DELTA, accountant="pld") <= 0.6
    assert epsilon(s, 5.0, rounds + 1, DELTA, accountant="pld") > 0.6
    curve = epsilon_curve(s, 5.0, 3, DELTA, accountant="pld")
    assert curve[2] == pytest.approx(epsilon(s, 5.0, 3, DELTA, accountant="pld"), rel=1e-9)
    assert np.all(np.diff(curve) > 0)


# ----------------------------------------------------------------- privacy_plan (report)


def test_privacy_plan_modes() -> None:
    p = privacy_plan(REFERENCE, DELTA, sigma=1.0, rounds=15)
    assert p.mode == "epsilon" and p.epsilon == pytest.approx(10.1830, abs=5e-5)
    assert len(p.curve) == 15 and p.within_budget is None
    p = privacy_plan(REFERENCE, DELTA, eps=10.19, sigma=1.0)
    assert p.mode == "plan-rounds" and p.rounds == 15 and p.within_budget is True
    p = privacy_plan(REFERENCE, DELTA, eps=10.0, rounds=30)
    assert p.mode == "plan-sigma" and p.rounds == 30
    assert p.sigma == plan_sigma(REFERENCE, 30, 10.0, DELTA) and p.epsilon <= 10.0
    assert privacy_plan(REFERENCE, DELTA, eps=10.0).sigma == p.sigma
    p = privacy_plan(REFERENCE, DELTA, eps=0.5, sigma=0.5)
    assert p.rounds == 0 and p.curve == [] and p.within_budget is False


# ----------------------------------------------------------------- acceptance 5: validation


SCHED = {"batch_size": 256, "client_size": 10000, "local_steps": 5}


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"batch_size": 20000, "client_size": 10000, "local_steps": 5}, "20000"),
        ({**SCHED, "client_fraction": 0.0}, "client fraction 0.0"),
        ({**SCHED, "client_fraction": 1.5}, "1.5"),
        ({**SCHED, "client_fraction": -0.2}, "-0.2"),
        ({**SCHED, "client_fraction": float("nan")}, "nan"),
        ({"batch_size": 256, "client_size": 10000, "local_steps": 0}, "local steps 0"),
        ({"batch_size": 256, "client_size": 10000, "local_steps": -3}, "-3"),
        ({"batch_size": 256, "client_size": 10000, "local_steps": 2.5}, "2.5"),
        ({"batch_size": 256, "client_size": 10000.5, "local_steps": 5}, "10000.5"),
        ({"batch_size": 256, "client_size": 10000.0, "local_steps": 5}, "10000.0"),
        ({"batch_size": 256, "client_size": 0, "local_steps": 5}, "client size 0"),
        ({"batch_size": 0, "client_size": 10000, "local_steps": 5}, "batch size 0"),
        ({"batch_size": -5, "client_size": 10000, "local_steps": 5}, "-5"),
        ({"batch_size": float("nan"), "client_size": 10000, "local_steps": 5}, "nan"),
    ],
)
def test_schedule_rejects(kwargs, needle) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        FedLAPSchedule(**kwargs)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


BAD_COMMON = [
    ({"delta": 0.0}, "0.0"),
    ({"delta": 1.0}, "1.0"),
    ({"delta": -1e-5}, "-1e-05"),
    ({"delta": 1.5}, "1.5"),
    ({"accountant": "moments"}, "moments"),
]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        *BAD_COMMON,
        ({"sigma": 0.0}, "sigma 0.0"),
        ({"sigma": -1.0}, "-1.0"),
        ({"sigma": float("nan")}, "nan"),
        ({"sigma": float("inf")}, "inf"),
        ({"rounds": 0}, "rounds 0"),
        ({"rounds": -4}, "-4"),
        ({"rounds": 2.5}, "2.5"),
    ],
)
def test_epsilon_and_curve_reject(kwargs, needle) -> None:
    args = {"sigma": 1.0, "rounds": 3, "delta": DELTA} | kwargs
    for fn in (epsilon, epsilon_curve):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            fn(REFERENCE, **args)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        *BAD_COMMON,
        ({"eps": 0.0}, "epsilon 0.0"),
        ({"eps": -2.0}, "-2.0"),
        ({"eps": float("nan")}, "nan"),
        ({"rounds": 0}, "rounds 0"),
        ({"rounds": -1}, "-1"),
    ],
)
def test_plan_sigma_rejects(kwargs, needle) -> None:
    args = {"rounds": 30, "eps": 10.0, "delta": DELTA} | kwargs
    with pytest.raises(ConfigError, match=re.escape(needle)):
        plan_sigma(REFERENCE, **args)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        *BAD_COMMON,
        ({"eps": 0.0}, "epsilon 0.0"),
        ({"eps": -2.0}, "-2.0"),
        ({"sigma": 0.0}, "sigma 0.0"),
        ({"sigma": -3.0}, "-3.0"),
    ],
)
def test_plan_rounds_rejects(kwargs, needle) -> None:
    args = {"sigma": 1.0, "eps": 10.0, "delta": DELTA} | kwargs
    with pytest.raises(ConfigError, match=re.escape(needle)):
        plan_rounds(REFERENCE, **args)


def test_plan_sigma_below_the_order_grid_floor_is_unreachable() -> None:
    # with orders <= 63 and delta 1e-5, no sigma gives epsilon below ~0.103
    with pytest.raises(ConfigError, match=r"epsilon 0\.05 is out of reach"):
        plan_sigma(REFERENCE, 30, 0.05, DELTA)
    # a larger order grid reaches lower
    sigma = plan_sigma(REFERENCE, 30, 0.05, DELTA, orders=EXTENDED_ORDERS)
    assert epsilon(REFERENCE, sigma, 30, DELTA, orders=EXTENDED_ORDERS) <= 0.05


def test_plan_sigma_beyond_the_sigma_range_is_unreachable() -> None:
    dense = FedLAPSchedule(batch_size=1000, client_size=1000, local_steps=1000)
    with pytest.raises(ConfigError, match="out of reach") as info:
        plan_sigma(dense, 10**12, 1.0, DELTA)
    assert "epsilon 1.0" in str(info.value)


def test_bad_orders_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        epsilon(REFERENCE, 1.0, 3, DELTA, orders=[0.5, 2.0])
    assert math.isfinite(epsilon(REFERENCE, 1.0, 3, DELTA, orders=[2.0, 3.5]))


def test_numpy_integers_are_accepted() -> None:
    s = FedLAPSchedule(batch_size=256, client_size=np.int64(10000), local_steps=np.int32(200))
    assert epsilon(s, 1.0, np.int64(15), DELTA) == epsilon(REFERENCE, 1.0, 15, DELTA)


def test_planning_takes_accountant_objects() -> None:
    """One interface: a name and the accountant object it names give the same answers."""
    from fedlap_privacy.accountant import (
        EXTENDED_ORDERS,
        Accountant,
        PLDAccountant,
        RDPAccountant,
        get_accountant,
    )

    s = FedLAPSchedule(batch_size=256, client_size=10000, local_steps=200)
    rdp = RDPAccountant(EXTENDED_ORDERS)
    assert isinstance(rdp, Accountant) and isinstance(PLDAccountant(), Accountant)
    assert plan_sigma(s, 30, 10.0, 1e-5, rdp) == plan_sigma(s, 30, 10.0, 1e-5, "rdp",
                                                             EXTENDED_ORDERS)
    assert epsilon(s, 1.0, 15, 1e-5, get_accountant("pld")) == epsilon(s, 1.0, 15, 1e-5, "pld")
    with pytest.raises(ConfigError, match="accountant 'moments'"):
        get_accountant("moments")


# ----------------------------------------------------------------- cost bounds (issue 33.7)


def test_curve_longer_than_the_bound_is_refused_before_allocating() -> None:
    limit = curve_rounds_limit("rdp")
    assert limit == 100_000  # the default grid of 151 orders
    assert curve_rounds_limit("rdp", orders=[2.0] * 1510) == 10_000  # more orders, fewer rounds
    assert curve_rounds_limit("pld") == MAX_PLD_CURVE_ROUNDS
    # 10^8 rounds x 151 orders would be a 113 GiB array: refused by its size alone
    with pytest.raises(ConfigError, match=r"rounds 100,000,000 is above the 100,000"):
        epsilon_curve(REFERENCE, 1.0, 10**8, DELTA)
    with pytest.raises(ConfigError, match=r"rounds 1,001 is above the 1,000 .* pld"):
        epsilon_curve(REFERENCE, 1.0, 1001, DELTA, accountant="pld")
    assert len(epsilon_curve(REFERENCE, 1.0, 3, DELTA)) == 3


def test_planned_rounds_above_the_limit_are_refused() -> None:
    # the attack: epsilon 1e6 at sigma 1 admits ~8.5 million rounds; the plan's curve of them
    # would need ~10 GB. The library answer stays available without a limit (it is cheap).
    assert plan_rounds(REFERENCE, 1.0, 1e6, DELTA) > 10**6
    with pytest.raises(ConfigError, match=r"admits 8,\d{3},\d{3} rounds, above the 100,000"):
        plan_rounds(REFERENCE, 1.0, 1e6, DELTA, limit=100_000)
    assert plan_rounds(REFERENCE, 1.0, 10.19, DELTA, limit=100_000) == 15
    with pytest.raises(ConfigError, match="rounds 10,000,000 is above"):
        privacy_plan(REFERENCE, DELTA, sigma=1.0, rounds=10**7)
    with pytest.raises(ConfigError, match="admits"):
        privacy_plan(REFERENCE, DELTA, eps=1e6, sigma=1.0)


def test_pld_round_search_checks_its_limit_before_searching() -> None:
    cheap = FedLAPSchedule(batch_size=10, client_size=100, local_steps=2, client_fraction=0.1)
    with pytest.raises(ConfigError, match=r"admits more than 8 rounds"):
        plan_rounds(cheap, 2.0, 1e3, DELTA, accountant="pld", limit=8)
    assert plan_rounds(cheap, 2.0, 0.5, DELTA, accountant="pld", limit=8) == plan_rounds(
        cheap, 2.0, 0.5, DELTA, accountant="pld") <= 8


def test_orders_whose_evaluation_exceeds_the_cost_bound_are_refused() -> None:
    # an integer order of 10^8 needs a binomial table of 10^8 numbers (and 10^8 lgamma calls)
    with pytest.raises(ConfigError, match=r"RDP orders up to 1e\+08 .* use fewer or smaller"):
        sgm_rdp(0.01, 1.0, [1e8])
    # a fractional order of 10^6 at sigma 0.05 needs a quadrature grid of 10^9 points
    with pytest.raises(ConfigError, match=r"RDP order 1e\+06 at sigma 0.05 .* quadrature"):
        sgm_rdp(0.01, 0.05, [1e6 + 0.5])
    assert np.all(np.isfinite(sgm_rdp(0.01, 1.0, EXTENDED_ORDERS)))  # the grids stay cheap
    assert np.all(np.isfinite(sgm_rdp(0.01, SIGMA_RANGE[0], DEFAULT_ORDERS)))
