"""The Flower driver: the same training as :mod:`~fedlap_privacy.fl.simulation`, across machines.

One implementation, two drivers. The ServerApp runs :func:`simulation.train` (or
:func:`simulation.resume`) unchanged — the round loop, client selection, generators, the
privacy ledger and its ``round.pending`` marker, evaluation and checkpoints are those of the
in-process simulator — and replaces only its ``ask_clients`` step: instead of calling
:meth:`Method.client` in-process, :class:`FlowerClients` sends each selected client k a Flower
``train`` message (global weights + :class:`RoundInfo`) to the SuperNode holding partition
k, and turns the answers back into :class:`Reply` objects. The ClientApp on that SuperNode
runs the very same :meth:`Method.client` (FedLAP-DP's local approximation, SPEC 2.1, or a
baseline's local training, SPEC 3) on its partition, with the generator the simulator would
use for (seed, round, k), and keeps the method's node-local state (FedLAP's synthetic set,
SCAFFOLD's control variate) in the node's ``context.state`` across rounds. Tensors travel
as numpy arrays (float32 exact), so a Flower run on the CPU equals the simulator's run
with the same seed.

Partition k of a SuperNode comes from its node config (``partition-id``,
``num-partitions``); the node computes it with :func:`fedlap_privacy.data.split_clients`
from the run's dataset, split and seed, exactly as the simulator. Before round 1 the server
asks every node which partition it holds and how many records (public metadata, N_k) and
refuses to start unless every partition is held by exactly one node with the size the
server's split expects.

Privacy bookkeeping (SPEC 1.3): the simulator's ``round.pending`` marker is written before
any message of a round is sent, so a ServerApp that dies mid-round leaves a round that
``resume`` enters in the ledger. A selected client that does not answer (its SuperNode
died, Flower reports it unavailable, its ClientApp raised, or ``round-timeout`` passed)
fails the round by default: the round is entered in the ledger as ``interrupted`` at its
full accounted T (the client may have touched its data before dying), the checkpoint is
saved, and the run stops with a one-line message. With ``allow-client-failures`` the round
continues with the replies that arrived; the ledger still counts it at its full accounted
T with every selected client (``clients``), while ``replies`` in metrics.jsonl says how many
answered. Privacy spent is never under-counted.

Run configuration: every :class:`TrainConfig` field under its kebab-case name
(``target-eps``, ``batch-size``; ``""`` stands for None) plus the driver's keys in
:data:`DRIVER_DEFAULTS`. :func:`write_app` writes the Flower App directory (its
``pyproject.toml``) that ``flwr run`` needs; ``python -m fedlap_privacy.fl.flower_app DIR``
does the same from the shell. :func:`run_flower` starts a local deployment (SuperLink and N
SuperNodes on 127.0.0.1), runs the app and tears everything down: it is
``fedlap-privacy train --engine flower``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import DEFAULT_TTL, Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from torch import Tensor

from fedlap_privacy.atomic import write_text_atomic
from fedlap_privacy.data import Dataset, load_dataset
from fedlap_privacy.errors import ConfigError, FedlapError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.methods import Reply, RoundInfo, build_method
from fedlap_privacy.fl.randomness import dp_generator
from fedlap_privacy.fl.run_files import (
    METRICS,
    PENDING,
    check_new_run_dir,
    load_run_config,
)
from fedlap_privacy.fl.simulation import (
    Callback,
    _Run,
    client_parts,
    default_model_config,
    resolve_device,
    resume,
    train,
)
from fedlap_privacy.models import build_model

__all__ = [
    "DRIVER_DEFAULTS", "STATUS", "ClientFailure", "FlowerClients", "FlowerError",
    "FlowerResult", "LocalDeployment", "client_app", "config_from_run_config", "decode_state",
    "encode_state", "run_config_of", "run_flower", "run_on", "server_app", "write_app",
]

#: written by the ServerApp into the output directory when it ends: {"status", "summary"|"error"}
STATUS = "flower-status.json"
#: the driver's own run-config keys (beside TrainConfig's) and their defaults
DRIVER_DEFAULTS: dict[str, Any] = {
    "out": "runs/flower",  # on the SuperLink's machine; relative to where it was started
    "device": "auto",  # the server's device (evaluation, global optimisation)
    "round-timeout": 0.0,  # seconds to wait for the selected clients; 0: no limit
    "allow-client-failures": False,  # continue a round without clients that do not answer
    "node-wait": 120.0,  # seconds to wait for a SuperNode per partition before round 1
    "resume": False,  # continue the run in `out` (then `rounds` > 0 raises the total)
}
APP_NAME = "fedlap-flower"
_POLL = 0.2  # seconds between two pulls of replies


class FlowerError(FedlapError):
    """The Flower deployment or run failed (one line, printed by the CLI)."""


class ClientFailure(FlowerError):
    """Selected clients did not answer a round (the round is in the ledger as interrupted)."""


# ------------------------------------------------------------------------------ codec
def encode_state(state: Any) -> tuple[ArrayRecord, str]:
    """A method state (nested dicts/lists of tensors and plain values) as an ArrayRecord + JSON.

    Tensors go to the record (numpy arrays: dtype and bits kept); the JSON tree holds the
    plain values and ``{"__tensor__": key}`` where a tensor was. Floats survive JSON exactly.
    """
    arrays: dict[str, Array] = {}

    def walk(obj: Any) -> Any:
        if isinstance(obj, Tensor):
            key = f"t{len(arrays)}"
            arrays[key] = Array(obj.detach().cpu().contiguous().numpy())
            return {"__tensor__": key}
        if isinstance(obj, dict):
            if not all(isinstance(k, str) for k in obj):
                raise TypeError("method state dicts must have string keys")
            return {"__dict__": {k: walk(v) for k, v in obj.items()}}
        if isinstance(obj, list | tuple):
            return [walk(v) for v in obj]
        if obj is None or isinstance(obj, bool | int | float | str):
            return obj
        raise TypeError(f"cannot send a {type(obj).__name__} in a method state")

    tree = walk(state)
    return ArrayRecord(arrays), json.dumps(tree)


def decode_state(arrays: ArrayRecord, tree: str, device: torch.device | str = "cpu") -> Any:
    """Inverse of :func:`encode_state`; tensors land on ``device``."""

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict) and "__tensor__" in obj:
            return torch.from_numpy(np.array(arrays[obj["__tensor__"]].numpy())).to(device)
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj["__dict__"].items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    return walk(json.loads(tree))


def _pack(prefix: str, state: Any) -> RecordDict:
    arrays, tree = encode_state(state)
    return RecordDict({f"{prefix}-arrays": arrays, f"{prefix}-tree": ConfigRecord({"json": tree})})


def _unpack(records: RecordDict, prefix: str, device: torch.device | str = "cpu") -> Any:
    tree = records.config_records[f"{prefix}-tree"]["json"]
    return decode_state(records.array_records[f"{prefix}-arrays"], str(tree), device)


# ------------------------------------------------------------------------------ run config
def _kebab(name: str) -> str:
    return name.replace("_", "-")


def _field_types() -> dict[str, type]:
    """TrainConfig field -> its base type (bool, int, float or str; Optional unwrapped)."""
    hints = typing.get_type_hints(TrainConfig)
    out: dict[str, type] = {}
    for f in dataclasses.fields(TrainConfig):
        base = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
        out[f.name] = base[0] if base else hints[f.name]
    return out


def run_config_of(cfg: TrainConfig, **driver: Any) -> dict[str, bool | int | float | str]:
    """The run config (TOML values) of ``cfg`` and the driver's keys; None becomes ``""``."""
    values: dict[str, Any] = {_kebab(k): ("" if v is None else v) for k, v in cfg.to_dict().items()}
    unknown = set(map(_kebab, driver)) - set(DRIVER_DEFAULTS)
    if unknown:
        raise ConfigError(f"unknown Flower driver options: {', '.join(sorted(unknown))}")
    values.update(DRIVER_DEFAULTS)
    values.update({_kebab(k): v for k, v in driver.items()})
    return values


