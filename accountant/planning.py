"""Epsilon of a FedLAP-DP run, and planning sigma or the number of rounds
(docs/accounting.md#theorem-58, #planning).

Theorem 5.8:  eps(M) = min_alpha [ M * rho(alpha) + c(alpha) ], with rho the RDP of one round
(``FedLAPSchedule.rdp_per_round``) and c(alpha) = log((alpha-1)/alpha) -
(log delta + log alpha)/(alpha-1). RDP is linear in M, so the whole curve eps(1..M) and the
largest admissible M come from ONE RDP evaluation per order. Planning sigma is a 1-D monotone
root search (bisection whose upper end always meets the target). Results are conservative:
the planned run never exceeds the target.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from fedlap_privacy.accountant.rdp import (
    DEFAULT_ORDERS,
    EXTENDED_ORDERS,
    _as_orders,
    _epsilon_per_order,
)
from fedlap_privacy.accountant.schedule import FedLAPSchedule, RoundRates
from fedlap_privacy.errors import ConfigError

__all__ = [
    "ACCOUNTANTS",
    "SIGMA_RANGE",
    "composed_epsilon",
    "epsilon",
    "epsilon_curve",
    "plan_rounds",
    "plan_sigma",
    "rdp_epsilon",
]

ACCOUNTANTS = ("rdp", "pld")
#: plan_sigma searches this range of noise multipliers.
SIGMA_RANGE = (0.05, 1e6)
_SIGMA_RTOL = 1e-4

Orders = Sequence[float] | np.ndarray | None


def _check(
    *,
    sigma: float | None = None,
    rounds: int | None = None,
    eps: float | None = None,
    delta: float | None = None,
    accountant: str = "rdp",
) -> None:
    if sigma is not None and not (math.isfinite(sigma) and sigma > 0):
        raise ConfigError(f"sigma {sigma!r} must be a positive number")
    if rounds is not None and not (isinstance(rounds, int | np.integer) and rounds >= 1):
        raise ConfigError(f"rounds {rounds!r} must be a positive integer")
    if eps is not None and not (math.isfinite(eps) and eps > 0):
        raise ConfigError(f"epsilon {eps!r} must be a positive number")
    if delta is not None and not (0.0 < delta < 1.0):
        raise ConfigError(f"delta {delta!r} must be in (0, 1)")
    if accountant not in ACCOUNTANTS:
        raise ConfigError(f"accountant {accountant!r} must be one of {', '.join(ACCOUNTANTS)}")


def _orders(orders: Orders) -> np.ndarray:
    if orders is None:
        return DEFAULT_ORDERS
    try:
        return _as_orders(orders)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def rdp_epsilon(
    schedule: FedLAPSchedule, sigma: float, rounds: int, delta: float, orders: Orders = None
) -> tuple[float, float]:
    """RDP epsilon after ``rounds`` rounds and the order alpha that attains it."""
    _check(sigma=sigma, rounds=rounds, delta=delta)
    a = _orders(orders)
    per_order = _epsilon_per_order(rounds * schedule.rdp_per_round(sigma, a), a, delta)
    best = int(np.argmin(per_order))
    return max(float(per_order[best]), 0.0), float(a[best])


def epsilon(
    schedule: FedLAPSchedule,
    sigma: float,
    rounds: int,
    delta: float,
    accountant: str = "rdp",
    orders: Orders = None,
) -> float:
    """Epsilon after ``rounds`` rounds of FedLAP-DP (Theorem 5.8; PLD with ``accountant="pld"``)."""
    _check(sigma=sigma, rounds=rounds, delta=delta, accountant=accountant)
    if accountant == "pld":
        from fedlap_privacy.accountant.pld import pld_epsilon

        return pld_epsilon(schedule, sigma, rounds, delta)
    return rdp_epsilon(schedule, sigma, rounds, delta, orders)[0]


def composed_epsilon(
    schedules: Sequence[FedLAPSchedule | RoundRates],
    sigma: float,
    delta: float,
    accountant: str = "rdp",
    orders: Orders = None,
) -> float:
    """Epsilon of rounds that differ in their schedule (one entry per round, any order).

    Adaptive composition of Theorem 5.8 rounds with per-round T (ALI-DPFL's tau): RDP adds
    the per-round RDP of every round; PLD composes the rounds' PLDs. Equal schedules are
    grouped, so the cost grows with the number of DISTINCT schedules. An empty list is 0.
    """
    _check(sigma=sigma, delta=delta, accountant=accountant)
    counts = Counter(schedules)
    if not counts:
        return 0.0
    if accountant == "pld":
        from fedlap_privacy.accountant.pld import round_pld

        total = None
        for schedule, count in counts.items():
            part = round_pld(schedule, sigma).self_compose(count)
            total = part if total is None else total.compose(part)
        assert total is not None
        return max(float(total.get_epsilon_for_delta(delta)), 0.0)
    a = _orders(orders)
    rdp = sum(count * schedule.rdp_per_round(sigma, a) for schedule, count in counts.items())
    return max(float(np.min(_epsilon_per_order(np.asarray(rdp), a, delta))), 0.0)


def epsilon_curve(
    schedule: FedLAPSchedule,
    sigma: float,
    rounds: int,
    delta: float,
    accountant: str = "rdp",
    orders: Orders = None,
) -> np.ndarray:
    """Epsilon after each round 1..rounds; RDP: one RDP evaluation for the whole curve."""
    _check(sigma=sigma, rounds=rounds, delta=delta, accountant=accountant)
    if accountant == "pld":
        from fedlap_privacy.accountant.pld import pld_epsilon_curve

        return np.asarray(pld_epsilon_curve(schedule, sigma, rounds, delta))
    a = _orders(orders)
    rho = schedule.rdp_per_round(sigma, a)
    m = np.arange(1, rounds + 1, dtype=float)[:, None]
    per_order = _epsilon_per_order(m * rho[None, :], a[None, :], delta)
    return np.maximum(per_order.min(axis=1), 0.0)


def plan_sigma(
    schedule: FedLAPSchedule,
    rounds: int,
    eps: float,
    delta: float,
    accountant: str = "rdp",
    orders: Orders = None,
) -> float:
    """Smallest sigma (to relative precision 1e-4) whose epsilon after ``rounds`` <= ``eps``.

    Conservative: the returned sigma always meets the target. Searches ``SIGMA_RANGE``: a
    target that no sigma up to 1e6 meets is a ConfigError; one that 0.05 meets returns 0.05.
    """
    _check(rounds=rounds, eps=eps, delta=delta, accountant=accountant)
    a = _orders(orders)

    def excess(log_sigma: float) -> float:
        return epsilon(schedule, math.exp(log_sigma), rounds, delta, accountant, a) - eps

    # Bracket the root by geometric steps from a good start: sigma = 1 for RDP; for PLD the
    # RDP answer, which PLD (tighter) meets already, so few costly PLD evaluations are needed.
    start, factor = 0.0, math.log(4.0)
    floor = float(np.min(_epsilon_per_order(np.zeros_like(a), a, delta)))
    if accountant == "rdp" and eps <= floor:
        raise ConfigError(
            f"epsilon {eps} is out of reach: with orders up to {a.max():g} no sigma gets below "
            f"{floor:.4f} at delta {delta:g} (pass a larger order grid)"
        )
    if accountant == "pld":  # PLD <= RDP, so the RDP answer is a near-tight upper start
        upper = plan_sigma(schedule, rounds, eps, delta, "rdp", EXTENDED_ORDERS)
        start, factor = math.log(upper), 0.2
    lo_limit, hi_limit = (math.log(s) for s in SIGMA_RANGE)
    lo = hi = start
    if excess(start) > 0:
        while excess(hi) > 0:
            if hi >= hi_limit:
                raise ConfigError(
                    f"epsilon {eps} is out of reach: even sigma = {SIGMA_RANGE[1]:g} spends "
                    f"more in {rounds} rounds"
                )
            lo, hi = hi, min(hi + factor, hi_limit)
    else:
        while excess(lo) <= 0:
            if lo <= lo_limit:
                return SIGMA_RANGE[0]
            hi, lo = lo, max(lo - factor, lo_limit)
    # bisection in log sigma keeps excess(lo) > 0 >= excess(hi): hi is always admissible
    while hi - lo > math.log1p(_SIGMA_RTOL):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return math.exp(hi)


def plan_rounds(
    schedule: FedLAPSchedule,
    sigma: float,
    eps: float,
    delta: float,
    accountant: str = "rdp",
    orders: Orders = None,
) -> int:
    """Largest number of rounds whose epsilon <= ``eps`` (0 if even one round exceeds it).

    RDP: order alpha certifies every M <= (eps - c(alpha)) / rho(alpha), so the answer is the
    maximum of that bound over orders — one RDP evaluation, no search.
    """
    _check(sigma=sigma, eps=eps, delta=delta, accountant=accountant)
    if accountant == "pld":
        return _plan_rounds_by_search(schedule, sigma, eps, delta, accountant)
    a = _orders(orders)
    rho = schedule.rdp_per_round(sigma, a)
    offset = _epsilon_per_order(np.zeros_like(a), a, delta)
    with np.errstate(divide="ignore"):
        bound = np.floor(np.max((eps - offset) / rho))
    rounds = int(min(max(bound, 0.0), 10**12))
    while rounds > 0 and rdp_epsilon(schedule, sigma, rounds, delta, a)[0] > eps:
        rounds -= 1  # guard against rounding at the boundary
    return rounds


def _plan_rounds_by_search(
    schedule: FedLAPSchedule, sigma: float, eps: float, delta: float, accountant: str
) -> int:
    """Largest M with epsilon(M) <= eps by doubling and bisection (epsilon grows with M)."""

    def within(m: int) -> bool:
        return epsilon(schedule, sigma, m, delta, accountant) <= eps

    if not within(1):
        return 0
    good, bad = 1, 2
    while within(bad):
        good, bad = bad, bad * 2
        if bad > 10**6:
            raise ConfigError(f"more than {10**6} rounds fit in epsilon {eps}: plan with RDP")
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if within(mid) else (good, mid)
    return good
