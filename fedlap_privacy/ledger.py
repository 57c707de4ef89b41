"""The privacy ledger: one entry per round that touched private data (SPEC 1.3).

Every round that ran — completed, or started and interrupted — is an entry, so a resumed
run never loses privacy spent; a round is never entered twice. Epsilon after an entry is the
accountant's Theorem 5.8 epsilon for the number of rounds spent so far, with the WORST-CASE
number of accesses per round ``local_steps`` (the accesses a round actually made are
recorded beside it and never exceed it). Shared by ``fl`` (writes it) and ``audit`` (reads it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fedlap_privacy.accountant import FedLAPSchedule, epsilon
from fedlap_privacy.errors import ConfigError

__all__ = ["LedgerEntry", "PrivacyLedger"]


@dataclass(frozen=True)
class LedgerEntry:
    round: int
    status: str  # "completed" | "interrupted"
    notion: str  # "record-level" | "none"
    sigma: float | None
    q1: float | None
    q2: float | None
    local_steps: int | None  # worst-case accesses per client-round used for accounting
    accesses: int  # accesses a client actually made this round (maximum over clients)
    clients: int  # clients that took part
    rounds_spent: int
    epsilon: float | None
    delta: float | None


@dataclass
class PrivacyLedger:
    """Record-level DP ledger of a run (``schedule`` None: a non-private run, epsilon inf)."""

    schedule: FedLAPSchedule | None
    sigma: float | None
    delta: float | None
    accountant: str = "rdp"
    entries: list[LedgerEntry] = field(default_factory=list)

    @property
    def notion(self) -> str:
        return "none" if self.schedule is None else "record-level"

    @property
    def rounds_spent(self) -> int:
        return len(self.entries)

    def epsilon_after(self, rounds: int) -> float:
        """Epsilon once ``rounds`` rounds in all have touched private data (inf if non-private)."""
        if self.schedule is None or self.sigma is None or self.delta is None:
            return float("inf")
        if rounds == 0:
            return 0.0
        return epsilon(self.schedule, self.sigma, rounds, self.delta, self.accountant)

    @property
    def epsilon(self) -> float:
        return self.epsilon_after(self.rounds_spent)

    def record(self, round_: int, accesses: int, clients: int, status: str = "completed"):
        """Append the round and return its entry; refuses accesses beyond the accounted T."""
        if self.schedule is not None and accesses > self.schedule.local_steps:
            raise ConfigError(
                f"round {round_} made {accesses} accesses, more than the "
                f"{self.schedule.local_steps} it is accounted for"
            )
        spent = self.rounds_spent + 1
        eps = self.epsilon_after(spent)
        entry = LedgerEntry(
            round=round_,
            status=status,
            notion=self.notion,
            sigma=self.sigma,
            q1=None if self.schedule is None else self.schedule.q1,
            q2=None if self.schedule is None else self.schedule.q2,
            local_steps=None if self.schedule is None else self.schedule.local_steps,
            accesses=accesses,
            clients=clients,
            rounds_spent=spent,
            epsilon=None if eps == float("inf") else eps,
            delta=self.delta,
        )
        self.entries.append(entry)
        return entry

    def to_list(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.entries]

    def load(self, entries: list[dict[str, Any]]) -> None:
        self.entries = [LedgerEntry(**e) for e in entries]
