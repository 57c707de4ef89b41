"""Epsilon of a FedLAP-DP run, and planning sigma or the number of rounds
(docs/accounting.md#theorem-58, #planning).

Theorem 5.8:  eps(M) = min_alpha [ M * rho(alpha) + c(alpha) ], with rho the RDP of one round
(``FedLAPSchedule.rdp_per_round``) and c(alpha) = log((alpha-1)/alpha) -
(log delta + log alpha)/(alpha-1). RDP is linear in M, so the whole curve eps(1..M) and the
largest admissible M come from ONE RDP evaluation per order. Planning sigma is a 1-D monotone
root search in log sigma (Illinois regula falsi from a bracket, whose upper end always meets
the target). Results are conservative: the planned run never exceeds the target.

Every function takes ``accountant``: a registered name (``"rdp"``, ``"pld"``:
:mod:`fedlap_privacy.accountant.registry`) or an accountant object
(:mod:`fedlap_privacy.accountant.accountants`); the functions are written once against
that interface.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

from fedlap_privacy.accountant.accountants import (
    Accountant,
    AccountantName,
    Orders,
    PLDAccountant,
    RDPAccountant,
)
from fedlap_privacy.accountant.registry import get_accountant
from fedlap_privacy.accountant.schedule import FedLAPSchedule, RoundRates
from fedlap_privacy.errors import ConfigError

__all__ = [
    "CURVE_CELLS",
    "MAX_PLD_CURVE_ROUNDS",
    "SIGMA_RANGE",
    "check_curve_rounds",
    "composed_epsilon",
    "curve_rounds_limit",
    "epsilon",
    "epsilon_curve",
    "plan_rounds",
    "plan_sigma",
    "rdp_epsilon",
]

#: plan_sigma searches this range of noise multipliers.
SIGMA_RANGE = (0.05, 1e6)
_SIGMA_RTOL = 1e-4
#: RDP's epsilon curve is a (rounds x orders) array of at most this many numbers
CURVE_CELLS = RDPAccountant.curve_cells
#: PLD composes a curve round by round
MAX_PLD_CURVE_ROUNDS = PLDAccountant.max_curve_rounds

AccountantLike = str | Accountant


def _check(
    *,
    sigma: float | None = None,
    rounds: int | None = None,
    eps: float | None = None,
    delta: float | None = None,
    accountant: AccountantLike = AccountantName.RDP,
    orders: Orders = None,
) -> Accountant:
    """Check the arguments; the accountant they name."""
    if sigma is not None and not (math.isfinite(sigma) and sigma > 0):
        raise ConfigError(f"sigma {sigma!r} must be a positive number")
    if rounds is not None and not (isinstance(rounds, int | np.integer) and rounds >= 1):
        raise ConfigError(f"rounds {rounds!r} must be a positive integer")
    if eps is not None and not (math.isfinite(eps) and eps > 0):
        raise ConfigError(f"epsilon {eps!r} must be a positive number")
    if delta is not None and not (0.0 < delta < 1.0):
        raise ConfigError(f"delta {delta!r} must be in (0, 1)")
    return get_accountant(accountant, orders)


def curve_rounds_limit(accountant: AccountantLike = AccountantName.RDP,
                       orders: Orders = None) -> int:
    """The most rounds whose epsilon curve ``accountant`` evaluates (memory and time bound)."""
    return get_accountant(accountant, orders).curve_rounds_limit()


def check_curve_rounds(rounds: int, accountant: AccountantLike = AccountantName.RDP,
                       orders: Orders = None) -> None:
    """Refuse, before anything is allocated, a curve longer than :func:`curve_rounds_limit`."""
    limit = curve_rounds_limit(accountant, orders)
    if rounds > limit:
        name = get_accountant(accountant, orders).name
        raise ConfigError(f"rounds {rounds:,} is above the {limit:,} whose epsilon curve the "
                          f"{name} accountant evaluates (memory and time bound)")


def rdp_epsilon(
    schedule: FedLAPSchedule, sigma: float, rounds: int, delta: float, orders: Orders = None
) -> tuple[float, float]:
    """RDP epsilon after ``rounds`` rounds and the order alpha that attains it."""
    _check(sigma=sigma, rounds=rounds, delta=delta)
    return RDPAccountant(orders).best_order(schedule, sigma, rounds, delta)


def epsilon(
    schedule: FedLAPSchedule,
    sigma: float,
    rounds: int,
    delta: float,
    accountant: AccountantLike = AccountantName.RDP,
    orders: Orders = None,
) -> float:
    """Epsilon after ``rounds`` rounds of FedLAP-DP (Theorem 5.8; PLD with ``accountant="pld"``)."""
    acc = _check(sigma=sigma, rounds=rounds, delta=delta, accountant=accountant, orders=orders)
    return acc.epsilon(schedule, sigma, rounds, delta)


def composed_epsilon(
    schedules: Sequence[FedLAPSchedule | RoundRates],
    sigma: float,
    delta: float,
    accountant: AccountantLike = AccountantName.RDP,
    orders: Orders = None,
) -> float:
    """Epsilon of rounds that differ in their schedule (one entry per round, any order).

    Adaptive composition of Theorem 5.8 rounds with per-round T (ALI-DPFL's tau): RDP adds
    the per-round RDP of every round; PLD composes the rounds' PLDs. Equal schedules are
    grouped, so the cost grows with the number of DISTINCT schedules. An empty list is 0.
    """
    acc = _check(sigma=sigma, delta=delta, accountant=accountant, orders=orders)
    return acc.composed_epsilon(schedules, sigma, delta)


def epsilon_curve(
    schedule: FedLAPSchedule,
    sigma: float,
    rounds: int,
    delta: float,
    accountant: AccountantLike = AccountantName.RDP,
    orders: Orders = None,
) -> np.ndarray:
    """Epsilon after each round 1..rounds; RDP: one RDP evaluation for the whole curve.

    Refuses a curve longer than :func:`curve_rounds_limit` (before allocating it)."""
    acc = _check(sigma=sigma, rounds=rounds, delta=delta, accountant=accountant, orders=orders)
    check_curve_rounds(rounds, acc)
    return acc.epsilon_curve(schedule, sigma, rounds, delta)


def plan_sigma(
    schedule: FedLAPSchedule,
    rounds: int,
    eps: float,
    delta: float,
    accountant: AccountantLike = AccountantName.RDP,
    orders: Orders = None,
) -> float:
    """Smallest sigma (to relative precision 1e-4) whose epsilon after ``rounds`` <= ``eps``.

    Conservative: the returned sigma always meets the target. Searches ``SIGMA_RANGE``: a
    target that no sigma up to 1e6 meets is a ConfigError; one that 0.05 meets returns 0.05.
    """
    acc = _check(rounds=rounds, eps=eps, delta=delta, accountant=accountant, orders=orders)

    @functools.cache
    def excess(log_sigma: float) -> float:  # memoised: the bracketing revisits its start
        return acc.epsilon(schedule, math.exp(log_sigma), rounds, delta) - eps

    reason = acc.unreachable(eps, delta)
    if reason is not None:
        raise ConfigError(f"epsilon {eps} is out of reach: {reason}")
    # Bracket the root by geometric steps from a good start: sigma = 1, or the sigma its
    # hint accountant plans (PLD: RDP's answer, which PLD meets already, the root a few %
    # below it).
    helper = acc.hint_accountant()
    hint = None if helper is None else plan_sigma(schedule, rounds, eps, delta, helper)
    start, factor = (0.0, math.log(4.0)) if hint is None else (math.log(hint), 0.1)
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
    return math.exp(_root(excess, lo, hi, math.log1p(_SIGMA_RTOL)))


def _root(excess: Callable[[float], float], lo: float, hi: float, tol: float) -> float:
    """A point within ``tol`` above the sign change of ``excess`` in ``[lo, hi]``
    (``excess(lo) > 0 >= excess(hi)``, ``excess`` decreasing), where ``excess <= 0``.

    The Illinois variant of regula falsi (Dowell & Jarratt 1971: the function value kept at
    an end that survives twice in a row is halved, so both ends converge, superlinearly)
    keeps ``excess(lo) > 0 >= excess(hi)``; a probe the estimate puts within ``tol`` of an
    end goes ``0.9 tol`` inside it instead, which closes the bracket or moves that end by
    ``0.9 tol``. ``hi``, returned, always meets the target; a few evaluations where
    bisection takes about 11.
    """
    f_lo, f_hi = excess(lo), excess(hi)
    kept = 0  # +1: hi survived the last step, -1: lo did
    while hi - lo > tol:
        x = hi - f_hi * (hi - lo) / (f_hi - f_lo)
        if x - lo < tol:
            x = lo + 0.9 * tol
        elif hi - x < tol:
            x = hi - 0.9 * tol
        fx = excess(x)
        if fx > 0:
            lo, f_lo = x, fx
            if kept == 1:
                f_hi /= 2
            kept = 1
        else:
            hi, f_hi = x, fx
            if kept == -1:
                f_lo /= 2
            kept = -1
    return hi


def plan_rounds(
    schedule: FedLAPSchedule,
    sigma: float,
    eps: float,
    delta: float,
    accountant: AccountantLike = AccountantName.RDP,
    orders: Orders = None,
    limit: int | None = None,
) -> int:
    """Largest number of rounds whose epsilon <= ``eps`` (0 if even one round exceeds it).

    RDP: order alpha certifies every M <= (eps - c(alpha)) / rho(alpha), so the answer is the
    maximum of that bound over orders — one RDP evaluation, no search. PLD: a search, whose
    cost grows with the answer. ``limit``: refuse (ConfigError) an answer above it; PLD checks
    the limit itself first, so its search never composes more rounds than about twice that.
    """
    acc = _check(sigma=sigma, eps=eps, delta=delta, accountant=accountant, orders=orders)
    if limit is not None and acc.rounds_by_search:
        if acc.epsilon(schedule, sigma, limit, delta) <= eps:
            raise _too_many_rounds(eps, sigma, f"more than {limit:,}", limit)
    rounds = acc.max_rounds(schedule, sigma, eps, delta)
    if limit is not None and rounds > limit:
        raise _too_many_rounds(eps, sigma, f"{rounds:,}", limit)
    return rounds


def _too_many_rounds(eps: float, sigma: float, fit: str, limit: int) -> ConfigError:
    return ConfigError(f"epsilon {eps:g} at sigma {sigma:g} admits {fit} rounds, above the "
                       f"{limit:,} a plan evaluates: lower the target, or give the rounds")
