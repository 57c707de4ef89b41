"""A SuperNode's own privacy ledger: every answer it gave, persistent, composed exactly.

Contract (docs/threat-model.md, "Cross-silo deployment"):

* one file per Flower run id in the node's state folder (node config ``state-dir``; default
  ``$FLWR_HOME/fedlap-node`` or ``~/.flwr/fedlap-node``), written atomically (mode 0600,
  :func:`fedlap_privacy.state.atomic.write_text_atomic`); its entries are
  :class:`~fedlap_privacy.state.ledger.LedgerEntry` records of a one-client
  :class:`~fedlap_privacy.state.ledger.PrivacyLedger` whose rates come from the node's OWN N_k and
  the instructed batch size (q = B / N_k: against the server, client sampling amplifies
  nothing), at the node's delta and accountant (PLD by default, the same as the in-process
  engine's; a run the node already answered keeps the accountant its entries record, so a
  policy changed between rounds never re-prices them; a method without such a guarantee, admitted
  only by a node that trusts the server, gets a ledger of notion "none": replays are still
  refused, no budget applies); an LDP-FL run, admitted only by a node that names it, gets a
  ledger of notion "local" (per-weight epsilon, basic composition over rounds); a client-level
  run over secure aggregation, a client-level ledger whose entries carry the round's record
  against the server at its fewest shares (``client-epsilon``: the node adds its own noise);
* :meth:`NodeLedger.admit` refuses, without writing anything: a round number already
  answered or not after the last one (a replay), an instruction that changes the run's
  configuration (anything but ``rounds``) or the node's records within a run, and a round
  whose projected epsilon — this run's composition with the round at its full T, plus the
  epsilon of every earlier run of the SAME notion on the same records (basic composition
  across runs: their deltas add too) — exceeds the node's budget for that notion
  (:meth:`NodePolicy.budget`: ``epsilon`` for record-level, ``local-epsilon`` for local DP);
  one notion's epsilon is never charged against another's budget;
* :meth:`NodeLedger.record` enters an admitted round at its full T and persists it BEFORE
  the node touches its data, so an answer that crashes half-way is still counted.
"""

from __future__ import annotations

import hmac
import json
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlap_privacy.accountant import FedLAPSchedule
from fedlap_privacy.errors import CheckpointError, ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.flower.policy import PRICING, SECURE_PRICING, NodePolicy, PolicyRefusal
from fedlap_privacy.state.atomic import write_text_atomic
from fedlap_privacy.state.ledger import PrivacyLedger, ledger_digest
from fedlap_privacy.state.secure_rounds import SecureRound
from fedlap_privacy.vocabulary import Notion, ThreatModel

__all__ = ["FORMAT", "NODE_STATE", "NodeLedger", "check_state_root", "default_state_dir",
           "mark_state_root"]

FORMAT = "fedlap-node-ledger/1"
#: the folder of a run folder where the nodes this package starts (``--engine flower`` on
#: this machine, ``flower-simulation``'s virtual nodes wherever Ray runs them) keep their
#: state folders ``node-K``: a resumed run's nodes find their ledgers, so a node's budget
#: spans the whole run
NODE_STATE = "flower-nodes"
#: the file of :data:`NODE_STATE` naming the launch that uses it (:func:`mark_state_root`)
LAUNCH_MARK = ".launch"


