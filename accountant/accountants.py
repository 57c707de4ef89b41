"""The two accountants, as objects the planning functions are written against once.

Both price the same mechanism (docs/accounting.md#theorem-58): per round a Poisson-sampled
Gaussian at ``q1``, then ``T - 1`` at ``q2``, add/remove-one neighbours. They differ in how
they turn it into (epsilon, delta):

* :class:`RDPAccountant` — Renyi DP of the sampled Gaussian mechanism (Mironov, Talwar,
  Zhang 2019) on an order grid, converted with Balle et al. 2020, Thm 21. RDP is linear in
  the number of rounds, so a whole epsilon curve and the largest admissible number of
  rounds come from one RDP evaluation per order.
* :class:`PLDAccountant` — privacy loss distributions (our own, pessimistic Connect-the-Dots
  discretisation composed by one FFT, :mod:`fedlap_privacy.accountant.pld`): tighter (about
  8% on the reference configuration), a few milliseconds per epsilon.

Their names (:class:`AccountantName`) are the keys of the registry
(:mod:`fedlap_privacy.accountant.registry`), the only place a name is read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol, runtime_checkable

import numpy as np

from fedlap_privacy.accountant.rdp import (
    DEFAULT_ORDERS,
    EXTENDED_ORDERS,
    _as_orders,
    _epsilon_per_order,
)
from fedlap_privacy.accountant.schedule import FedLAPSchedule, RoundRates
from fedlap_privacy.errors import ConfigError

__all__ = ["Accountant", "AccountantName", "PLDAccountant", "RDPAccountant"]

Orders = Sequence[float] | np.ndarray | None
Round = FedLAPSchedule | RoundRates


def _orders(orders: Orders) -> np.ndarray:
    if orders is None:
        return DEFAULT_ORDERS
    try:
        return _as_orders(orders)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class AccountantName(StrEnum):
    """The names of the package's own accountants (``--accountant``, a ledger's entries)."""

    RDP = "rdp"
    PLD = "pld"


@runtime_checkable
class Accountant(Protocol):
    """What planning needs of an accountant (arguments are checked by the caller).

    A class that implements it, constructed as ``cls(orders)`` (``orders``: an RDP order
    grid, None for the default; accountants without orders ignore it), can be registered
    under a name (:func:`~fedlap_privacy.accountant.registry.register_accountant`).
    """

    name: str
    #: whether :meth:`max_rounds` searches (its cost grows with the answer), so that a
    #: planner checks a limit on the rounds before it asks
    rounds_by_search: bool

    def epsilon(self, schedule: FedLAPSchedule, sigma: float, rounds: int,
                delta: float) -> float:
        """Epsilon after ``rounds`` equal rounds."""
        ...

    def epsilon_curve(self, schedule: FedLAPSchedule, sigma: float, rounds: int,
                      delta: float) -> np.ndarray:
        """Epsilon after each round 1..rounds."""
        ...

    def composed_epsilon(self, rounds: Sequence[Round], sigma: float, delta: float) -> float:
        """Epsilon of rounds that differ in their rates or T (any order; empty: 0)."""
        ...

    def max_rounds(self, schedule: FedLAPSchedule, sigma: float, eps: float,
                   delta: float) -> int:
        """The largest number of rounds whose epsilon is at most ``eps`` (0: none fits)."""
        ...

    def unreachable(self, eps: float, delta: float) -> str | None:
        """Why no sigma reaches ``eps`` at ``delta`` (None: some sigma does)."""
        ...

    def curve_rounds_limit(self) -> int:
        """The most rounds whose epsilon curve this accountant evaluates (memory, time)."""
        ...

    def hint_accountant(self) -> Accountant | None:
        """A faster accountant whose planned sigma is a good start for this one's planning,
        from above or close (None: start the search at sigma 1)."""
        ...


class RDPAccountant:
    """Renyi-DP accounting on an order grid (default: the paper's and Opacus')."""

    name = AccountantName.RDP
    rounds_by_search = False
    #: its epsilon curve is a (rounds x orders) array of at most this many numbers (100,000
    #: rounds on the default grid of 151 orders: about 400 MB at its peak)
    curve_cells = 15_100_000

    def __init__(self, orders: Orders = None) -> None:
        self.orders = _orders(orders)

    def best_order(self, schedule: FedLAPSchedule, sigma: float, rounds: int,
                   delta: float) -> tuple[float, float]:
        """(epsilon, the order alpha that attains it) after ``rounds`` rounds."""
        a = self.orders
        per_order = _epsilon_per_order(rounds * schedule.rdp_per_round(sigma, a), a, delta)
        best = int(np.argmin(per_order))
        return max(float(per_order[best]), 0.0), float(a[best])

    def epsilon(self, schedule: FedLAPSchedule, sigma: float, rounds: int,
                delta: float) -> float:
        return self.best_order(schedule, sigma, rounds, delta)[0]

    def epsilon_curve(self, schedule: FedLAPSchedule, sigma: float, rounds: int,
                      delta: float) -> np.ndarray:
        a = self.orders
        rho = schedule.rdp_per_round(sigma, a)
        m = np.arange(1, rounds + 1, dtype=float)[:, None]
        per_order = _epsilon_per_order(m * rho[None, :], a[None, :], delta)
        return np.maximum(per_order.min(axis=1), 0.0)

    def composed_epsilon(self, rounds: Sequence[Round], sigma: float, delta: float) -> float:
        counts = Counter(rounds)
        if not counts:
            return 0.0
        a = self.orders
        rdp = sum(count * r.rdp_per_round(sigma, a) for r, count in counts.items())
        return max(float(np.min(_epsilon_per_order(np.asarray(rdp), a, delta))), 0.0)

    def max_rounds(self, schedule: FedLAPSchedule, sigma: float, eps: float,
                   delta: float) -> int:
        """Order alpha certifies every M <= (eps - c(alpha)) / rho(alpha): the answer is the
        maximum of that bound over orders, no search."""
        a = self.orders
        rho = schedule.rdp_per_round(sigma, a)
        offset = _epsilon_per_order(np.zeros_like(a), a, delta)
        with np.errstate(divide="ignore"):
            bound = np.floor(np.max((eps - offset) / rho))
        rounds = int(min(max(bound, 0.0), 10**12))
        while rounds > 0 and self.epsilon(schedule, sigma, rounds, delta) > eps:
            rounds -= 1  # guard against rounding at the boundary
        return rounds

    def floor(self, delta: float) -> float:
        """The smallest epsilon any sigma reaches on this order grid: the conversion's
        offset c(alpha) alone."""
        return float(np.min(_epsilon_per_order(np.zeros_like(self.orders), self.orders, delta)))

    def unreachable(self, eps: float, delta: float) -> str | None:
        floor = self.floor(delta)
        if eps > floor:
            return None
        return (f"with orders up to {float(np.max(self.orders)):g} no sigma gets below "
                f"{floor:.4f} at delta {delta:g} (pass a larger order grid)")

    def curve_rounds_limit(self) -> int:
        return self.curve_cells // self.orders.size

    def hint_accountant(self) -> Accountant | None:
        return None


class PLDAccountant:
    """Privacy-loss-distribution accounting (:mod:`fedlap_privacy.accountant.pld`)."""

    name = AccountantName.PLD
    rounds_by_search = True
    #: it composes a curve round by round (about 0.3 s a round on the reference schedule)
    max_curve_rounds = 1_000

    def __init__(self, orders: Orders = None) -> None:
        """``orders``: accepted for the common constructor, unused (PLD has no orders)."""

    def epsilon(self, schedule: FedLAPSchedule, sigma: float, rounds: int,
                delta: float) -> float:
        from fedlap_privacy.accountant.pld import pld_epsilon

        return pld_epsilon(schedule, sigma, rounds, delta)

    def epsilon_curve(self, schedule: FedLAPSchedule, sigma: float, rounds: int,
                      delta: float) -> np.ndarray:
        from fedlap_privacy.accountant.pld import pld_epsilon_curve

        return np.asarray(pld_epsilon_curve(schedule, sigma, rounds, delta))

    def composed_epsilon(self, rounds: Sequence[Round], sigma: float, delta: float) -> float:
        from fedlap_privacy.accountant.pld import pld_composed_epsilon

        return pld_composed_epsilon(Counter(rounds).items(), sigma, delta)

    def max_rounds(self, schedule: FedLAPSchedule, sigma: float, eps: float,
                   delta: float) -> int:
        """Doubling, then bisection (epsilon grows with the number of rounds)."""

        def within(m: int) -> bool:
            return self.epsilon(schedule, sigma, m, delta) <= eps

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

    def unreachable(self, eps: float, delta: float) -> str | None:
        return None  # epsilon goes to 0 as sigma grows

    def curve_rounds_limit(self) -> int:
        return self.max_curve_rounds

    def hint_accountant(self) -> Accountant | None:
        """RDP on the extended grid: PLD (tighter) meets its planned sigma already, so the
        root lies a little below it."""
        return RDPAccountant(EXTENDED_ORDERS)
