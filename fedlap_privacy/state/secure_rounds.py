"""What a round over secure aggregation ran with, as its ledger entry records it, and the
epsilon against the server those records compose to
(docs/accounting.md#distributed-dp-over-secure-aggregation; Kairouz, Liu, Steinke, ICML 2021;
Agarwal, Kairouz, Liu, NeurIPS 2021).

Each :class:`SecureRound` keeps the public parameters of the round (noise, bits, modulus, grid
step, clip, padded dimension, rounding bias, each client's noise share), the uploads it was
set up for and those that reached the sum, the sensitivity bounds and the round's RDP vector
against the server over :data:`~fedlap_privacy.accountant.rdp.DEFAULT_ORDERS`. Nothing stored
is trusted: :meth:`SecureRound.check` recomputes the sensitivities and the RDP from the
parameters. A refused round (fewer survivors than the minimum: the server never unmasked
the sum) released nothing and spends nothing: its RDP is zero. A sum that failed the server's
noise check (status :data:`NOISE_MISSING`) did not move the model, but the server unmasked it:
it is charged at the shares its noise shows (``received``: a lower bound), and without an
honest one its RDP is infinite. An interrupted round is priced at the fewest shares a
released round can count (min_survivors - colluding).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlap_privacy.accountant.distributed import (
    DistributedMechanism,
    Quantisation,
    round_rdp,
)
from fedlap_privacy.accountant.rdp import DEFAULT_ORDERS, rdp_to_epsilon
from fedlap_privacy.errors import CheckpointError

__all__ = ["NOISE_MISSING", "REFUSED", "SecureRound", "server_epsilon"]

#: the ledger status of a round secure aggregation did not release
REFUSED = "refused"
#: the ledger status of a round whose unmasked sum lacked noise (charged, the model unmoved)
NOISE_MISSING = "noise-missing"
_RTOL = 1e-9


@dataclass(frozen=True)
class SecureRound:
    """One round's distributed-DP record (module docstring). ``planned``: the uploads the
    round was set up for; ``received``: the noise shares that reached the sum;
    ``server_epsilon``: the ledger's epsilon against the server after this round."""

    mechanism: str
    bits: int
    modulus: int
    gamma: float
    clip: float
    dim: int
    beta: float
    local_std: float
    planned: int
    received: int
    min_survivors: int
    colluding: int
    l2: float
    l1: float
    rdp: tuple[float, ...]
    server_epsilon: float | None = None

    @classmethod
    def of(cls, mechanism: DistributedMechanism, bits: int, planned: int, received: int,
           min_survivors: int, colluding: int, released: bool) -> SecureRound:
        """The record of a round of ``mechanism``; its RDP is that of ``received`` shares
        less the colluding ones (infinite when none is honest), or zero when the round was not
        ``released``."""
        q = mechanism.quantisation
        if not released:
            rdp = np.zeros(len(DEFAULT_ORDERS))
        elif received - colluding < 1:  # no honest noise reached the server: no guarantee
            rdp = np.full(len(DEFAULT_ORDERS), np.inf)
        else:
            rdp = round_rdp(mechanism, received, colluding)
        return cls(mechanism.noise.value, bits, 1 << bits, q.gamma, q.clip, q.dim, q.beta,
                   mechanism.local_std, planned, received, min_survivors, colluding, q.l2,
                   q.l1, tuple(float(v) for v in rdp))

    @property
    def released(self) -> bool:
        return any(v != 0.0 for v in self.rdp)

    def distributed_mechanism(self) -> DistributedMechanism:
        return DistributedMechanism(self.mechanism,  # type: ignore[arg-type]
                                    Quantisation(self.clip, self.dim, self.gamma, self.beta),
                                    self.local_std)

    def check(self, where: str) -> None:
        """Refuse a record whose sensitivities, modulus or RDP are not what its parameters
        give (an edited ledger)."""
        fresh = SecureRound.of(self.distributed_mechanism(), self.bits, self.planned,
                               self.received, self.min_survivors, self.colluding,
                               self.released)
        same = (fresh.modulus == self.modulus and math.isclose(fresh.l2, self.l2, rel_tol=_RTOL)
                and math.isclose(fresh.l1, self.l1, rel_tol=_RTOL)
                and len(fresh.rdp) == len(self.rdp)
                and all(a == b or math.isclose(a, b, rel_tol=_RTOL)
                        for a, b in zip(fresh.rdp, self.rdp, strict=True)))
        if not same:
            raise CheckpointError(f"{where}: the secure-aggregation record does not compose "
                                  "to what its parameters give (edited)")

    @classmethod
    def from_dict(cls, values: Any) -> SecureRound:
        try:
            return cls(**{**values, "rdp": tuple(float(v) for v in values["rdp"])})
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"malformed secure-aggregation record ({exc})") from None

    def withheld(self) -> SecureRound:
        """The record as a release that hides the selection states it: no count of the
        uploads planned, a released round priced at its fewest shares (min_survivors, or
        fewer where the server's noise check found fewer), no epsilon of the realised
        rounds."""
        shares = min(self.received, self.min_survivors)
        return dataclasses.replace(
            SecureRound.of(self.distributed_mechanism(), self.bits, 0, shares,
                           self.min_survivors, self.colluding, self.released),
            server_epsilon=None)

    def with_epsilon(self, eps: float | None) -> SecureRound:
        return dataclasses.replace(self, server_epsilon=eps)


def server_epsilon(rounds: list[tuple[SecureRound, tuple[int, ...] | None]], clients: int,
                   delta: float) -> float:
    """Epsilon against the server: for each client the RDP of the rounds it was selected in
    adds up (no amplification: the server chose the cohort; a round whose selection is
    withheld counts for every client), converted at ``delta``; the largest over clients (0
    when no round released anything)."""
    if not rounds:
        return 0.0
    rdp = np.array([r.rdp for r, _ in rounds])  # rounds x orders
    taking_part = np.zeros((clients, len(rounds)))
    for j, (_, chosen) in enumerate(rounds):
        taking_part[list(range(clients)) if chosen is None else list(chosen), j] = 1.0
    infinite = taking_part @ np.isinf(rdp) > 0
    totals = np.where(infinite, np.inf, taking_part @ np.where(np.isinf(rdp), 0.0, rdp))
    orders = np.asarray(DEFAULT_ORDERS, dtype=float)
    spent = [row for row in np.unique(totals, axis=0) if np.any(row != 0.0)]
    eps = max((rdp_to_epsilon(row, orders, delta)[0] for row in spent), default=0.0)
    return float(eps)
