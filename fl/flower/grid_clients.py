"""The ``ask_clients`` step of :func:`simulation.train` over a Flower Grid.

Contract: the round loop, client selection, the privacy ledger and its ``round.pending``
marker, evaluation and checkpoints are the simulator's; :class:`FlowerClients` replaces only
its ``ask_clients`` step. It reads the run only through
:class:`RunView` (configuration, device, global model) and writes no ledger entry itself:
a round that fails is entered by the simulator's own :meth:`enter_interrupted` from the
``round.pending`` marker (full accounted T, every selected client), so privacy spent is
never under-counted. A selected client that refuses (its policy, :mod:`.policy`), does not
answer, or answers for another partition or with other records than it reported at
discovery fails the round with one line naming the client and the reason.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from flwr.app import DEFAULT_TTL, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from torch import nn

from fedlap_privacy.compute.threads import follow_load
from fedlap_privacy.data.datasets import Dataset, load_dataset, partition_hash
from fedlap_privacy.errors import FedlapError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.events import Callback, ClientDone
from fedlap_privacy.fl.engine.simulation import client_parts
from fedlap_privacy.fl.flower.codec import pack, pack_into, unpack
from fedlap_privacy.fl.flower.node_model import MODEL_RECORD, ModelShape
from fedlap_privacy.fl.flower.partition import SIMULATED
from fedlap_privacy.fl.flower.run_config import config_values
from fedlap_privacy.fl.flower.secure_node import SECURE_RECORD, UNMASK, UPLOAD_RECORD
from fedlap_privacy.fl.methods.interface import Reply, RoundInfo
from fedlap_privacy.fl.run.user_runs import prepare_data
from fedlap_privacy.fl.secure_sum.encoding import SecureSumSpec
from fedlap_privacy.fl.secure_sum.masking import Answer
from fedlap_privacy.fl.secure_sum.training import MaskedRound, SecurePlan, round_spec
from fedlap_privacy.vocabulary import NoiseKind

__all__ = [
    "ClientFailure", "Expected", "FlowerClients", "FlowerError", "NodeInfo", "RunView",
    "expected_partitions", "instruction_config", "model_shape", "run_data",
]

_POLL = 0.2  # seconds between two pulls of replies


class FlowerError(FedlapError):
    """The Flower deployment or run failed (one line, printed by the CLI)."""


class ClientFailure(FlowerError):
    """Selected clients refused or did not answer a round (the round is in the ledger as
    interrupted)."""


class RunView(Protocol):
    """What :class:`FlowerClients` reads of the simulator's run (and the one call it makes);
    over secure aggregation it hands the round's masked uploads to ``masked_round``."""

    cfg: TrainConfig
    split_seed: int
    device: torch.device
    model: nn.Module
    data: Dataset
    out: Path | None
    secure: SecurePlan | None
    masked_round: MaskedRound | None

    def enter_interrupted(self) -> None: ...


@dataclass(frozen=True)
class Expected:
    """What the server expects of partition k: its size and, for a simulated split, the hash
    of its records (the server computed the same split)."""

    size: int
    content_hash: str


@dataclass(frozen=True)
class NodeInfo:
    """A SuperNode's answer at discovery (public metadata, pinned for the whole run)."""

    node_id: int
    size: int
    content_hash: str
    source: str
    secure_key: bytes | None = None  # its X25519 public key (a secure_aggregation run)


def reason_of(msg: Message) -> str:
    """One line saying why a reply is an error."""
    text = (msg.error.reason or "").strip().splitlines()
    last = [line for line in text if line.strip()]
    reason = last[-1].strip() if last else f"error code {msg.error.code}"
    if "node_unavail" in reason or "unavail" in reason.lower():
        return "its SuperNode is unavailable (stopped sending heartbeats)"
    return reason[:300]


def _refusal(msg: Message) -> str | None:
    """The node's refusal (a ``refusal`` record: its policy said no), or None."""
    rec = msg.content.config_records.get("refusal") if not msg.has_error() else None
    return None if rec is None else str(rec["reason"])[:300]


def _secure_key(cfg: TrainConfig, rec: ConfigRecord, k: int) -> bytes | None:
    """Partition k's public key from its discovery answer (a secure_aggregation run)."""
    if cfg.secure_aggregation is None:
        return None
    key = rec.get("secure-key")
    if not isinstance(key, bytes) or len(key) != 32:
        raise FlowerError(f"client {k} sent no X25519 public key for the run's secure sums")
    return key


