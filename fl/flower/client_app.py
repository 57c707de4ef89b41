"""The ClientApp: every instruction checked against the node's policy, then one client round.

Contract (docs/threat-model.md, "Cross-silo deployment"): the node answers two messages.

* ``query`` (discovery): the partition it holds, its size N_k and the content hash of its
  records (public metadata the server pins for the run), after checking the run's
  configuration against the node's policy and, when the query carries the model's shape
  (:class:`.node_model.ModelShape`), its records and the model's factory against it.
* ``train``: in this order, and nothing is read from the records before step 3 —
  1. the instruction is decoded with the strict parser (:func:`.run_config.parse_config`);
  2. :meth:`NodePolicy.check` (the full :meth:`TrainConfig.validate` and the policy, its
     ``allowed-models`` among it; the round's number and learning rate must be numbers, the
     rate within ``max-lr``);
  3. the node's partition is loaded (:mod:`.partition`: its own data file, or the simulated
     split) and checked against the model's shape, the model is built from the node's own
     installation and takes the broadcast weights only if they are its own shape
     (:mod:`.node_model`), then its ledger (:mod:`.node_ledger`) admits the round (no
     replay, no change of the run, within the node's budget) and records it at its full T,
     persisted;
  4. :meth:`Method.client` runs on the broadcast weights, with the node's own LDP-FL ranges
     (:func:`.policy.node_round_info`: never the server's) and the node's own DP generator
     (:func:`~fedlap_privacy.fl.run.randomness.dp_generator`: OS-seeded; seeded only if the
     policy allows ``reproducible-noise``), the method's node-local state kept in
     ``context.state``.

A refusal at steps 1-3 is a normal reply holding one ``refusal`` record (``reason``: one
line naming the rule, ``partition-id`` when known); the server fails the round with it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedlap_privacy.compute.threads import apply_cpu_policy
from fedlap_privacy.errors import ConfigError, DataError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.config_resolve import typed_value
from fedlap_privacy.fl.engine.simulation import resolve_device
from fedlap_privacy.fl.flower.codec import CodecError, pack, pack_into, unpack
from fedlap_privacy.fl.flower.node_ledger import (
    NodeLedger,
    check_state_root,
    default_state_dir,
)
from fedlap_privacy.fl.flower.node_model import (
    MODEL_RECORD,
    ModelShape,
    build_node_model,
    check_records,
    load_weights,
)
from fedlap_privacy.fl.flower.partition import NodeData, load_partition
from fedlap_privacy.fl.flower.policy import NodePolicy, PolicyRefusal, node_round_info
from fedlap_privacy.fl.flower.run_config import parse_config
from fedlap_privacy.fl.flower.secure_node import (
    SECURE_RECORD,
    UNMASK,
    UPLOAD_RECORD,
    mask_update,
    public_key,
    unmask_answer,
)
from fedlap_privacy.fl.methods.interface import RoundInfo, build_method
from fedlap_privacy.fl.run.randomness import dp_generator
from fedlap_privacy.fl.secure_sum.training import SecurePlan

__all__ = ["client_app", "make_client_app"]

#: what makes the node refuse an instruction (each carries a one-line message)
_REFUSALS = (PolicyRefusal, ConfigError, CodecError, DataError)


def _device(context: Context) -> torch.device:
    return resolve_device(str(context.node_config.get("device", "auto")))


def _instruction_config(content: RecordDict) -> TrainConfig:
    if "config" not in content.config_records:
        raise ConfigError("the instruction has no configuration")
    try:
        return parse_config(dict(content.config_records["config"]))
    except (TypeError, ValueError) as exc:  # e.g. a list where a number belongs
        raise ConfigError(f"malformed instruction ({type(exc).__name__}: {exc})") from None


def _refuse(msg: Message, exc: BaseException, partition: int | None) -> Message:
    text = str(exc).strip().splitlines()
    reason = (text[0] if text else type(exc).__name__)[:300]
    record: dict[str, Any] = {"reason": reason}
    if partition is not None:
        record["partition-id"] = partition
    return Message(RecordDict({"refusal": ConfigRecord(record)}), reply_to=msg)


def _partition_hint(context: Context) -> int | None:
    try:
        return int(context.node_config["partition-id"])
    except (KeyError, TypeError, ValueError):
        return None


def _check_state(node_config: dict[str, Any]) -> Path:
    """The node's state folder (its ledger); a virtual node's (node config ``state-token``)
    checked to be the run folder's (:func:`~.node_ledger.check_state_root`)."""
    state_dir = Path(str(node_config.get("state-dir", "")) or default_state_dir()).expanduser()
    if node_config.get("state-token"):
        check_state_root(state_dir.parent, str(node_config["state-token"]))
    return state_dir


