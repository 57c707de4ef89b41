"""The node's own policy and ledger on Flower: a curious server's crafted instructions are
refused before the node touches its data, and refusals leave the node ledger unchanged
(docs/threat-model.md, "Cross-silo deployment").

The tests play a malicious ServerApp: they build ``train`` messages by hand and call the
real ClientApp (a round over TLS with authenticated SuperNodes: test_flower_tls.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")

from flower_grid import FakeGrid, task_identity, write_policy  # noqa: E402, F401
from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402

from fedlap_privacy.data.datasets import load_dataset  # noqa: E402
from fedlap_privacy.errors import ConfigError  # noqa: E402
from fedlap_privacy.fl.config import TrainConfig  # noqa: E402
from fedlap_privacy.fl.engine.events import RoundEnded  # noqa: E402
from fedlap_privacy.fl.engine.flower_app import (  # noqa: E402
    ClientFailure,
    FlowerClients,
    FlowerError,
    NodePolicy,
    PolicyRefusal,
    client_app,
    expected_partitions,
)
from fedlap_privacy.fl.engine.simulation import CHECKPOINT, default_model_config, train  # noqa: E402
from fedlap_privacy.fl.flower.codec import pack, pack_into  # noqa: E402
from fedlap_privacy.fl.flower.grid_clients import model_shape  # noqa: E402
from fedlap_privacy.fl.flower.run_config import config_values  # noqa: E402
from fedlap_privacy.models import build_model  # noqa: E402
from fedlap_privacy.state.checkpoint import load_checkpoint  # noqa: E402

BASE = dict(method="dp-fedavg", width=8, rounds=3, batch_size=32, local_steps=2, clients=2,
            sigma=1.0)


def cfg_of(**kw) -> TrainConfig:
    return TrainConfig(**{**BASE, **kw})


def node(tmp_path: Path, **policy) -> Context:
    """A SuperNode holding partition 0, with the default policy updated by ``policy``."""
    config = {"partition-id": 0, "num-partitions": 2, "device": "cpu",
              "state-dir": str(tmp_path / "state"),
              **{k.replace("_", "-"): v for k, v in policy.items()}}
    return Context(run_id=7, node_id=1, node_config=config, state=RecordDict(), run_config={})


def instruction(cfg: TrainConfig, round_: int, extras: dict | None = None, lr: float = 0.1,
                **raw) -> Message:
    """A ``train`` message as a (malicious) server would craft it; ``raw``: run-config values
    sent as they are (kebab-case keys)."""
    torch.manual_seed(0)
    data = load_dataset(cfg.dataset)
    model = build_model(default_model_config(cfg, data))
    content = pack("extras", extras or {})
    pack_into(content, "weights", dict(model.state_dict()))
    content["model"] = model_shape(data).to_record()
    content["round"] = ConfigRecord({"round": round_, "rounds": cfg.rounds, "lr": lr})
    content["config"] = ConfigRecord({**config_values(cfg), **raw})
    return Message(content, 1, "train")


def reply_to(ctx: Context, msg: Message) -> tuple[str | None, Message]:
    """The node's refusal (None when it trained) and its reply, never a Flower error."""
    reply = client_app(msg, ctx)
    assert not reply.has_error()
    rec = reply.content.config_records.get("refusal")
    if rec is None:
        assert {"reply", "node"} & set(reply.content.config_records)
        return None, reply
    return str(rec["reason"]), reply


def answer(ctx: Context, cfg: TrainConfig, round_: int, extras: dict | None = None,
           lr: float = 0.1) -> str | None:
    """The node's refusal, or None when it trained."""
    return reply_to(ctx, instruction(cfg, round_, extras, lr))[0]


def ledger_bytes(ctx: Context) -> bytes | None:
    path = Path(str(ctx.node_config["state-dir"])) / f"run-{ctx.run_id}.json"
    return path.read_bytes() if path.exists() else None


