"""The privacy ledger: one entry per round that touched private data.

Every round that ran — completed, or started and interrupted — is an entry, so a resumed
run never loses privacy spent; a round is never entered twice. Shared by ``fl`` (writes it)
and ``audit`` (reads it).

What an entry records, and what is never allowed to change: the values the round ran
under — its sampling rates ``q1`` (a round's first access, amplified by client sampling)
and ``q2`` (every later access), its accounted accesses ``local_steps`` (T, the WORST-CASE
accesses of that round), ``sigma``, ``delta``, the ``accountant``, the clients that were
selected (``participants``), the threat model and whether its noise was secret. The
ledger's epsilon composes these RECORDED values (never today's configuration applied to the
past), and :meth:`PrivacyLedger.load` refuses entries that disagree with each other or with
the run. :func:`ledger_digest` fingerprints the entries; a run keeps it in its private state
so that a ledger shortened or edited by hand is refused on resume.

Notions (what an epsilon protects):

* ``record-level`` (FedLAP-DP, DP-FedAvg/-FedProx, ALI-DPFL): (epsilon, delta)-DP for one
  record, composing Theorem 5.8 rounds (Wang et al. 2024, FedLAP-DP).
* ``client-level`` (DP-NormFedAvg): (epsilon, delta)-DP for a client's whole dataset, one
  SGM over clients per round.
* ``local`` (LDP-FL): pure epsilon-LDP of each uploaded weight per round
  (``round_epsilon``); ``epsilon`` is its basic composition over rounds, per weight.
* ``none``: no formal privacy; epsilon is infinite and reported as None.

Threat models (who the epsilon holds against; see ``docs/threat-model.md``):

* ``server`` (default for record- and local DP): the adversary is the server, which sees
  every upload and knows whom it selected. Client sampling amplifies nothing: a selected
  client's first access is an SGM at ``q2``, and a client's epsilon composes only the rounds
  it was selected in. The ledger reports the largest epsilon over the clients.
* ``hidden-selection``: the adversary sees the uploads (or the models) but not who was
  selected — Theorem 5.8 with its amplified ``q1``, composed over every round.
* ``trusted-server`` (client-level DP-NormFedAvg): the server sees each client's update
  in the clear and adds the noise itself; the epsilon holds against those who see the
  released models only, never against the server.

Over secure aggregation (``dp-fedavg-client --secure-aggregation``) each entry also carries
a typed :class:`~fedlap_privacy.state.secure_rounds.SecureRound` (the distributed mechanism of
the round, the shares that reached the sum, its RDP against the server):
:meth:`PrivacyLedger.server_epsilon` composes those per client, while the entry's Gaussian
fields price the outsiders' epsilon (``trusted-server``). A round secure aggregation refused
(status ``refused``) spends nothing under either.

What is released (:meth:`PrivacyLedger.released_entries`): the epsilon of
``hidden-selection`` and ``trusted-server`` uses amplification by client sampling, which
holds only if whoever it is stated for does not know who was selected. Their released
ledger (in ``ckpt.pt``) therefore withholds each round's selection: ``participants`` and
``accesses`` (the realised maximum, which reveals whether anyone was selected) are None,
and their epsilon is computed from the rates alone. The full entries stay in the run's
private state. Under ``server`` the server knows the selection anyway and the epsilon is the
largest over the clients of their own rounds, so the entries keep the participants; a
``server`` ledger that withholds them is refused (:meth:`PrivacyLedger.load`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from fedlap_privacy.accountant import (
    AccountantName,
    FedLAPSchedule,
    RoundRates,
    accountant_names,
    composed_epsilon,
)
from fedlap_privacy.errors import CheckpointError, ConfigError
from fedlap_privacy.state.secure_rounds import REFUSED, SecureRound, server_epsilon
from fedlap_privacy.vocabulary import (
    NOTION_THREAT_MODELS,
    NoiseKind,
    Notion,
    ThreatModel,
    words,
)

__all__ = ["LedgerEntry", "PrivacyLedger", "ledger_digest", "selection_withheld"]

_RTOL = 1e-6  # recorded vs recomputed epsilon


def selection_withheld(threat_model: str | None) -> bool:
    """Whether a run under ``threat_model`` withholds its selection from its release
    (:attr:`~fedlap_privacy.vocabulary.ThreatModel.hides_selection`)."""
    return threat_model in words(ThreatModel) and ThreatModel(threat_model).hides_selection


@dataclass(frozen=True)
class LedgerEntry:
    round: int
    status: str  # "completed" | "interrupted"
    notion: str  # a Notion
    threat_model: str | None  # a ThreatModel (None: notion "none")
    noise: str  # a NoiseKind
    sigma: float | None
    q1: float | None  # first access of a round, amplified by client sampling (Theorem 5.8)
    q2: float | None  # every later access (and the first one, against the server)
    local_steps: int | None  # accounted accesses per client-round (T; ALI-DPFL: tau)
    accountant: str | None
    delta: float | None
    # accesses a client actually made this round (maximum over clients); None: withheld
    accesses: int | None
    participants: tuple[int, ...] | None  # the clients selected for the round; None: withheld
    rounds_spent: int
    epsilon: float | None  # after this round, under the entry's threat model
    round_epsilon: float | None = None  # local DP: per-weight epsilon of this round
    # client level over secure aggregation: the round's distributed-DP record; its status
    # "refused" (nothing released) spends nothing (fedlap_privacy.state.secure_rounds)
    secure: SecureRound | None = None

    @property
    def clients(self) -> int | None:
        return None if self.participants is None else len(self.participants)

    @property
    def withheld(self) -> bool:
        """Whether the entry withholds the selection (its released form)."""
        return self.participants is None

    def without_selection(self) -> LedgerEntry:
        """The entry as released where the selection is hidden: no participants, no
        realised accesses, and a secure round's counts at their worst case (module docstring)."""
        secure = None if self.secure is None else self.secure.withheld()
        return dataclasses.replace(self, participants=None, accesses=None, secure=secure)

    def rates(self, selection_hidden: bool) -> RoundRates:
        assert self.q1 is not None and self.q2 is not None and self.local_steps is not None
        return RoundRates(self.q1 if selection_hidden else self.q2, self.q2, self.local_steps)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["participants"] = None if self.participants is None else list(self.participants)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LedgerEntry:
        try:
            chosen, secure = values["participants"], values.get("secure")
            entry = cls(**{**values, "participants": None if chosen is None else tuple(chosen),
                           "secure": None if secure is None else SecureRound.from_dict(secure)})
        except (TypeError, KeyError) as exc:
            raise CheckpointError(f"malformed ledger entry ({exc})") from None
        return entry