def _describe(msg: Message, context: Context) -> Message:
    """Discovery: the partition this node holds, N_k and its content hash (public metadata)."""
    try:
        cfg = _instruction_config(msg.content)
        policy = NodePolicy.from_node_config(dict(context.node_config))
        policy.check_config(cfg, discovery=True)
        _check_state(dict(context.node_config))
        data = load_partition(cfg, dict(context.node_config), torch.device("cpu"))
        if MODEL_RECORD in msg.content.config_records:
            shape = ModelShape.from_content(msg.content)
            check_records(shape, data.input_shape, data.y, data.declared_classes,
                          _where(context))
            build_node_model(cfg, shape, policy)
    except _REFUSALS as exc:
        return _refuse(msg, exc, _partition_hint(context))
    reply = ConfigRecord({"partition-id": data.index, "num-examples": data.size,
                          "content-hash": data.content_hash, "source": data.source})
    if cfg.secure_aggregation is not None:  # its key for the run's secure sums
        reply["secure-key"] = public_key(context)
    return Message(RecordDict({"node": reply}), reply_to=msg)


def _round_info(content: RecordDict, device: torch.device) -> RoundInfo:
    run = content.config_records.get("round")
    if run is None or not all(k in run for k in ("round", "rounds", "lr")):
        raise ConfigError("the instruction has no round, rounds and lr")
    round_, rounds = (typed_value(k, int, run[k]) for k in ("round", "rounds"))
    lr = typed_value("lr", float, run["lr"])
    if round_ < 1 or rounds < 1:
        raise ConfigError(f"the instruction's round {round_} and rounds {rounds} must be >= 1")
    return RoundInfo(round_, rounds, lr, unpack(content, "extras", device))


def _where(context: Context) -> str:
    data_file = str(context.node_config.get("data-file", ""))
    return f"data-file {data_file}" if data_file else "this node's part of the run's data"


def _admit(msg: Message, context: Context, device: torch.device
           ) -> tuple[TrainConfig, RoundInfo, NodeData, nn.Module, int, SecurePlan | None]:
    """Steps 1-3 of the module docstring; raises one of ``_REFUSALS``. Over secure
    aggregation, also the node's own plan of its noise share for this model."""
    node_config = dict(context.node_config)
    policy = NodePolicy.from_node_config(node_config)
    cfg = _instruction_config(msg.content)
    info = _round_info(msg.content, device)
    steps = policy.check(cfg, info)
    shape = ModelShape.from_content(msg.content)
    weights = unpack(msg.content, "weights", device)
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor)
                                                for v in weights.values()):
        raise ConfigError("the instruction's weights are not a model's parameters")
    data = load_partition(cfg, node_config, device)
    check_records(shape, data.input_shape, data.y, data.declared_classes, _where(context))
    model = build_node_model(cfg, shape, policy).to(device)
    load_weights(model, weights, device)
    state_dir = _check_state(node_config)
    ledger = NodeLedger.open(state_dir, int(context.run_id), data.index, data.content_hash,
                             data.size, cfg, policy)
    plan = _secure_plan(msg.content, cfg, model)
    # over secure aggregation, the round's record at the fewest shares a released round holds
    secure = None if plan is None else plan.record(
        len(msg.content.config_records[SECURE_RECORD].get("peers", [])), plan.min_survivors,
        released=True)
    ledger.admit(info.round, cfg, data.index, data.content_hash, steps, policy, secure)
    ledger.record(info.round, steps, secure)
    return cfg, info, data, model, steps, plan


def _secure_plan(content: RecordDict, cfg: TrainConfig, model: nn.Module) -> SecurePlan | None:
    """Over secure aggregation, the mechanism of the node's own noise share for this model
    (:meth:`SecurePlan.of`); refuses a secure-sum record without a secure run and the
    reverse."""
    if (SECURE_RECORD in content.config_records) != (cfg.secure_aggregation is not None):
        raise ConfigError("a secure_aggregation run's round comes with its secure-sum record, "
                          "and only such a run's")
    if cfg.secure_aggregation is None:
        return None
    if cfg.sigma is None:
        raise ConfigError("a secure_aggregation round needs its sigma")
    return SecurePlan.of(cfg, sum(p.numel() for p in model.parameters()))