def _upload(msg: Message, spec: SecureSumSpec) -> np.ndarray | str:
    """A masked upload, or why the reply holds none of the round's size."""
    rec = msg.content.config_records.get(UPLOAD_RECORD)
    data = None if rec is None else rec.get("masked")
    size = spec.mechanism.quantisation.dim
    if not isinstance(data, bytes) or len(data) != 8 * size:
        return "no masked upload of the round's size"
    masked = np.frombuffer(data, dtype="<u8").astype(np.uint64)
    if masked.max(initial=0) >= spec.modulus:
        return "a masked upload outside the modulus"
    return masked


def run_data(cfg: TrainConfig, split_seed: int | None = None) -> tuple[TrainConfig, Dataset]:
    """The run's dataset as the simulator loads it: a built-in one, or the user's records
    of ``cfg.data`` (:func:`fedlap_privacy.fl.run.user_runs.prepare_data`; with a natural
    partition, ``clients`` becomes its number of clients)."""
    if cfg.data is None:
        return cfg, load_dataset(cfg.dataset, cfg.data_dir)
    seed = split_seed if split_seed is not None else cfg.split_seed
    if seed is None:
        raise FlowerError("a run on a user's records needs its split seed to find the "
                          "partitions")
    return prepare_data(cfg, seed)


def expected_partitions(cfg: TrainConfig, split_seed: int | None = None,
                        data: Dataset | None = None) -> list[Expected]:
    """Each partition's size and content hash under the run's split (as the simulator's;
    ``split_seed``: the run's, when ``cfg`` sets none; ``data``: the run's dataset, when
    the caller has it from :func:`run_data`)."""
    if data is None:
        cfg, data = run_data(cfg, split_seed)
    return [Expected(len(p), partition_hash(p, data.x_train, data.y_train))
            for p in client_parts(cfg, data, split_seed)]


def model_shape(data: Dataset) -> ModelShape:
    """The public shape of the run's model on ``data`` (sent with every instruction)."""
    return ModelShape(tuple(data.input_shape), int(data.num_classes))


def instruction_config(cfg: TrainConfig, split_seed: int) -> TrainConfig:
    """The configuration the nodes are sent: the run's, with its split seed, from which a
    simulated-split node recomputes its records (one machine, one owner); a node with its
    own data file has no use for it. Never written into the releasable checkpoint."""
    return dataclasses.replace(cfg, split_seed=split_seed)


