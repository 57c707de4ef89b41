"""FedLAP-DP's two-rate composition (paper Theorem 5.8, docs/accounting.md#theorem-58).

Contract: a record of client k is touched in a round's first access to private data only if
its client is selected (probability ``client_fraction``, independently per round) and the
Poisson batch (rate ``batch_size / client_size``) contains it; the round's later accesses are
conditioned on the first. So each round is one sampled Gaussian step at
``q1 = client_fraction * batch_size / client_size`` and ``local_steps - 1`` steps at
``q2 = batch_size / client_size``, every step clipping records to C and adding
``N(0, sigma^2 C^2 I)`` to the sum (add/remove-one neighbours). ``client_size`` is the SMALLEST
client dataset, which gives the largest rate: the bound holds for every client.
``local_steps`` is the worst-case number of accesses per client per round (in FedLAP-DP
``R_i * L_max * R_b``); accesses that a run skips only make it more private.

Client-level DP (docs/accounting.md#client-level-dp): one access per round at rate
``q = client_fraction`` over the ``clients`` "records": :meth:`FedLAPSchedule.client_level`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fedlap_privacy.accountant.rdp import sgm_rdp
from fedlap_privacy.errors import ConfigError

__all__ = ["FedLAPSchedule", "RoundRates", "RoundSchedule", "step_counts"]


class RoundSchedule(Protocol):
    """What a round is to an accountant: its two sampling rates and its number of accesses
    (:class:`FedLAPSchedule` and :class:`RoundRates`, the ledger's recorded rates)."""

    @property
    def q1(self) -> float: ...

    @property
    def q2(self) -> float: ...

    @property
    def local_steps(self) -> int: ...


def step_counts(rounds: Iterable[tuple[RoundSchedule, int]]) -> dict[float, int]:
    """Number of sampled Gaussian steps at each rate over ``(schedule, rounds)`` pairs.

    Every round contributes one step at ``q1`` and ``local_steps - 1`` at ``q2`` (Theorem
    5.8); composition is commutative, so this is all an accountant needs. Rates keep their
    order of first appearance and zero counts are dropped.
    """
    counts: dict[float, int] = {}
    for schedule, count in rounds:
        for q, n in ((schedule.q1, count), (schedule.q2, count * (schedule.local_steps - 1))):
            if n:
                counts[float(q)] = counts.get(float(q), 0) + int(n)
    return counts


@dataclass(frozen=True)
class RoundRates:
    """The sampling rates of one round as a ledger records them: the first access at ``q1``,
    the ``local_steps - 1`` later ones at ``q2`` (each an SGM with the same sigma).

    A ledger composes these recorded values, never today's configuration applied to the past.
    """

    q1: float
    q2: float
    local_steps: int

    def __post_init__(self) -> None:
        for name, q in (("q1", self.q1), ("q2", self.q2)):
            if not (isinstance(q, float | int) and 0.0 <= q <= 1.0):
                raise ConfigError(f"sampling rate {name} {q!r} must lie in [0, 1]")
        if not (isinstance(self.local_steps, int | np.integer) and self.local_steps >= 1):
            raise ConfigError(f"local steps {self.local_steps!r} must be a positive integer")

    def rdp_per_round(self, sigma: float, orders: np.ndarray) -> np.ndarray:
        """RDP of one round: xi(alpha|q1) + (T - 1) xi(alpha|q2) (Theorem 5.8)."""
        second = sgm_rdp(self.q2, sigma, orders)
        first = second if self.q1 == self.q2 else sgm_rdp(self.q1, sigma, orders)
        return first + (self.local_steps - 1) * second


@dataclass(frozen=True, kw_only=True)
class FedLAPSchedule:
    """Per-round sampling schedule of FedLAP-DP (and of record-level DP-FedAvg/-FedProx)."""

    batch_size: float
    client_size: int
    local_steps: int
    client_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.client_size, int | np.integer) and self.client_size >= 1):
            raise ConfigError(f"client size {self.client_size!r} must be a positive integer")
        if not (np.isfinite(self.batch_size) and self.batch_size > 0):
            raise ConfigError(f"batch size {self.batch_size!r} must be positive")
        if self.batch_size > self.client_size:
            raise ConfigError(
                f"batch size {self.batch_size} is larger than the client size {self.client_size}"
            )
        if not (isinstance(self.local_steps, int | np.integer) and self.local_steps >= 1):
            raise ConfigError(f"local steps {self.local_steps!r} must be a positive integer")
        if not (0.0 < self.client_fraction <= 1.0):
            raise ConfigError(f"client fraction {self.client_fraction!r} must be in (0, 1]")

    @classmethod
    def client_level(cls, clients: int, client_fraction: float = 1.0) -> FedLAPSchedule:
        """One SGM per round over clients, q = client_fraction (docs/accounting.md#client-level-dp;
        sensitivity: the clipping or normalisation scale of a client's update,
        add/remove-one client)."""
        return cls(
            batch_size=client_fraction * clients, client_size=clients, local_steps=1,
            client_fraction=1.0,
        )

    @property
    def q1(self) -> float:
        """Sampling rate of a round's first access: client fraction x batch rate."""
        return self.client_fraction * self.batch_size / self.client_size

    @property
    def q2(self) -> float:
        """Sampling rate of every later access of the round."""
        return self.batch_size / self.client_size

    def rates(self, selection_hidden: bool = True) -> RoundRates:
        """The round's rates. ``selection_hidden=False``: against an adversary who knows
        which clients were selected (the server), client sampling amplifies nothing and the
        first access of a selected client runs at ``q2`` too."""
        return RoundRates(self.q1 if selection_hidden else self.q2, self.q2, self.local_steps)

    def rdp_per_round(self, sigma: float, orders: np.ndarray) -> np.ndarray:
        """RDP of one round: xi(alpha|q1) + (T - 1) xi(alpha|q2) (Theorem 5.8)."""
        return self.rates().rdp_per_round(sigma, orders)