def ledger_digest(entries: list[LedgerEntry]) -> str:
    """SHA-256 of the entries' canonical JSON: changes when any entry is edited or removed."""
    text = json.dumps([e.to_dict() for e in entries], sort_keys=True, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class PrivacyLedger:
    """Ledger of a run (module docstring).

    ``schedule`` is the Theorem 5.8 schedule NEW rounds are entered with (record level: at
    the smallest client; client level: over clients); ``clients`` the number of clients K.
    """

    notion: str
    schedule: FedLAPSchedule | None = None
    sigma: float | None = None
    delta: float | None = None
    accountant: str = AccountantName.RDP.value
    round_epsilon: float | None = None
    threat_model: str | None = None
    noise: str = NoiseKind.SECRET.value
    clients: int = 1
    entries: list[LedgerEntry] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.notion not in words(Notion):
            raise ConfigError(f"privacy notion {self.notion!r} must be one of {words(Notion)}")
        self.notion = Notion(self.notion).value  # plain text in entries and checkpoints
        if self.noise not in words(NoiseKind):
            raise ConfigError(f"noise {self.noise!r} must be one of {words(NoiseKind)}")
        self.noise = NoiseKind(self.noise).value
        self.accountant = str(self.accountant)
        gaussian = Notion(self.notion).gaussian
        if gaussian and (self.sigma is None or self.delta is None):
            raise ConfigError(f"a {self.notion} ledger needs sigma and delta")
        if gaussian and self.accountant not in accountant_names():
            raise ConfigError(f"accountant {self.accountant!r} must be one of "
                              f"{accountant_names()}")
        if self.notion == Notion.LOCAL and not (self.round_epsilon and self.round_epsilon > 0):
            raise ConfigError("a local-DP ledger needs a positive per-round epsilon")
        allowed = NOTION_THREAT_MODELS[Notion(self.notion)]
        if self.threat_model is None and allowed:
            self.threat_model = allowed[0].value
        if self.threat_model not in (allowed or (None,)):
            raise ConfigError(
                f"threat model {self.threat_model!r} does not apply to {self.notion} DP "
                f"(allowed: {', '.join(allowed) or 'none'})"
            )
        if self.threat_model is not None:
            self.threat_model = ThreatModel(self.threat_model).value

    @property
    def rounds_spent(self) -> int:
        return len(self.entries)

    # ------------------------------------------------------------------ epsilon
    def epsilon_under(self, threat_model: str, extra: list[LedgerEntry] | None = None,
                      accountant: str | None = None) -> float:
        """Epsilon of the recorded rounds (plus ``extra`` ones) against ``threat_model``.

        ``server``: the largest, over clients, of the composition of the rounds the client
        was selected in, each at ``q2`` throughout (a round whose selection is withheld
        counts for every client: the worst case); ``hidden-selection`` /
        ``trusted-server``: every round at its recorded ``(q1, q2)``. ``accountant``: the
        one that composes them (default: the ledger's, the one its entries record).
        """
        entries = [e for e in self.entries + (extra or []) if e.status != REFUSED]
        if self.notion == Notion.NONE:
            return math.inf
        if self.notion == Notion.LOCAL:
            return sum(e.round_epsilon or 0.0 for e in entries)
        assert self.sigma is not None and self.delta is not None
        accountant = self.accountant if accountant is None else accountant
        if threat_model != ThreatModel.SERVER:
            rates = [e.rates(selection_hidden=True) for e in entries]
            return composed_epsilon(rates, self.sigma, self.delta, accountant)
        per_client: dict[int, list[RoundRates]] = {k: [] for k in range(self.clients)}
        for e in entries:
            for k in range(self.clients) if e.participants is None else e.participants:
                per_client.setdefault(k, []).append(e.rates(selection_hidden=False))
        distinct = {frozenset(Counter(r).items()): r for r in per_client.values()}
        counts = {key: Counter(dict(key)) for key in distinct}
        # a client whose rounds are a sub-multiset of another's spends no more (composing
        # more mechanisms never lowers the true epsilon, and the other's epsilon is an upper
        # bound on it): only the maximal clients are priced, one per distinct multiset
        maximal = [r for key, r in distinct.items()
                   if not any(counts[key] < c for c in counts.values())]
        return max(
            (composed_epsilon(r, self.sigma, self.delta, accountant) for r in maximal),
            default=0.0,
        )

    def epsilon_by_accountant(self, threat_model: str | None = None) -> dict[str, float] | None:
        """The recorded rounds' epsilon against ``threat_model`` (default: the ledger's) by
        every accountant, the ledger's first: the one that guarantees it, and the others'
        figures beside it (RDP's Theorem 5.8 is looser than PLD's; both are upper bounds of
        the same mechanism). None for a ledger without a Gaussian accountant."""
        if not Notion(self.notion).gaussian:
            return None
        threat = threat_model or self.threat_model or ThreatModel.SERVER
        names = (self.accountant, *(a for a in accountant_names() if a != self.accountant))
        return {a: self.epsilon_under(threat, accountant=a) for a in names}

    def server_epsilon(self, extra: list[LedgerEntry] | None = None) -> float:
        """Client level over secure aggregation: epsilon against the server itself, from the
        rounds' distributed-DP records (:func:`~fedlap_privacy.state.secure_rounds.server_epsilon`;
        0 without one)."""
        rounds = [(e.secure, e.participants) for e in self.entries + (extra or [])
                  if e.secure is not None]
        if not rounds or self.delta is None:
            return 0.0
        return server_epsilon(rounds, self.clients, self.delta)

    @property
    def epsilon(self) -> float:
        """Epsilon spent, against the ledger's threat model."""
        assert self.threat_model is not None or self.notion == Notion.NONE
        return self.epsilon_under(self.threat_model or ThreatModel.SERVER)

    def _entry(
        self, round_: int, accesses: int, participants: list[int] | tuple[int, ...],
        status: str, local_steps: int | None, secure: SecureRound | None = None,
    ) -> LedgerEntry:
        gaussian = Notion(self.notion).gaussian
        schedule = None
        if gaussian:
            if self.schedule is None:
                raise ConfigError("a replayed ledger has no schedule to enter new rounds with")
            steps = self.schedule.local_steps if local_steps is None else local_steps
            schedule = FedLAPSchedule(
                batch_size=self.schedule.batch_size, client_size=self.schedule.client_size,
                local_steps=steps, client_fraction=self.schedule.client_fraction,
            )
            if accesses > steps:
                raise ConfigError(
                    f"round {round_} made {accesses} accesses, more than the {steps} it is "
                    "accounted for"
                )
        bad = [k for k in participants if not 0 <= int(k) < self.clients]
        if bad:
            raise ConfigError(f"round {round_}: no client {bad[0]} in a run of {self.clients}")
        return LedgerEntry(
            round=round_, status=status, notion=self.notion, threat_model=self.threat_model,
            noise=self.noise,
            sigma=self.sigma if gaussian else None,
            q1=None if schedule is None else schedule.q1,
            q2=None if schedule is None else schedule.q2,
            local_steps=None if schedule is None else schedule.local_steps,
            accountant=self.accountant if gaussian else None,
            delta=self.delta if gaussian else None,
            accesses=accesses, participants=tuple(sorted(int(k) for k in participants)),
            rounds_spent=self.rounds_spent + 1, epsilon=None,
            round_epsilon=self.round_epsilon if self.notion == Notion.LOCAL else None,
            secure=secure,
        )

    def projected_epsilon(self, local_steps: int | None = None,
                          secure: SecureRound | None = None) -> float:
        """Epsilon if one more round with accounted T ``local_steps`` (default T) ran with
        every client selected (the worst case, whoever is drawn); with ``secure``, that
        round's record over secure aggregation, the epsilon against the server."""
        extra = self._entry(0, 0, list(range(self.clients)), "completed", local_steps, secure)
        if secure is not None:
            return self.server_epsilon([extra])
        return self.epsilon_under(self.threat_model or ThreatModel.SERVER, [extra])

    def record(
        self,
        round_: int,
        accesses: int,
        participants: list[int] | tuple[int, ...],
        status: str = "completed",
        local_steps: int | None = None,
        secure: SecureRound | None = None,
    ) -> LedgerEntry:
        """Append the round and return its entry; refuses accesses beyond the accounted T.
        ``secure``: the round's record over secure aggregation (its epsilon against the
        server after this round is filled in)."""
        entry = self._entry(round_, accesses, participants, status, local_steps, secure)
        eps = self.epsilon_under(self.threat_model or ThreatModel.SERVER, [entry])
        entry = dataclasses.replace(entry, epsilon=None if math.isinf(eps) else eps)
        if secure is not None:
            server = self.server_epsilon([entry])
            entry = dataclasses.replace(
                entry, secure=secure.with_epsilon(None if math.isinf(server) else server))
        self.entries.append(entry)
        return entry

    # ------------------------------------------------------------------ persistence
    @classmethod
    def replay(cls, entries: Any, digest: str | None = None) -> PrivacyLedger:
        """The ledger that recorded ``entries``, its epsilon recomputed from them (for an
        auditor: nothing stored is trusted). Refuses entries that disagree with each other
        or with ``digest`` (:meth:`load`). An empty list is a ledger of no round."""
        if not isinstance(entries, list):
            raise CheckpointError("the ledger is not a list of entries")
        if not entries:
            return cls(Notion.NONE)
        first = LedgerEntry.from_dict(entries[0])
        clients = 1 + max((k for e in entries if isinstance(e, dict)
                           for k in e.get("participants") or ()), default=0)
        try:
            ledger = cls(
                first.notion, None, first.sigma, first.delta,
                first.accountant or AccountantName.RDP, first.round_epsilon,
                first.threat_model, first.noise, clients,
            )
        except ConfigError as exc:
            raise CheckpointError(f"the ledger is malformed ({exc})") from None
        ledger.load(entries, digest)
        return ledger

    def to_list(self) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.entries]

    def released_entries(self) -> list[LedgerEntry]:
        """The entries as ``ckpt.pt`` releases them: without the selection where the
        threat model assumes it hidden (module docstring), else as recorded."""
        if not selection_withheld(self.threat_model):
            return list(self.entries)
        return [e.without_selection() for e in self.entries]

    def released(self) -> PrivacyLedger:
        """A copy holding the :meth:`released_entries` (its epsilon is the same)."""
        return dataclasses.replace(self, entries=self.released_entries())

    def load(self, entries: list[dict[str, Any]], digest: str | None = None) -> None:
        """Take recorded entries, refusing any that this run could not have written.

        Checks: every entry has this ledger's notion, threat model, noise, sigma, delta and
        accountant; rounds never go back and ``rounds_spent`` counts them; an entry withholds
        its selection only under a threat model that assumes it hidden (a ``server``
        epsilon needs the participants); the last recorded epsilon is what the entries
        compose to; and, when given, the ``digest`` the run's private state holds (a
        shortened or edited ledger fails it).
        """
        if not isinstance(entries, list):
            raise CheckpointError("the ledger is not a list of entries")
        loaded = [LedgerEntry.from_dict(e) for e in entries]
        gaussian = Notion(self.notion).gaussian
        expected = {
            "notion": self.notion, "threat_model": self.threat_model, "noise": self.noise,
            "sigma": self.sigma if gaussian else None,
            "delta": self.delta if gaussian else None,
            "accountant": self.accountant if gaussian else None,
        }
        previous = 0
        for i, e in enumerate(loaded):
            for key, value in expected.items():
                if getattr(e, key) != value:
                    raise CheckpointError(
                        f"ledger entry {i + 1} has {key} {getattr(e, key)!r}, the run "
                        f"{value!r}: the ledger does not belong to this run"
                    )
            if e.round < previous or e.rounds_spent != i + 1:
                raise CheckpointError(f"ledger entry {i + 1} is out of order")
            if e.secure is not None:
                e.secure.check(f"ledger entry {i + 1}")
            if (e.status == REFUSED) != (e.secure is not None and not e.secure.released):
                raise CheckpointError(f"ledger entry {i + 1} is {e.status!r} but its record "
                                      "says otherwise: only a refused secure round spends "
                                      "nothing")
            if e.withheld and not selection_withheld(self.threat_model):
                raise CheckpointError(
                    f"ledger entry {i + 1} withholds who was selected, but its epsilon "
                    f"against {self.threat_model or 'no adversary'} needs the participants"
                )
            previous = e.round
        if digest is not None and ledger_digest(loaded) != digest:
            raise CheckpointError(
                "the ledger does not match the run's private state (entries removed or edited)"
            )
        self.entries = []
        if loaded:
            recorded = loaded[-1].epsilon
            self.entries = loaded
            eps = self.epsilon
            last = loaded[-1].secure
            server = None if last is None else _finite(self.server_epsilon())
            if (recorded is None) != math.isinf(eps) or (
                recorded is not None and not math.isclose(recorded, eps, rel_tol=_RTOL)
            ) or (last is not None and last.server_epsilon is not None
                  and not _same(last.server_epsilon, server)):
                self.entries = []
                raise CheckpointError(
                    f"the ledger records epsilon {recorded}, its entries compose to {eps}"
                    + ("" if last is None else f" (against the server: recorded "
                       f"{last.server_epsilon}, composed {server})")
                )


def _finite(eps: float) -> float | None:
    return None if math.isinf(eps) else eps


def _same(a: float | None, b: float | None) -> bool:
    return (a is None) == (b is None) and (a is None or math.isclose(a, b, rel_tol=_RTOL))