def train_round(cfg: TrainConfig, info: RoundInfo, data: NodeData, model: nn.Module,
                context: Context, device: torch.device, steps: int,
                secure: ConfigRecord | None = None, plan: SecurePlan | None = None
                ) -> RecordDict:
    """Step 4: one client round on ``data`` from ``model`` (holding the broadcast weights);
    returns the reply's records. Over secure aggregation (``secure``: the instruction's
    peers and rotation seed; ``plan``: the node's share) the update leaves the node only
    masked (:mod:`.secure_node`)."""
    info = node_round_info(cfg, info, model.state_dict())
    state: dict[str, Any] = {}
    if "state-tree" in context.state.config_records:
        saved = unpack(context.state, "state", device)
        if saved["partition"] != data.index:
            raise ConfigError("this SuperNode's partition changed within a run")
        state = saved["state"]
    method = build_method(cfg, device)
    gen = dp_generator(cfg, device, info.round, data.index + 1)
    reply = method.client(model, data.x, data.y, state, info, gen)
    if reply.accesses > steps:  # the ledger entered T before the round: never exceed it
        raise RuntimeError(f"the client step made {reply.accesses} accesses, {steps} admitted")
    pack_into(context.state, "state", {"partition": data.index, "state": state})
    if secure is not None and plan is not None:
        update = torch.cat([reply.payload[n].detach().double().flatten()
                            for n, _ in model.named_parameters()]).cpu().numpy()
        out = RecordDict({UPLOAD_RECORD: mask_update(plan, update, secure, data.index,
                                                     info.round, context)})
    else:
        out = pack("payload", reply.payload)
    out["reply"] = ConfigRecord({
        "accesses": int(reply.accesses), "num-examples": int(reply.num_examples),
        "stats": json.dumps(reply.stats), "partition-id": data.index,
        "content-hash": data.content_hash,
    })
    return out


def _train(msg: Message, context: Context) -> Message:
    """One client round (Method.client, docs/algorithms.md), or a refusal (module docstring).

    torch's threads follow :func:`fedlap_privacy.compute.threads.apply_cpu_policy`: the node's
    ``OMP_NUM_THREADS`` if set, else its CPUs shared by ``FEDLAP_WORKERS`` co-located nodes
    (fixed: a node does not follow the load)."""
    device = _device(context)
    try:
        apply_cpu_policy(follow=False)
        cfg, info, data, model, steps, plan = _admit(msg, context, device)
    except _REFUSALS as exc:
        return _refuse(msg, exc, _partition_hint(context))
    try:
        out = train_round(cfg, info, data, model, context, device, steps,
                          msg.content.config_records.get(SECURE_RECORD), plan)
    except ConfigError as exc:
        return _refuse(msg, exc, data.index)
    return Message(out, reply_to=msg)


def _unmask(msg: Message, context: Context) -> Message:
    """The unmasking of a secure round: the node's self seed and its pair seeds with the
    peers that dropped, for one survivor set (:func:`.secure_node.unmask_answer`)."""
    try:
        request = msg.content.config_records[UNMASK]
        answer = unmask_answer(request, context)
    except (KeyError, ConfigError) as exc:
        return _refuse(msg, exc if isinstance(exc, ConfigError)
                       else ConfigError("malformed unmasking request"), _partition_hint(context))
    return Message(RecordDict({UNMASK: answer}), reply_to=msg)


#: a Flower mod, as ``ClientApp(mods=...)`` takes it: (message, context, the next handler)
Mod = Callable[[Message, Context, Callable[[Message, Context], Message]], Message]


def make_client_app(mods: list[Mod] | None = None) -> ClientApp:
    """This module's ClientApp (``query``: discovery, ``train``: one client round,
    ``query.unmask``: a secure round's unmasking), with
    Flower ``mods`` run before each handler (the Simulation Engine's give each virtual
    node its state folder and policy: :mod:`.simulation_engine`)."""
    app = ClientApp(mods=mods)
    app.query()(_describe)
    app.query(UNMASK)(_unmask)
    app.train()(_train)
    return app


#: the ClientApp of every SuperNode (the Flower App's ``clientapp``)
client_app = make_client_app()