def mark_state_root(root: Path) -> str:
    """Create the state root ``root`` (mode 0700) and write a new token for this launch into
    it: the token :func:`check_state_root` expects. Virtual nodes (Flower's Simulation
    Engine) have no machine of their own (Ray runs node k wherever an actor is free), so
    their ledgers live in the run folder, and the token proves that a node sees the run
    folder itself (not a same-named folder of another machine)."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_hex(16)
    write_text_atomic(root / LAUNCH_MARK, token)
    return token


def check_state_root(root: Path, token: str) -> None:
    """Refuse (one line) a state root that does not hold this launch's token: the node runs
    where the run folder is not (a Ray node of a cluster without a file system shared with
    this machine), and a ledger kept anywhere else would forget its rounds."""
    try:
        seen = (root / LAUNCH_MARK).read_text()
    except OSError:
        seen = ""
    if not hmac.compare_digest(seen.encode(), token.encode()):  # no timing hint
        raise ConfigError(f"this node does not see the run's node ledgers in {root}: the run "
                          "folder must be on a file system every Ray node shares")


def default_state_dir() -> Path:
    """``$FLWR_HOME/fedlap-node``, else ``~/.flwr/fedlap-node``."""
    home = os.environ.get("FLWR_HOME")
    return (Path(home) if home else Path.home() / ".flwr") / "fedlap-node"


def _pinned(cfg: TrainConfig) -> dict[str, Any]:
    """The configuration a run may not change between rounds (``rounds`` may grow)."""
    return {k: v for k, v in cfg.to_dict().items() if k != "rounds"}


@dataclass
class NodeLedger:
    """The node's ledger of one run (module docstring)."""

    path: Path
    run_id: int
    partition: int
    content_hash: str
    size: int  # N_k when the run's first round was answered
    config: dict[str, Any]
    ledger: PrivacyLedger

    @classmethod
    def open(cls, state_dir: Path, run_id: int, partition: int, content_hash: str,
             size: int, cfg: TrainConfig, policy: NodePolicy) -> NodeLedger:
        """The run's ledger (empty when the node never answered it). Read-only."""
        path = state_dir / f"run-{int(run_id)}.json"
        ledger = _new_ledger(cfg, size, policy)
        if not path.exists():
            return cls(path, run_id, partition, content_hash, size, _pinned(cfg), ledger)
        saved = _read(path)
        recorded = next((e.get("accountant") for e in saved["entries"]
                         if isinstance(e, dict) and e.get("accountant")), None)
        node = cls(path, run_id, int(saved["partition"]), str(saved["content_hash"]),
                   int(saved["size"]), dict(saved["config"]), _new_ledger(
                       TrainConfig.from_recorded({**saved["config"], "rounds": cfg.rounds}),
                       int(saved["size"]), policy, recorded))
        try:
            node.ledger.load(saved["entries"], saved["digest"])
        except CheckpointError as exc:
            raise ConfigError(f"node ledger {path}: {exc}") from None
        return node

    @property
    def last_round(self) -> int:
        return self.ledger.entries[-1].round if self.ledger.entries else 0

    def admit(self, round_: int, cfg: TrainConfig, partition: int, content_hash: str,
              steps: int, policy: NodePolicy, secure: SecureRound | None = None) -> float:
        """Refuse (:class:`PolicyRefusal`) or return the projected epsilon of this run
        (``secure``: the round's record over secure aggregation, at its fewest shares: the
        epsilon against the server, charged to ``client-epsilon``)."""
        run = f"run {self.run_id}"
        if round_ <= self.last_round:
            what = "already answered" if any(e.round == round_ for e in self.ledger.entries) \
                else f"not after round {self.last_round}, the last one answered"
            raise PolicyRefusal(f"round {round_} is {what} in {run} (a replay)")
        if partition != self.partition or content_hash != self.content_hash:
            raise PolicyRefusal(f"this node's records changed within {run}")
        changed = sorted(k for k, v in _pinned(cfg).items() if self.config.get(k) != v)
        if changed:
            k = changed[0]
            raise PolicyRefusal(f"the instruction changes {k.replace('_', '-')} within {run} "
                                f"(was {self.config.get(k)!r}, now {getattr(cfg, k)!r})")
        steps = 1 if secure is not None else steps  # client level: one release a round
        self._reschedule(steps)
        budget = policy.budget(self.ledger.notion, secure is not None)
        if budget is None:
            return math.inf  # no guarantee to budget: the node's policy trusts the server
        projected = self.ledger.projected_epsilon(steps, secure)
        earlier = self.earlier_epsilon(secure is not None)
        if projected + earlier > budget:
            spent = f"this run {projected:.4g}" + (f" + earlier runs {earlier:.4g}"
                                                   if earlier else "")
            what = "epsilon" if self.ledger.notion == Notion.RECORD else (
                f"{self.ledger.notion} epsilon")
            key = (SECURE_PRICING if secure else PRICING[Notion(self.ledger.notion)]).budget
            raise PolicyRefusal(f"round {round_} would spend {what} {projected + earlier:.4g} "
                                f"({spent}), above the node's budget {budget:g} ({key})")
        return projected

    def _reschedule(self, steps: int) -> None:
        schedule = self.ledger.schedule
        if schedule is not None:
            self.ledger.schedule = FedLAPSchedule(
                batch_size=schedule.batch_size, client_size=schedule.client_size,
                local_steps=steps, client_fraction=1.0)

    def earlier_epsilon(self, secure: bool = False) -> float:
        """Epsilon of the node's other runs of this run's notion on the same records (basic
        composition; a run of another notion is another budget's; ``secure``: the client-level
        runs over secure aggregation, by their epsilon against the server)."""
        total = 0.0
        for other in sorted(self.path.parent.glob("run-*.json")):
            if other == self.path:
                continue
            saved = _read(other)
            last = saved["entries"][-1] if saved["entries"] else None
            if (saved["content_hash"] != self.content_hash or not last
                    or last["notion"] != self.ledger.notion or last["notion"] == Notion.NONE
                    or (last.get("secure") is not None) != secure):
                continue
            eps = last["secure"]["server_epsilon"] if secure else last["epsilon"]
            total += math.inf if eps is None else float(eps)
        return total

    def record(self, round_: int, steps: int, secure: SecureRound | None = None) -> None:
        """Enter an admitted round at its full T (``secure``: its record at its fewest
        shares) and persist the ledger (before training)."""
        steps = 1 if secure is not None else steps  # client level: one release a round
        self._reschedule(steps)
        self.ledger.record(round_, steps, [0], local_steps=steps, secure=secure)
        entries = self.ledger.to_list()
        write_text_atomic(self.path, json.dumps({
            "format": FORMAT, "run_id": self.run_id, "partition": self.partition,
            "content_hash": self.content_hash, "size": self.size, "config": self.config,
            "entries": entries, "digest": ledger_digest(self.ledger.entries),
        }, allow_nan=True))


