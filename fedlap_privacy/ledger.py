"""The privacy ledger: one entry per round that touched private data (SPEC 1.3, 1.5).

Every round that ran — completed, or started and interrupted — is an entry, so a resumed
run never loses privacy spent; a round is never entered twice. Shared by ``fl`` (writes it)
and ``audit`` (reads it). The notion decides what an entry's epsilon means:

* ``record-level`` (FedLAP-DP, DP-FedAvg/-FedProx, ALI-DPFL): (epsilon, delta)-DP for one
  record, composing the rounds' Theorem 5.8 schedules. Each entry carries its accounted T
  (``local_steps``, the WORST-CASE accesses of that round: fixed for most methods, ALI-DPFL's
  tau for that round); the accesses a round actually made are recorded beside it and never
  exceed it.
* ``client-level`` (DP-NormFedAvg): (epsilon, delta)-DP for a client's whole dataset, one
  SGM over clients per round (:meth:`FedLAPSchedule.client_level`).
* ``local`` (LDP-FL): pure epsilon-LDP of each uploaded weight per round
  (``round_epsilon``); ``epsilon`` is its basic composition over rounds, per weight. The
  whole upload of a client, d weights, is d x that under basic composition.
* ``none``: no formal privacy; epsilon is infinite and reported as None.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from fedlap_privacy.accountant import FedLAPSchedule, composed_epsilon
from fedlap_privacy.errors import ConfigError

__all__ = ["NOTIONS", "LedgerEntry", "PrivacyLedger"]

NOTIONS = ("record-level", "client-level", "local", "none")


@dataclass(frozen=True)
class LedgerEntry:
    round: int
    status: str  # "completed" | "interrupted"
    notion: str  # one of NOTIONS
    sigma: float | None
    q1: float | None
    q2: float | None
    local_steps: int | None  # accounted accesses per client-round (T; ALI-DPFL: tau)
    accesses: int  # accesses a client actually made this round (maximum over clients)
    clients: int  # clients that took part
    rounds_spent: int
    epsilon: float | None
    delta: float | None
    round_epsilon: float | None = None  # local DP: per-weight epsilon of this round


@dataclass
class PrivacyLedger:
    """Ledger of a run. ``schedule`` is the per-round schedule of the (epsilon, delta) notions;
    ``round_epsilon`` the per-weight, per-round epsilon of ``local``."""

    notion: str
    schedule: FedLAPSchedule | None = None
    sigma: float | None = None
    delta: float | None = None
    accountant: str = "rdp"
    round_epsilon: float | None = None
    entries: list[LedgerEntry] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.notion not in NOTIONS:
            raise ConfigError(f"privacy notion {self.notion!r} must be one of {NOTIONS}")
        gaussian = self.notion in ("record-level", "client-level")
        if gaussian and (self.schedule is None or self.sigma is None or self.delta is None):
            raise ConfigError(f"a {self.notion} ledger needs a schedule, sigma and delta")
        if self.notion == "local" and not (self.round_epsilon and self.round_epsilon > 0):
            raise ConfigError("a local-DP ledger needs a positive per-round epsilon")

    @property
    def rounds_spent(self) -> int:
        return len(self.entries)

    def _schedule(self, local_steps: int | None) -> FedLAPSchedule:
        assert self.schedule is not None
        if local_steps is None or local_steps == self.schedule.local_steps:
            return self.schedule
        return dataclasses.replace(self.schedule, local_steps=local_steps)

    def _epsilon(self, steps: list[int | None]) -> float:
        """Epsilon after rounds with these accounted T (inf when non-private)."""
        if self.notion == "none":
            return float("inf")
        if not steps:
            return 0.0
        if self.notion == "local":
            assert self.round_epsilon is not None
            return len(steps) * self.round_epsilon
        assert self.sigma is not None and self.delta is not None
        schedules = [self._schedule(t) for t in steps]
        return composed_epsilon(schedules, self.sigma, self.delta, self.accountant)

    @property
    def epsilon(self) -> float:
        return self._epsilon([e.local_steps for e in self.entries])

    def projected_epsilon(self, local_steps: int | None = None) -> float:
        """Epsilon if one more round with accounted T ``local_steps`` (default T) ran."""
        return self._epsilon([e.local_steps for e in self.entries] + [local_steps])

    def record(
        self,
        round_: int,
        accesses: int,
        clients: int,
        status: str = "completed",
        local_steps: int | None = None,
    ) -> LedgerEntry:
        """Append the round and return its entry; refuses accesses beyond the accounted T."""
        gaussian = self.notion in ("record-level", "client-level")
        schedule = self._schedule(local_steps) if gaussian else None
        if schedule is not None and accesses > schedule.local_steps:
            raise ConfigError(
                f"round {round_} made {accesses} accesses, more than the "
                f"{schedule.local_steps} it is accounted for"
            )
        eps = self.projected_epsilon(None if schedule is None else schedule.local_steps)
        entry = LedgerEntry(
            round=round_,
            status=status,
            notion=self.notion,
            sigma=self.sigma if gaussian else None,
            q1=None if schedule is None else schedule.q1,
            q2=None if schedule is None else schedule.q2,
            local_steps=None if schedule is None else schedule.local_steps,
            accesses=accesses,
            clients=clients,
            rounds_spent=self.rounds_spent + 1,
            epsilon=None if eps == float("inf") else eps,
            delta=self.delta if gaussian else None,
            round_epsilon=self.round_epsilon if self.notion == "local" else None,
        )
        self.entries.append(entry)
        return entry

    def to_list(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.entries]

    def load(self, entries: list[dict[str, Any]]) -> None:
        self.entries = [LedgerEntry(**e) for e in entries]