@dataclass
class FlowerClients:
    """The ``ask_clients`` of :func:`simulation.train` over a Flower Grid (module doc)."""

    grid: Grid
    round_timeout: float = 0.0
    allow_failures: bool = False
    node_wait: float = 120.0
    log: Callable[[str], None] = print
    nodes: dict[int, NodeInfo] = field(default_factory=dict)  # partition -> its node

    def _pull(self, waiting: dict[str, int], got: dict[int, Message]) -> None:
        for reply in self.grid.pull_messages(list(waiting)):
            i = waiting.pop(reply.metadata.reply_to_message_id, None)
            if i is not None:
                got[i] = reply

    def _collect(self, messages: list[Message], timeout: float) -> dict[int, Message]:
        """Push ``messages``; pull replies until all arrived or ``timeout`` s (0: no limit)."""
        ids = list(self.grid.push_messages(messages))
        deadline = None if timeout <= 0 else time.monotonic() + timeout
        waiting = {mid: i for i, mid in enumerate(ids) if mid}
        got: dict[int, Message] = {}
        while waiting and (deadline is None or time.monotonic() < deadline):
            self._pull(waiting, got)
            if waiting:
                time.sleep(_POLL)
        return got

    def discover(self, cfg: TrainConfig, expected: list[Expected],
                 shape: ModelShape | None = None) -> None:
        """Map partition k -> the SuperNode holding it; pin its size and content hash.

        Asks every connected node (and nodes that join later) until each partition answered
        or ``node_wait`` seconds passed. A simulated-split node must hold exactly the
        server's partition; a node with its own data file at least as many records as the
        smallest partition the server's ledger accounts with (fewer would be under-counted).
        With ``shape`` (the run's model, :func:`model_shape`), each node checks its records
        and its model factory against it now, and refuses the run rather than round 1.
        """
        content = RecordDict({"config": ConfigRecord(config_values(cfg))})
        if shape is not None:
            content[MODEL_RECORD] = shape.to_record()
        deadline = time.monotonic() + self.node_wait
        asked: list[int] = []
        waiting: dict[str, int] = {}
        got: dict[int, Message] = {}
        found: dict[int, NodeInfo] = {}
        errors: list[str] = []
        while len(found) < cfg.clients and time.monotonic() < deadline:
            new = [n for n in self.grid.get_node_ids() if n not in asked]
            if new:
                msgs = [Message(content, n, "query", ttl=self.node_wait) for n in new]
                ids = list(self.grid.push_messages(msgs))
                waiting.update({mid: len(asked) + i for i, mid in enumerate(ids) if mid})
                asked.extend(new)
            self._pull(waiting, got)
            for i in list(got):
                reply, node = got.pop(i), asked[i]
                if reply.has_error():
                    errors.append(f"node {node}: {reason_of(reply)}")
                    continue
                refusal = _refusal(reply)
                if refusal is not None:
                    rec = reply.content.config_records["refusal"]
                    who = (f"client {rec['partition-id']}" if "partition-id" in rec
                           else f"node {node}")
                    raise FlowerError(f"{who} refused the run: {refusal}")
                rec = reply.content.config_records["node"]
                k = int(rec["partition-id"])
                info = NodeInfo(node, int(rec["num-examples"]), str(rec["content-hash"]),
                                str(rec["source"]), _secure_key(cfg, rec, k))
                if k in found and found[k].node_id != node:
                    raise FlowerError(f"two SuperNodes hold partition {k}: give each its own "
                                      "partition-id")
                found[k] = info
            if len(found) < cfg.clients:
                time.sleep(_POLL)
        missing = [k for k in range(cfg.clients) if k not in found]
        if missing:
            detail = f" ({'; '.join(errors)})" if errors else ""
            raise FlowerError(
                f"no SuperNode answered for partition(s) {', '.join(map(str, missing))} within "
                f"{self.node_wait:g} s: start one flower-supernode per client with "
                f"--node-config 'partition-id=K num-partitions={cfg.clients}'{detail}"
            )
        smallest = min(e.size for e in expected)
        for k, info in sorted(found.items()):
            if info.source == SIMULATED and info.size != expected[k].size:
                raise FlowerError(f"the SuperNode of partition {k} holds {info.size} records, "
                                  f"the run's split gives {expected[k].size}: check its dataset "
                                  "and data-dir")
            if info.source == SIMULATED and info.content_hash != expected[k].content_hash:
                raise FlowerError(f"the SuperNode of partition {k} holds other records than "
                                  "the run's split: check its dataset and data-dir")
            if info.size < smallest:
                raise FlowerError(f"the SuperNode of partition {k} holds {info.size} records, "
                                  f"fewer than the {smallest} the server's ledger accounts with")
        self.nodes = dict(sorted(found.items()))
        self.log("partitions -> SuperNodes: " + ", ".join(
            f"{k}: node {i.node_id} ({i.size} records, {i.source}, "
            f"sha256 {i.content_hash[:12]})" for k, i in self.nodes.items()))

    def _reply(self, k: int, m: int, msg: Message | None, device: torch.device) -> Reply | str:
        """Client k's Reply, or the one-line reason it failed round m."""
        if msg is None:
            return f"client {k} did not answer within {self.round_timeout:g} s"
        if msg.has_error():
            return f"client {k}: {reason_of(msg)}"
        refusal = _refusal(msg)
        if refusal is not None:
            return f"client {k} refused round {m}: {refusal}"
        rec = msg.content.config_records["reply"]
        if int(rec["partition-id"]) != k:
            return f"client {k}: answered for partition {rec['partition-id']}"
        if str(rec["content-hash"]) != self.nodes[k].content_hash:
            return (f"client {k}: its records changed since discovery (content hash "
                    f"{str(rec['content-hash'])[:12]}, pinned {self.nodes[k].content_hash[:12]})")
        payload = {} if UPLOAD_RECORD in msg.content.config_records else unpack(
            msg.content, "payload", device)
        return Reply(payload, int(rec["accesses"]), int(rec["num-examples"]),
                     json.loads(str(rec["stats"])))

    def __call__(
        self, run: RunView, m: int, chosen: list[int], info: RoundInfo, callback: Callback
    ) -> list[Reply]:
        """Send round m to the nodes of ``chosen``; their replies, in the order of ``chosen``."""
        if not chosen:
            return []
        content = pack("extras", info.extras)
        pack_into(content, "weights", dict(run.model.state_dict()))
        content["round"] = ConfigRecord({"round": m, "rounds": info.rounds, "lr": float(info.lr)})
        content[MODEL_RECORD] = model_shape(run.data).to_record()
        content["config"] = ConfigRecord(config_values(instruction_config(run.cfg,
                                                                          run.split_seed)))
        spec = None if run.secure is None else round_spec(run.secure)
        if spec is not None:  # the peers' keys as discovered, the public rotation seed
            content[SECURE_RECORD] = ConfigRecord({
                "peers": list(chosen), "rotation-seed": spec.rotation_seed,
                "keys": [self.nodes[k].secure_key or b"" for k in chosen]})
        ttl = DEFAULT_TTL if self.round_timeout <= 0 else self.round_timeout + 30.0
        messages = [Message(content, self.nodes[k].node_id, "train", ttl=ttl, group_id=str(m))
                    for k in chosen]
        got = self._collect(messages, self.round_timeout)
        replies: list[Reply] = []
        failed: list[str] = []
        uploads: dict[int, np.ndarray] = {}
        for i, k in enumerate(chosen):
            answer = self._reply(k, m, got.get(i), run.device)
            if isinstance(answer, str):
                failed.append(answer)
                continue
            if spec is not None:
                masked = _upload(got[i], spec)
                if isinstance(masked, str):
                    failed.append(f"client {k}: {masked}")
                    continue
                uploads[k] = masked
            replies.append(answer)
            callback(ClientDone(m, k))
        if spec is not None:
            assert run.secure is not None
            server = run.secure.sum_server()
            for k, masked in uploads.items():
                server.receive(k, masked)
            run.masked_round = MaskedRound(
                spec, server, lambda alive: self._reveal(m, alive, ttl), len(chosen))
        if failed:
            self._on_failure(run, m, chosen, failed, replies)
        if run.cfg.noise != NoiseKind.SEEDED:  # a seeded run keeps its threads (bit for bit)
            follow_load(fresh=True)  # the server's step: the nodes are done with the cores
        return replies

    def _reveal(self, m: int, alive: frozenset[int], ttl: float) -> dict[int, Answer]:
        """Ask the survivors of round m to unmask (``query.unmask``); the answers that came."""
        request = RecordDict({UNMASK: ConfigRecord({"round": m, "survivors": sorted(alive)})})
        order = sorted(alive)
        got = self._collect([Message(request, self.nodes[k].node_id, f"query.{UNMASK}", ttl=ttl,
                                     group_id=str(m)) for k in order], self.round_timeout)
        answers: dict[int, Answer] = {}
        for i, k in enumerate(order):
            msg = got.get(i)
            if msg is None or msg.has_error() or UNMASK not in msg.content.config_records:
                reason = ("no answer" if msg is None else reason_of(msg) if msg.has_error()
                          else _refusal(msg))
                self.log(f"round {m}: client {k} did not unmask ({reason})")
                continue
            rec = msg.content.config_records[UNMASK]
            try:
                dropped = dict(zip((int(j) for j in rec["dropped"]),
                                   (bytes(x) for x in rec["pair-seeds"]), strict=True))
                answers[k] = (bytes(rec["self-seed"]), dropped)
            except (KeyError, TypeError, ValueError):
                self.log(f"round {m}: client {k} answered the unmasking malformed")
        return answers

    def _on_failure(self, run: RunView, m: int, chosen: list[int], failed: list[str],
                    replies: list[Reply]) -> None:
        """Fail the round (the simulator enters it as interrupted at its full T) unless
        failures are allowed and someone answered."""
        what = "; ".join(failed)
        if self.allow_failures and replies:
            self.log(f"round {m}: continuing with {len(replies)} of {len(chosen)} clients "
                     f"({what}); the ledger counts the round for all {len(chosen)}")
            return
        if run.out is not None:
            run.enter_interrupted()
        hint = "" if self.allow_failures else (
            "; pass --allow-client-failures (run config allow-client-failures=true) to continue "
            "with the clients that answer"
        )
        raise ClientFailure(f"round {m} failed: {what}; the round is in the ledger as "
                            f"interrupted{hint}")