def config_from_run_config(run_config: dict[str, Any]) -> tuple[TrainConfig, dict[str, Any]]:
    """(TrainConfig, driver options) from a Flower run config; ``""`` means None."""
    types = _field_types()
    by_key = {_kebab(name): name for name in types}
    values: dict[str, Any] = {}
    driver = dict(DRIVER_DEFAULTS)
    for key, raw in run_config.items():
        if key in DRIVER_DEFAULTS:
            kind = type(DRIVER_DEFAULTS[key])
            driver[key] = kind(raw)
            continue
        if key not in by_key:
            raise ConfigError(f"unknown run-config key {key!r}")
        name = by_key[key]
        kind = types[name]
        if raw == "":
            values[name] = None
        elif kind is bool and not isinstance(raw, bool):
            raise ConfigError(f"run-config {key} must be true or false, not {raw!r}")
        elif kind is int and isinstance(raw, float) and not raw.is_integer():
            raise ConfigError(f"run-config {key} must be an integer, not {raw!r}")
        else:
            values[name] = kind(raw)
    return TrainConfig.from_dict(values), driver


def _toml_value(value: bool | int | float | str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if np.isfinite(value) else ("inf" if value > 0 else "-inf")
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def _toml_table(values: dict[str, Any]) -> str:
    return "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items())


def write_app(directory: str | Path, cfg: TrainConfig | None = None, **driver: Any) -> Path:
    """Write the Flower App (``pyproject.toml``) that ``flwr run DIRECTORY`` starts.

    Its run config lists every key with the values of ``cfg`` (default: TrainConfig's
    defaults) and the driver options; ``flwr run --run-config`` overrides any of them.
    The app's code is this installed module: every machine needs ``fedlap-privacy[flower]``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    run_config = run_config_of(cfg or TrainConfig(), **driver)
    text = (
        "# Flower App of fedlap-privacy (written by fedlap_privacy.fl.flower_app.write_app)\n"
        "[project]\n"
        f'name = "{APP_NAME}"\nversion = "0.1.0"\n'
        'description = "FedLAP-DP and its baselines on Flower"\nlicense = "MIT"\n'
        "dependencies = []  # install fedlap-privacy[flower] on every machine\n\n"
        '[tool.flwr.app]\npublisher = "fedlap-privacy"\n\n'
        "[tool.flwr.app.components]\n"
        'serverapp = "fedlap_privacy.fl.flower_app:server_app"\n'
        'clientapp = "fedlap_privacy.fl.flower_app:client_app"\n\n'
        "[tool.flwr.app.config]\n" + _toml_table(run_config)
    )
    (directory / "pyproject.toml").write_text(text)
    return directory


# ------------------------------------------------------------------------------ ClientApp
client_app = ClientApp()


@dataclass
class _Partition:
    """The records of the partition this SuperNode holds (never leave the node)."""

    index: int
    x: Tensor
    y: Tensor


def _node_partition(
    cfg: TrainConfig, node_config: dict[str, Any], device: torch.device
) -> tuple[_Partition, Dataset]:
    """Partition ``partition-id`` of the run's split (SPEC 2.4), as the simulator splits it."""
    if "partition-id" not in node_config:
        raise ConfigError("this SuperNode has no partition-id: start it with --node-config "
                          "'partition-id=K num-partitions=N'")
    k = int(node_config["partition-id"])
    n = int(node_config.get("num-partitions", cfg.clients))
    if n != cfg.clients or not 0 <= k < n:
        raise ConfigError(f"SuperNode holds partition {k} of {n}, the run has {cfg.clients} "
                          "clients")
    data_dir = str(node_config.get("data-dir", "")) or cfg.data_dir
    data = load_dataset(cfg.dataset, data_dir)
    index = torch.from_numpy(client_parts(cfg, data)[k])
    x = torch.from_numpy(data.x_train)[index].to(device)
    y = torch.from_numpy(data.y_train)[index].to(device)
    return _Partition(k, x, y), data


def _node_device(context: Context) -> torch.device:
    return resolve_device(str(context.node_config.get("device", "auto")))


def _message_config(content: RecordDict) -> TrainConfig:
    return TrainConfig.from_dict(json.loads(str(content.config_records["run"]["config"])))


@client_app.query()
def _describe(msg: Message, context: Context) -> Message:
    """Discovery: which partition this node holds and its size N_k (public metadata)."""
    cfg = _message_config(msg.content)
    part, _ = _node_partition(cfg, dict(context.node_config), torch.device("cpu"))
    reply = ConfigRecord({"partition-id": part.index, "num-examples": len(part.y)})
    return Message(RecordDict({"node": reply}), reply_to=msg)


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    """One client round (Method.client, SPEC 2.1 / 3) on this node's partition.

    The node draws its own DP randomness (secret; with ``reproducible-noise`` seeded by
    (seed, round, partition + 1) like the simulator's); the
    method's node-local state is read from and written back to ``context.state``.
    """
    content = msg.content
    cfg = _message_config(content)
    device = _node_device(context)
    part, data = _node_partition(cfg, dict(context.node_config), device)
    run = content.config_records["run"]
    info = RoundInfo(int(run["round"]), int(run["rounds"]), float(run["lr"]),
                     _unpack(content, "extras", device))
    model = build_model(default_model_config(cfg, data)).to(device)
    weights = content.array_records["weights"].to_torch_state_dict()
    model.load_state_dict({k: v.to(device) for k, v in weights.items()})
    state: dict[str, Any] = {}
    if "state-tree" in context.state.config_records:
        saved = _unpack(context.state, "state", device)
        if saved["partition"] != part.index:
            raise ConfigError("this SuperNode's partition changed within a run")
        state = saved["state"]
    method = build_method(cfg, device)
    gen = dp_generator(cfg, device, info.round, part.index + 1)
    reply = method.client(model, part.x, part.y, state, info, gen)
    kept = _pack("state", {"partition": part.index, "state": state})
    for key, record in kept.items():
        context.state[key] = record
    out = _pack("payload", reply.payload)
    out["reply"] = ConfigRecord({
        "accesses": int(reply.accesses), "num-examples": int(reply.num_examples),
        "stats": json.dumps(reply.stats), "partition-id": part.index,
    })
    return Message(out, reply_to=msg)


# ------------------------------------------------------------------------------ ServerApp
def _reason(msg: Message) -> str:
    """One line saying why a reply is an error."""
    text = (msg.error.reason or "").strip().splitlines()
    last = [line for line in text if line.strip()]
    reason = last[-1].strip() if last else f"error code {msg.error.code}"
    if "node_unavail" in reason or "unavail" in reason.lower():
        return "its SuperNode is unavailable (stopped sending heartbeats)"
    return reason[:300]


@dataclass
class FlowerClients:
    """The ``ask_clients`` of :func:`simulation.train` over a Flower Grid (see module doc)."""

    grid: Grid
    round_timeout: float = 0.0
    allow_failures: bool = False
    node_wait: float = 120.0
    log: Callable[[str], None] = print
    nodes: dict[int, int] = field(default_factory=dict)  # partition -> node id

    def _pull(self, waiting: dict[str, int], got: dict[int, Message]) -> None:
        """Move the replies to the message ids in ``waiting`` (id -> index) into ``got``."""
        for reply in self.grid.pull_messages(list(waiting)):
            i = waiting.pop(reply.metadata.reply_to_message_id, None)
            if i is not None:
                got[i] = reply

    def _collect(self, messages: list[Message], timeout: float) -> dict[int, Message]:
        """Push ``messages``; pull replies until all arrived or ``timeout`` seconds after the
        push (0: no limit); index -> reply."""
        ids = list(self.grid.push_messages(messages))
        deadline = None if timeout <= 0 else time.monotonic() + timeout
        waiting = {mid: i for i, mid in enumerate(ids) if mid}
        got: dict[int, Message] = {}
        while waiting and (deadline is None or time.monotonic() < deadline):
            self._pull(waiting, got)
            if waiting:
                time.sleep(_POLL)
        return got

    def discover(self, cfg: TrainConfig, sizes: list[int]) -> None:
        """Map partition k -> the SuperNode holding it; check N_k against ``sizes``.

        Asks every connected node (and nodes that join later) which partition it holds,
        until each of the ``cfg.clients`` partitions has answered or ``node_wait`` seconds
        passed. No private record is read beyond the partition's size (public metadata).
        """
        content = RecordDict({"run": ConfigRecord({"config": json.dumps(cfg.to_dict())})})
        deadline = time.monotonic() + self.node_wait
        asked: list[int] = []  # node ids, by message index
        waiting: dict[str, int] = {}
        got: dict[int, Message] = {}
        found: dict[int, tuple[int, int]] = {}  # partition -> (node, N_k)
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
                    errors.append(f"node {node}: {_reason(reply)}")
                    continue
                rec = reply.content.config_records["node"]
                k, n_k = int(rec["partition-id"]), int(rec["num-examples"])
                if k in found and found[k][0] != node:
                    raise FlowerError(f"two SuperNodes hold partition {k}: give each its own "
                                      "partition-id")
                found[k] = (node, n_k)
            if len(found) < cfg.clients:
                time.sleep(_POLL)
        missing = [k for k in range(cfg.clients) if k not in found]
        if missing:
            detail = f" ({'; '.join(errors)})" if errors else ""
            raise FlowerError(
                f"no SuperNode answered for partition(s) {', '.join(map(str, missing))} within "
                f"{self.node_wait:g} s: "
                f"start one flower-supernode per client with --node-config 'partition-id=K "
                f"num-partitions={cfg.clients}'{detail}"
            )
        for k, (_, n_k) in found.items():
            if n_k != sizes[k]:
                raise FlowerError(f"the SuperNode of partition {k} holds {n_k} records, the run's "
                                  f"split gives {sizes[k]}: check its dataset and data-dir")
        self.nodes = {k: node for k, (node, _) in found.items()}
        self.log(f"partitions -> SuperNodes: {self.nodes}")

    def __call__(
        self, run: _Run, m: int, chosen: list[int], info: RoundInfo, callback: Callback
    ) -> list[Reply]:
        """Send round m to the nodes of ``chosen``; their replies, in the order of ``chosen``."""
        if not chosen:
            return []
        weights = ArrayRecord(
            {k: Array(v.detach().cpu().contiguous().numpy()) for k, v in
             run.model.state_dict().items()}
        )
        content = _pack("extras", info.extras)
        content["weights"] = weights
        content["run"] = ConfigRecord({
            "round": m, "rounds": info.rounds, "lr": float(info.lr),
            "config": json.dumps(run.cfg.to_dict()),
        })
        ttl = DEFAULT_TTL if self.round_timeout <= 0 else self.round_timeout + 30.0
        messages = [Message(content, self.nodes[k], "train", ttl=ttl, group_id=str(m))
                    for k in chosen]
        got = self._collect(messages, self.round_timeout)
        replies: list[Reply] = []
        failed: list[str] = []
        for i, k in enumerate(chosen):
            msg = got.get(i)
            if msg is None:
                failed.append(f"client {k} did not answer within {self.round_timeout:g} s")
                continue
            if msg.has_error():
                failed.append(f"client {k}: {_reason(msg)}")
                continue
            rec = msg.content.config_records["reply"]
            if int(rec["partition-id"]) != k:
                failed.append(f"client {k}: answered for partition {rec['partition-id']}")
                continue
            replies.append(Reply(
                _unpack(msg.content, "payload", run.device), int(rec["accesses"]),
                int(rec["num-examples"]), json.loads(str(rec["stats"])),
            ))
            callback("client_done", {"round": m, "client": k})
        if failed:
            self._on_failure(run, m, chosen, failed, replies)
        return replies

    def _on_failure(self, run: _Run, m: int, chosen: list[int], failed: list[str],
                    replies: list[Reply]) -> None:
        """Fail the round (entered as interrupted at its full T) unless failures are allowed."""
        what = "; ".join(failed)
        if self.allow_failures and replies:
            self.log(f"round {m}: continuing with {len(replies)} of {len(chosen)} clients "
                     f"({what}); the ledger counts the round for all {len(chosen)}")
            return
        steps = run.method.accounted_steps(run.server_state)
        run.ledger.record(m, steps, chosen, "interrupted", local_steps=steps)
        run.save()
        hint = "" if self.allow_failures else (
            "; pass --allow-client-failures (run config allow-client-failures=true) to continue "
            "with the clients that answer"
        )
        raise ClientFailure(f"round {m} failed: {what}; the round is in the ledger as "
                            f"interrupted{hint}")


server_app = ServerApp()


def _write_status(out: Path, status: dict[str, Any]) -> None:
    write_text_atomic(out / STATUS, json.dumps(status))


def _log(line: str) -> None:
    print(f"[fedlap-privacy] {line}", flush=True)


def _progress(event: str, info: dict[str, Any]) -> None:
    if event == "round_end":
        eps = info.get("epsilon")
        _log(f"round {info['round']}: test accuracy {info['test_accuracy']:.4f}, epsilon "
             f"{'-' if eps is None else f'{eps:.4f}'}, {info['replies']}/{info['clients']} "
             "clients answered")
    elif event == "start":
        _log(f"start at round {info['start_round']}, sigma {info['sigma']}")


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    """Run (or resume) the training of the run config; write :data:`STATUS` into ``out``."""
    cfg, driver = config_from_run_config(dict(context.run_config))
    out = Path(str(driver["out"])).expanduser().resolve()
    try:
        clients = FlowerClients(grid, float(driver["round-timeout"]),
                                bool(driver["allow-client-failures"]),
                                float(driver["node-wait"]), _log)
        if driver["resume"]:
            cfg = load_run_config(out)
        data = load_dataset(cfg.dataset, cfg.data_dir)
        clients.discover(cfg, [len(p) for p in client_parts(cfg, data)])
        if driver["resume"]:
            rounds = cfg.rounds if int(context.run_config.get("rounds", 0)) <= 0 else int(
                context.run_config["rounds"])
            result = resume(out, rounds, str(driver["device"]), _progress, clients)
        else:
            result = train(cfg, out, str(driver["device"]), _progress, clients)
    except Exception as exc:
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        _write_status(out, {"status": "failed", "error": message,
                            "pending": (out / PENDING).exists()})
        raise
    _write_status(out, {"status": "completed", "summary": result.summary})
    _log(f"done: {json.dumps(result.summary)}")


# ------------------------------------------------------------------------------ deployment
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process from /proc, or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _family(pid: int) -> list[tuple[int, int]]:
    """``pid`` and every descendant as (pid, start time): a process is only ever signalled
    while it is the one seen here (a reused pid has another start time). Linux /proc."""
    table: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        stat = _stat(int(entry.name))
        if stat is not None and stat[0] != "Z":
            table[int(entry.name)] = (stat[1], stat[2])
    if pid not in table:
        return []
    found, frontier = [(pid, table[pid][1])], [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, started) in table.items():
            if ppid == parent:
                found.append((child, started))
                frontier.append(child)
    return found


def _alive(pid: int, started: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and stat[2] == started


def _signal(family: list[tuple[int, int]], sig: int) -> None:
    for pid, started in family:
        if _alive(pid, started):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def _stop(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """Stop ``proc`` and every process it started (each by its id): TERM, then KILL."""
    if proc.poll() is not None:
        return  # exited (and reaped): its pid may already be another process's
    family = _family(proc.pid)
    _signal(family, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(_alive(*member) for member in family):
        proc.poll()  # reap our own child, so it does not linger as a zombie
        time.sleep(0.1)
    _signal(family, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)


class LocalDeployment:
    """A SuperLink and N SuperNodes (partition-id k of N) on 127.0.0.1, torn down on exit.

    Every process runs in its own session with its output in ``workdir``; ``FLWR_HOME`` is
    ``workdir/home`` (the connection ``fedlap-local`` points at the SuperLink). Nothing is
    downloaded: runtime dependency installation is off.
    """

    CONNECTION = "fedlap-local"

    def __init__(self, clients: int, workdir: str | Path, device: str = "auto",
                 data_dir: str | None = None) -> None:
        self.clients, self.device, self.data_dir = clients, device, data_dir
        self.workdir = Path(workdir)
        self.home = self.workdir / "home"
        self.port = 0
        self.superlink: subprocess.Popen[bytes] | None = None
        self.supernodes: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []
        bindir = str(Path(sys.executable).parent)
        self.env = {
            **os.environ, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        }

    def _exe(self, name: str) -> str:
        local = Path(sys.executable).parent / name
        found = str(local) if local.exists() else shutil.which(name)
        if found is None:
            raise FlowerError(f"{name} not found: pip install 'fedlap-privacy[flower]'")
        return found

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = open(self.workdir / log_name, "wb")
        self._logs.append(log)
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                cwd=self.workdir, start_new_session=True)

    def start(self, timeout: float = 60.0) -> LocalDeployment:
        """Start the SuperLink, wait until it serves, then start the SuperNodes."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{self.CONNECTION}"\n\n[superlink.{self.CONNECTION}]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        self.superlink = self._spawn(
            [self._exe("flower-superlink"), "--insecure", "--host", "127.0.0.1",
             "--port", str(self.port), "--disable-runtime-dependency-installation"],
            "superlink.log",
        )
        self._wait_ready(timeout)
        for k in range(self.clients):
            self.start_node(k)
        return self

    def start_node(self, k: int) -> subprocess.Popen[bytes]:
        """Start (or restart) the SuperNode holding partition ``k``."""
        node_config = (f"partition-id={k} num-partitions={self.clients} "
                       f"device={json.dumps(self.device)}")
        if self.data_dir:
            node_config += f" data-dir={json.dumps(self.data_dir)}"
        proc = self._spawn(
            [self._exe("flower-supernode"), "--insecure", "--superlink",
             f"127.0.0.1:{self.port}", "--port", str(_free_port()), "--node-config", node_config],
            f"supernode-{k}.log",
        )
        if k < len(self.supernodes):
            self.supernodes[k] = proc
        else:
            self.supernodes.append(proc)
        return proc

    def kill_node(self, k: int) -> None:
        """SIGKILL SuperNode k and everything it started, at once (a machine dying)."""
        proc = self.supernodes[k]
        if proc.poll() is None:
            _signal(_family(proc.pid), signal.SIGKILL)
        proc.wait(timeout=10)

    def _wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < end:
            assert self.superlink is not None
            if self.superlink.poll() is not None:
                raise FlowerError(f"flower-superlink exited: see {self.workdir / 'superlink.log'}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if response.status == 200:
                        return
            time.sleep(0.3)
        raise FlowerError(f"flower-superlink did not start within {timeout:g} s")

    def flwr_run(self, app_dir: Path, run_config: dict[str, Any]) -> subprocess.Popen[bytes]:
        """``flwr run APP fedlap-local --stream --run-config FILE``; its output in the log."""
        overrides = self.workdir / "run-config.toml"
        overrides.write_text(_toml_table(run_config))
        return self._spawn(
            [self._exe("flwr"), "run", str(app_dir), self.CONNECTION, "--stream",
             "--run-config", str(overrides)],
            "flwr-run.log",
        )

    def close(self) -> None:
        """Stop every process this deployment started (SuperNodes first)."""
        for proc in [*self.supernodes, *([self.superlink] if self.superlink else [])]:
            _stop(proc)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class FlowerResult:
    """What ``train --engine flower`` prints: the run's summary and per-round metrics."""

    summary: dict[str, Any]
    history: list[dict[str, Any]]


def _read_history(out: Path) -> list[dict[str, Any]]:
    path = out / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _prepare(cfg: TrainConfig | None, out: Path, resume_run: bool) -> TrainConfig:
    """The run's configuration; refuses what :func:`simulation.train` / ``resume`` refuse."""
    if resume_run:
        return load_run_config(out)
    if cfg is None:
        raise ConfigError("a new Flower run needs a configuration")
    cfg.validate()
    check_new_run_dir(out)
    return cfg


def run_on(
    deployment: LocalDeployment,
    cfg: TrainConfig | None,
    out_dir: str | Path,
    device: str = "auto",
    callback: Callback | None = None,
    *,
    allow_client_failures: bool = False,
    round_timeout: float = 0.0,
    resume_run: bool = False,
    rounds: int | None = None,
    on_poll: Callable[[LocalDeployment], None] | None = None,
) -> FlowerResult:
    """Run (or resume) one training on a started deployment with ``flwr run``; see
    :func:`run_flower`. ``on_poll`` is called about twice a second while the run runs."""
    out = Path(out_dir).expanduser().resolve()
    cfg = _prepare(cfg, out, resume_run)
    if deployment.clients != cfg.clients:
        raise ConfigError(f"{deployment.clients} SuperNodes for a run of {cfg.clients} clients")
    callback = callback or (lambda event, info: None)
    out.mkdir(parents=True, exist_ok=True)
    (out / STATUS).unlink(missing_ok=True)
    run_config = run_config_of(
        cfg, out=str(out), device=device, round_timeout=float(round_timeout),
        allow_client_failures=allow_client_failures, resume=resume_run,
    )
    if resume_run:
        run_config["rounds"] = 0 if rounds is None else int(rounds)
    app = write_app(deployment.workdir / "app", cfg)
    seen = len(_read_history(out)) if resume_run else 0
    callback("start", {"config": cfg.to_dict(), "sigma": cfg.sigma, "start_round": seen + 1})
    runner = deployment.flwr_run(app, run_config)
    try:
        while runner.poll() is None:
            if on_poll is not None:
                on_poll(deployment)
            history = _read_history(out)
            for metrics in history[seen:]:
                callback("round_end", metrics)
            seen = max(seen, len(history))
            time.sleep(0.5)
    finally:
        _stop(runner)
    for metrics in _read_history(out)[seen:]:
        callback("round_end", metrics)
    status_path = out / STATUS
    if not status_path.exists():
        log = deployment.workdir / "flwr-run.log"
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        raise FlowerError("the Flower run ended without a result" +
                          (f": {lines[-1][:200]} (see {log})" if lines else ""))
    status = json.loads(status_path.read_text())
    if status["status"] != "completed":
        raise FlowerError(status["error"])
    return FlowerResult(status["summary"], _read_history(out))


def run_flower(
    cfg: TrainConfig | None,
    out_dir: str | Path,
    clients: int | None = None,
    device: str = "auto",
    callback: Callback | None = None,
    *,
    allow_client_failures: bool = False,
    round_timeout: float = 0.0,
    resume_run: bool = False,
    rounds: int | None = None,
) -> FlowerResult:
    """Train on a local Flower deployment (``fedlap-privacy train --engine flower``).

    Starts a SuperLink and ``clients`` SuperNodes (default: the run's clients) on
    127.0.0.1 in a temporary directory, runs the app with ``cfg`` as run config (or resumes
    the run in ``out_dir``), reports progress to ``callback`` from metrics.jsonl (the
    simulator's events ``start`` and ``round_end``) and tears everything down, also on
    errors and Ctrl-C. Raises :class:`FlowerError` with the server's one-line message when
    the run fails; the checkpoint in ``out_dir`` has the simulator's format.
    """
    out = Path(out_dir).expanduser().resolve()
    cfg = _prepare(cfg, out, resume_run)
    n = cfg.clients if clients is None else clients
    if n != cfg.clients:
        raise ConfigError(f"--clients {n} SuperNodes for a run of {cfg.clients} clients")
    with tempfile.TemporaryDirectory(prefix="fedlap-flower-") as tmp:
        with LocalDeployment(n, tmp, device, cfg.data_dir) as deployment:
            return run_on(
                deployment, None if resume_run else cfg, out, device, callback,
                allow_client_failures=allow_client_failures, round_timeout=round_timeout,
                resume_run=resume_run, rounds=rounds,
            )


def main(argv: list[str] | None = None) -> None:
    """``python -m fedlap_privacy.fl.flower_app DIR``: write the Flower App into DIR."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m fedlap_privacy.fl.flower_app APP_DIR", file=sys.stderr)
        raise SystemExit(2)
    path = write_app(args[0])
    print(f"Flower App written to {path}: flwr run {path} <connection> --run-config '...'")


if __name__ == "__main__":
    main()