def _read(path: Path) -> dict[str, Any]:
    try:
        saved = json.loads(path.read_text())
        if saved.get("format") != FORMAT:
            raise ValueError(f"format {saved.get('format')!r}")
        return saved
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"node ledger {path} is unreadable ({exc})") from None


def _new_ledger(cfg: TrainConfig, size: int, policy: NodePolicy,
                accountant: str | None = None) -> PrivacyLedger:
    """A one-client ledger at the node's N_k, delta and accountant (module docstring;
    ``accountant``: the one a saved run's entries record, which it keeps)."""
    noise = cfg.noise
    if cfg.notion == Notion.LOCAL:
        return PrivacyLedger(Notion.LOCAL, round_epsilon=cfg.ldp_epsilon, noise=noise, clients=1)
    if cfg.notion == Notion.CLIENT and cfg.secure_aggregation and cfg.sigma is not None:
        # over secure aggregation: each entry carries the round's record against the server
        return PrivacyLedger(Notion.CLIENT, FedLAPSchedule.client_level(1), cfg.sigma,
                             policy.delta, accountant or policy.accountant,
                             threat_model=ThreatModel.TRUSTED_SERVER, noise=noise, clients=1)
    if cfg.notion != Notion.RECORD or cfg.sigma is None:  # admitted by a trusting node
        return PrivacyLedger(Notion.NONE, noise=noise, clients=1)
    if cfg.batch_size > size:
        raise PolicyRefusal(f"batch size {cfg.batch_size} is larger than the node's "
                            f"{size} records")
    schedule = FedLAPSchedule(batch_size=cfg.batch_size, client_size=size,
                              local_steps=cfg.accesses_per_round, client_fraction=1.0)
    return PrivacyLedger(Notion.RECORD, schedule, cfg.sigma, policy.delta,
                         accountant or policy.accountant, threat_model=ThreatModel.SERVER,
                         noise=noise, clients=1)