ATTACKS = [
    ("sigma 0", dict(sigma=0.0), None, r"invalid instruction: sigma 0.0 must be"),
    ("tiny sigma", dict(sigma=1e-3), None, r"sigma 0.001 below the node's minimum 0.5"),
    ("raw weights", dict(method="fedavg", sigma=None), None,
     r"method fedavg is not allowed by the node's policy"),
    ("real images", dict(method="fedlap-dp", init="real"), None,
     r"init 'real' reads private images"),
    ("no synthetic steps", dict(method="fedlap-dp", syn_steps=0, reinits=1, max_loops=1,
                                real_batches=1), None, r"syn-steps 0"),
    ("tau above tau_max", dict(method="ali-dpfl", target_eps=5.0, tau_max=100), {"tau": 500},
     r"ali-dpfl tau 500 above the 100 accesses its rounds are accounted for"),
    ("tau above the node's maximum", dict(method="ali-dpfl", target_eps=5.0, tau_max=1000),
     {"tau": 300}, r"300 accesses per round above the node's maximum 200"),
    ("seeded noise", dict(reproducible_noise=True), None, r"reproducible-noise .* refused"),
    ("client-level method", dict(method="dp-normfedavg"), None,
     r"method dp-normfedavg is not allowed .* client-level epsilon bounds a whole client"),
    ("local-DP method", dict(method="ldp-fl", sigma=None, ldp_epsilon=0.5), None,
     r"method ldp-fl is not allowed .* local epsilon bounds each reported weight"),
    ("large delta", dict(delta=1e-3), None, r"delta 0.001 above the node's 1e-05"),
    ("large clip", dict(clip=50.0), None, r"clip 50 above the node's maximum 10"),
]


@pytest.mark.parametrize("name, change, extras, reason", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_malicious_instruction_is_refused_and_ledger_unchanged(tmp_path, name, change, extras,
                                                              reason):
    ctx = node(tmp_path, max_clip=10.0)
    assert answer(ctx, cfg_of(), 1) is None  # an honest round 1 is answered
    before = ledger_bytes(ctx)
    refusal = answer(ctx, cfg_of(**change), 2, extras)
    assert refusal is not None and "\n" not in refusal
    assert __import__("re").search(reason, refusal), refusal
    assert ledger_bytes(ctx) == before  # nothing entered for a refused instruction
    assert "state-tree" in ctx.state.config_records  # only round 1's state


def test_refused_before_any_answer_creates_no_ledger(tmp_path):
    ctx = node(tmp_path)
    assert answer(ctx, cfg_of(sigma=1e-3), 1) is not None
    assert ledger_bytes(ctx) is None and "state-tree" not in ctx.state.config_records


def test_replays_and_run_changes_are_refused(tmp_path):
    ctx = node(tmp_path)
    assert answer(ctx, cfg_of(), 2) is None
    entries = json.loads(ledger_bytes(ctx))["entries"]
    before = ledger_bytes(ctx)
    assert "round 2 is already answered in run 7 (a replay)" in answer(ctx, cfg_of(), 2)
    assert "round 1 is not after round 2" in answer(ctx, cfg_of(), 1)
    assert "changes sigma within run 7 (was 1.0, now 2.0)" in answer(ctx, cfg_of(sigma=2.0), 3)
    assert ledger_bytes(ctx) == before
    assert answer(ctx, cfg_of(rounds=5), 3) is None  # more rounds: not a change of the run
    saved = json.loads(ledger_bytes(ctx))
    assert [e["round"] for e in saved["entries"]] == [2, 3] and entries[0]["round"] == 2
    # the node's own N_k and the instructed B: q = B / N_k, entered at the full T
    n_k = expected_partitions(cfg_of())[0].size
    assert saved["size"] == n_k and saved["entries"][0]["q2"] == pytest.approx(32 / n_k)
    assert saved["entries"][0]["local_steps"] == 2 and saved["entries"][0]["delta"] == 1e-5


def test_budget_exhaustion_is_refused_also_across_runs(tmp_path):
    ctx = node(tmp_path)
    assert answer(ctx, cfg_of(), 1) is None
    eps1 = json.loads(ledger_bytes(ctx))["entries"][-1]["epsilon"]
    ctx.node_config["epsilon"] = eps1 * 1.01  # the operator's budget: one round
    before = ledger_bytes(ctx)
    refusal = answer(ctx, cfg_of(), 2)
    assert refusal.startswith("round 2 would spend epsilon")
    assert "above the node's budget" in refusal
    assert ledger_bytes(ctx) == before
    # a new run id does not reset the budget: the first run's epsilon is counted
    other = Context(run_id=8, node_id=1, node_config=dict(ctx.node_config), state=RecordDict(),
                    run_config={})
    refusal = answer(other, cfg_of(), 1)
    assert "earlier runs" in refusal and "above the node's budget" in refusal


def test_server_fails_the_round_with_one_line_naming_client_and_rule(tmp_path):
    """Through the real driver: node 1's budget allows one round; round 2 fails on the server
    with the node's reason, and the server's ledger counts the round (interrupted)."""
    cfg = cfg_of()
    probe = FakeGrid(2, node_config={"threat-model": "server"})
    train(cfg_of(rounds=1), tmp_path / "probe", "cpu",
          ask_clients=_driver(probe, cfg_of(rounds=1)))
    eps1 = max(json.loads(p.read_text())["entries"][-1]["epsilon"]
               for p in probe.state_root.glob("node-*/run-1.json"))
    grid = FakeGrid(2, node_config={"threat-model": "server"})
    grid.contexts[101].node_config["epsilon"] = eps1 * 1.01
    with pytest.raises(ClientFailure) as err:
        train(cfg, tmp_path / "run", "cpu", ask_clients=_driver(grid, cfg))
    message = str(err.value)
    assert message.startswith("round 2 failed: client 1 refused round 2: round 2 would spend "
                              "epsilon") and "\n" not in message
    ledger = load_checkpoint(tmp_path / "run" / CHECKPOINT)["ledger"]
    assert [(e["round"], e["status"]) for e in ledger] == [(1, "completed"), (2, "interrupted")]


def test_a_run_the_policy_refuses_fails_at_discovery():
    cfg = cfg_of()
    grid = FakeGrid(2, node_config={"threat-model": "server"})
    grid.contexts[101].node_config["min-sigma"] = 2.0
    with pytest.raises(FlowerError, match=r"^client 1 refused the run: sigma 1 below the node's "
                                          r"minimum 2$"):
        _driver(grid, cfg)


def test_policy_file_and_node_config(tmp_path):
    path = write_policy(tmp_path / "p.toml", min_sigma=1.0, allowed_methods=["dp-fedavg"],
                        epsilon=3.0)
    policy = NodePolicy.from_node_config({"policy-file": str(path), "epsilon": 2.0,
                                          "partition-id": 0})
    assert policy.min_sigma == 1.0 and policy.allowed_methods == ("dp-fedavg",)
    assert policy.epsilon == 2.0 and not policy.allow_reproducible_noise
    # the default admits the record-level methods only
    assert NodePolicy().allowed_methods == ("fedlap-dp", "dp-fedavg", "dp-fedprox", "ali-dpfl")
    assert NodePolicy().budget("record-level") == 10.0 and NodePolicy().budget("none") is None
    assert NodePolicy(local_epsilon=2.0).budget("local") == 2.0
    assert NodePolicy().budget("client-level") is None
    for bad, match in (({"min-sigmaa": 1}, "unknown key"), ({"epsilon": "3"}, "wrong type"),
                       ({"threat-model": "hidden-selection"}, "server or trusted-server"),
                       ({"max-lr": float("inf")}, "max-lr must be finite"),
                       ({"local-epsilon": 0.0}, "local-epsilon must be finite, > 0"),
                       ({"min-batch-size": 0}, "min-batch-size must be >= 1")):
        with pytest.raises(ConfigError, match=match):
            NodePolicy.from_values(bad)


def test_data_file_partition_is_pinned_by_its_hash(tmp_path):
    """A node with its own data file: the server pins its hash at discovery; records that
    change mid-run are refused (by the node's ledger, and the server fails the round)."""
    cfg = cfg_of(rounds=2)
    data = load_dataset(cfg.dataset)
    from fedlap_privacy.fl.engine.simulation import client_parts

    files = []
    for k, part in enumerate(client_parts(cfg, data)):
        files.append(tmp_path / f"part{k}.npz")
        np.savez(files[-1], x=data.x_train[part], y=data.y_train[part])
    grid = FakeGrid(2, node_config={"threat-model": "server"})
    for i, ctx in enumerate(grid.contexts.values()):
        ctx.node_config["data-file"] = str(files[i])
    clients = _driver(grid, cfg)
    assert {i.source for i in clients.nodes.values()} == {"data-file"}
    original = np.load(files[1])
    seen = []

    def swap(event):  # after round 1, node 1's operator swaps its records
        if isinstance(event, RoundEnded) and not seen:
            seen.append(1)
            np.savez(files[1], x=original["x"][:-1], y=original["y"][:-1])

    with pytest.raises(ClientFailure, match=r"client 1 refused round 2: this node's records "
                                            r"changed within run 1"):
        train(cfg, tmp_path / "run", "cpu", swap, ask_clients=clients)


def _driver(grid: FakeGrid, cfg: TrainConfig, **kw) -> FlowerClients:
    clients = FlowerClients(grid, node_wait=5.0, log=lambda line: None, **kw)  # type: ignore[arg-type]
    clients.discover(cfg, expected_partitions(cfg))
    return clients


# ----------------------------------------------------- notions, server-chosen values, bad input
RECORD_LEVEL = ("fedlap-dp", "dp-fedavg", "dp-fedprox", "ali-dpfl")
#: the malicious server's LDP-FL instruction (issue 33): a small per-weight epsilon, one local
#: step on a one-record batch at a huge learning rate, and ranges it chose itself
ATTACK = dict(method="ldp-fl", sigma=None, ldp_epsilon=0.5, local_steps=1, batch_size=1,
              rounds=20)
ATTACK_LR = 1e4


def _server_ranges(cfg: TrainConfig) -> torch.Tensor:
    """Centre 0, radius 1e-6 for every layer: each report becomes the sign of its weight."""
    layers = len(build_model(default_model_config(cfg, load_dataset(cfg.dataset))).state_dict())
    return torch.tensor([[0.0, 1e-6]] * layers)


def _read_label(report: dict, sizes: list[int]) -> int:
    """The server's read-out: the classifier row (and bias) whose reported weights went up."""
    flat = torch.empty(sum(sizes))
    flat[report["positions"].long()] = report["values"]
    bias = flat[-sizes[-1]:]
    rows = flat[-sizes[-1] - sizes[-2]:-sizes[-1]].reshape(len(bias), -1)
    return int(((rows > 0).sum(1) + (bias > 0).long()).argmax())


def test_ldpfl_attack_reads_the_label_and_the_default_policy_refuses_it(tmp_path):
    """Issue 33: what the old default node answered. Played against the method itself, the
    instruction reveals the label of the one record the step saw (10 of 10); the node's
    decision function and its ClientApp now refuse it before reading a record."""
    from fedlap_privacy.fl.flower.policy import PolicyRefusal
    from fedlap_privacy.fl.methods.interface import RoundInfo, build_method

    cfg = cfg_of(**ATTACK)
    data = load_dataset(cfg.dataset)
    torch.manual_seed(0)
    model = build_model(default_model_config(cfg, data))
    sizes = [t.numel() for t in model.state_dict().values()]
    info = RoundInfo(1, cfg.rounds, ATTACK_LR, {"ranges": _server_ranges(cfg)})
    method = build_method(cfg, torch.device("cpu"))
    read = []
    for i in range(10):
        x, y = torch.from_numpy(data.x_train[i:i + 1]), torch.from_numpy(data.y_train[i:i + 1])
        reply = method.client(model, x, y.long(), {}, info, torch.Generator().manual_seed(i))
        read.append(_read_label(reply.payload, sizes) == int(y))
    assert all(read)  # the exploit works whenever a node executes the instruction
    with pytest.raises(PolicyRefusal, match=r"method ldp-fl is not allowed .* no record"):
        NodePolicy().check(cfg, info)
    with pytest.raises(PolicyRefusal, match=r"not allowed"):
        NodePolicy().check_config(cfg, discovery=True)
    ctx = node(tmp_path)
    refusal = answer(ctx, cfg, 1, {"ranges": _server_ranges(cfg)}, lr=ATTACK_LR)
    assert refusal is not None and refusal.startswith("method ldp-fl is not allowed")
    assert ledger_bytes(ctx) is None  # nothing entered, no budget touched


def _ldp_node(tmp_path: Path, **policy) -> Context:
    """A node whose policy names ldp-fl (its explicit opt-in) beside the record-level ones."""
    return node(tmp_path, allowed_methods=",".join((*RECORD_LEVEL, "ldp-fl")), **policy)


def test_a_policy_naming_ldpfl_still_bounds_lr_batch_steps_and_ranges(tmp_path):
    """Opted in, the node refuses the attack's learning rate, batch size and local steps,
    and reports with its OWN ranges (the global model's, by the method's rule), never the
    server's."""
    from fedlap_privacy.fl.flower.codec import unpack
    from fedlap_privacy.fl.flower.policy import PolicyRefusal, node_round_info
    from fedlap_privacy.fl.methods.interface import RoundInfo
    from fedlap_privacy.fl.methods.ldpfl import layer_ranges, output_scale

    ctx = _ldp_node(tmp_path)
    policy = NodePolicy.from_node_config(dict(ctx.node_config))
    ranges = _server_ranges(cfg_of(**ATTACK))
    honest = dict(ATTACK, batch_size=32, local_steps=2)
    for change, lr, reason in (
            ({}, ATTACK_LR, r"batch size 1 below the node's minimum 10 for ldp-fl"),
            ({"batch_size": 32}, ATTACK_LR,
             r"learning rate 10000 outside the node's bounds \(0, 10\] \(max-lr\)"),
            ({"batch_size": 32, "local_steps": 500}, 0.1,
             r"500 local steps above the node's maximum 200"),
            ({"batch_size": 32}, float("nan"), r"learning rate nan outside")):
        cfg = cfg_of(**{**ATTACK, **change})
        with pytest.raises(PolicyRefusal, match=reason):
            policy.check(cfg, RoundInfo(1, cfg.rounds, lr, {"ranges": ranges}))
        refusal = answer(ctx, cfg, 1, {"ranges": ranges}, lr=lr)
        assert refusal is not None and __import__("re").search(reason, refusal), refusal
    assert ledger_bytes(ctx) is None
    # the decision function replaces the server's ranges by the node's own
    cfg = cfg_of(**honest)
    torch.manual_seed(0)
    weights = build_model(default_model_config(cfg, load_dataset(cfg.dataset))).state_dict()
    own = node_round_info(cfg, RoundInfo(1, cfg.rounds, 0.1, {"ranges": ranges}), weights)
    assert torch.equal(own.extras["ranges"], layer_ranges(weights))
    # through the ClientApp: every reported value is c +- r (e^eps+1)/(e^eps-1) of the
    # node's range of its layer, none is the server's +-1e-6 (x the same factor)
    reason, reply = reply_to(ctx, instruction(cfg, 1, {"ranges": ranges}))
    assert reason is None
    report = unpack(reply.content, "payload", torch.device("cpu"))
    layer = torch.repeat_interleave(torch.arange(len(weights)),
                                    torch.tensor([t.numel() for t in weights.values()]))
    c, r = layer_ranges(weights)[layer[report["positions"].long()]].double().unbind(1)
    offset = (report["values"].double() - c).abs()
    assert torch.allclose(offset, r * output_scale(0.5), rtol=1e-5)
    assert (offset > 1e-3).all()


def test_ldpfl_is_charged_to_its_own_budget_never_the_record_level_one(tmp_path):
    """A node naming ldp-fl: its per-weight epsilon goes to ``local-epsilon``. With a
    record-level budget of 0.6 (the old node charged ldp-fl against it and refused round 2)
    it answers 2 rounds of 0.5 within local-epsilon 1, refuses the 3rd on the local budget,
    and a later DP-FedAvg run on the same records is charged only its own epsilon."""
    ctx = _ldp_node(tmp_path, epsilon=0.6, local_epsilon=1.0)
    cfg = cfg_of(**dict(ATTACK, batch_size=32, local_steps=2))
    for m in (1, 2):
        assert answer(ctx, cfg, m) is None
    saved = json.loads(ledger_bytes(ctx))
    assert {e["notion"] for e in saved["entries"]} == {"local"}
    assert saved["entries"][-1]["epsilon"] == pytest.approx(1.0)
    refusal = answer(ctx, cfg, 3)
    assert refusal == ("round 3 would spend local epsilon 1.5 (this run 1.5), above the node's "
                       "budget 1 (local-epsilon)")
    # run 8 on the same records: record-level, charged nothing of run 7's local epsilon
    fresh = node(tmp_path / "fresh")
    assert answer(fresh, cfg_of(), 1) is None
    eps = json.loads(ledger_bytes(fresh))["entries"][-1]["epsilon"]
    ctx8 = Context(run_id=8, node_id=1, node_config={**ctx.node_config, "epsilon": eps * 1.01},
                   state=RecordDict(), run_config={})
    assert answer(ctx8, cfg_of(), 1) is None
    assert json.loads(ledger_bytes(ctx8))["entries"][-1]["epsilon"] == pytest.approx(eps)
    # and run 9 of ldp-fl still sees run 7's local epsilon (1 + 0.5 > 1)
    ctx9 = Context(run_id=9, node_id=1, node_config=dict(ctx.node_config), state=RecordDict(),
                   run_config={})
    assert "+ earlier runs 1), above the node's budget 1 (local-epsilon)" in answer(ctx9, cfg, 1)


def test_client_level_needs_a_naming_policy_and_a_trusted_server(tmp_path):
    named = node(tmp_path, allowed_methods=",".join((*RECORD_LEVEL, "dp-normfedavg")))
    assert "dp-normfedavg has no guarantee against the server" in answer(
        named, cfg_of(method="dp-normfedavg"), 1)
    trusting = node(tmp_path / "t", allowed_methods="dp-normfedavg",
                    threat_model="trusted-server")
    assert answer(trusting, cfg_of(method="dp-normfedavg", batch_size=16), 1) is None
    # no budget the node can keep for it: its epsilon is charged to no record-level budget
    assert json.loads(ledger_bytes(trusting))["entries"][-1]["notion"] == "none"


MALFORMED = [
    ("sigma", "", r"invalid instruction: dp-fedavg needs a sigma \(empty: the node does not "
                  r"plan one\)"),
    ("sigma", "abc", r"configuration key sigma must be float, not 'abc'"),
    ("sigma", float("nan"), r"invalid instruction: sigma nan must be a finite number >= 0"),
    ("clip", float("inf"), r"invalid instruction: clip inf must be a finite number >= 0"),
    ("lr-local", -1.0, r"invalid instruction: lr-local -1.0 must be a finite number >= 0"),
    ("img-momentum", float("-inf"), r"img-momentum -inf must be a finite number >= 0"),
    ("batch-size", -4, r"invalid instruction: batch-size -4 must be a finite number >= 0"),
]


@pytest.mark.parametrize("key, raw, reason", MALFORMED, ids=[f"{k}={v!r}" for k, v, _ in MALFORMED])
def test_malformed_run_config_values_are_refused_in_one_line(tmp_path, key, raw, reason):
    """At discovery and in a round: a refusal naming the value, never an AssertionError."""
    ctx = node(tmp_path)
    query = instruction(cfg_of(), 1, **{key: raw})
    query = Message(RecordDict({"config": query.content.config_records["config"]}), 1, "query")
    for msg in (query, instruction(cfg_of(), 1, **{key: raw})):
        refusal, _ = reply_to(ctx, msg)
        assert refusal is not None and "\n" not in refusal
        assert __import__("re").search(reason, refusal), refusal
    assert ledger_bytes(ctx) is None


def test_empty_sigma_with_a_target_is_a_plan_at_discovery_only(tmp_path):
    """``sigma=""`` with a target epsilon: the server plans sigma, so discovery admits it; a
    round must carry the planned sigma."""
    ctx = node(tmp_path)
    cfg = cfg_of(sigma=None, target_eps=3.0)
    content = RecordDict({"config": ConfigRecord(config_values(cfg))})
    refusal, reply = reply_to(ctx, Message(content, 1, "query"))
    assert refusal is None and "node" in reply.content.config_records
    assert answer(ctx, cfg, 1) == ("invalid instruction: dp-fedavg needs a sigma (empty: the "
                                   "node does not plan one)")


@pytest.mark.parametrize("record, reason", [
    ({"round": float("nan"), "rounds": 3, "lr": 0.1}, r"round must be int, not nan"),
    ({"round": 0, "rounds": 3, "lr": 0.1}, r"round 0 and rounds 3 must be >= 1"),
    ({"round": 1, "rounds": 3, "lr": "0.1"}, r"lr must be float"),
    ({"round": 1, "rounds": 3, "lr": float("inf")}, r"learning rate inf outside"),
])
def test_malformed_round_values_are_refused(tmp_path, record, reason):
    ctx = node(tmp_path)
    msg = instruction(cfg_of(), 1)
    msg.content["round"] = ConfigRecord(record)
    refusal, _ = reply_to(ctx, msg)
    assert refusal is not None and __import__("re").search(reason, refusal), refusal
    assert ledger_bytes(ctx) is None


def test_a_node_refuses_a_sigma_or_a_round_clip_outside_its_policy(tmp_path):
    policy = dict(allowed_methods="dp-fedavg-client", threat_model="trusted-server",
                  min_sigma=0.8, max_clip=2.0)
    ctx = node(tmp_path, **policy)
    ok = cfg_of(method="dp-fedavg-client", batch_size=16, sigma=1.0, clip=1.0)
    assert answer(ctx, ok, 1, extras={"clip": 1.0}) is None
    assert "clip norm 5.0 outside the node's bounds (0, 2]" in answer(
        node(tmp_path / "a", **policy), ok, 1, extras={"clip": 5.0})
    # fixed cohorts are accounted at sigma / 2: 1.0 is 0.5 to the accountant, below 0.8
    fixed = cfg_of(method="dp-fedavg-client", batch_size=16, sigma=1.0, clip=1.0,
                   clients_per_round=1)
    assert "sigma 0.5 below the node's minimum 0.8" in answer(
        node(tmp_path / "b", **policy), fixed, 1, extras={"clip": 1.0})


@pytest.mark.parametrize("method", ["dp-fedavg-client", "dp-normfedavg", "fedavg"])
def test_the_cross_device_defaults_pass_the_default_node_policy(method):
    """``train``'s cross-device defaults (the README's command: 3,000 FashionMNIST clients,
    B 10) and the node policy's default ``min-batch-size`` agree: a node whose policy
    admits the method (it names it and trusts the server; nothing else changed) admits the
    run, and a node that raises the floor above train's B refuses it, naming the rule."""
    from fedlap_privacy.fl.config_resolve import resolve_config

    cfg = resolve_config(None, {"method": method, "dataset": "fashion-mnist",
                                "clients": 3000, "split": "dirichlet",
                                "client_fraction": 1 / 30, "target_eps": 2, "rounds": 30},
                         [], schedule="auto")
    assert cfg.batch_size == NodePolicy().min_batch_size == 10
    admits = NodePolicy(allowed_methods=(method,), threat_model="trusted-server")
    admits.check_config(cfg, discovery=True)
    stricter = NodePolicy(allowed_methods=(method,), threat_model="trusted-server",
                          min_batch_size=16)
    with pytest.raises(PolicyRefusal, match="batch size 10 below the node's minimum 16"):
        stricter.check_config(cfg, discovery=True)
