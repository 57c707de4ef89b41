"""The node's own policy and ledger on Flower: a curious server's crafted instructions are
refused before the node touches its data, and refusals leave the node ledger unchanged
(docs/threat-model.md, "Cross-silo deployment").

The fast tests play a malicious ServerApp: they build ``train`` messages by hand and call the
real ClientApp; the ``flower`` test runs a round over TLS with authenticated SuperNodes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")

from flower_grid import FakeGrid, task_identity, write_policy  # noqa: E402, F401
from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402

from fedlap_privacy.checkpoint import load_checkpoint  # noqa: E402
from fedlap_privacy.data import load_dataset  # noqa: E402
from fedlap_privacy.errors import ConfigError  # noqa: E402
from fedlap_privacy.fl.config import TrainConfig  # noqa: E402
from fedlap_privacy.fl.flower.codec import pack, weights_record  # noqa: E402
from fedlap_privacy.fl.flower.run_config import config_values  # noqa: E402
from fedlap_privacy.fl.flower_app import (  # noqa: E402
    ClientFailure,
    FlowerClients,
    FlowerError,
    NodePolicy,
    client_app,
    expected_partitions,
)
from fedlap_privacy.fl.simulation import CHECKPOINT, default_model_config, train  # noqa: E402
from fedlap_privacy.models import build_model  # noqa: E402

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


def instruction(cfg: TrainConfig, round_: int, extras: dict | None = None) -> Message:
    """A ``train`` message as a (malicious) server would craft it."""
    torch.manual_seed(0)
    model = build_model(default_model_config(cfg, load_dataset(cfg.dataset)))
    content = pack("extras", extras or {})
    content["weights"] = weights_record(model.state_dict())
    content["round"] = ConfigRecord({"round": round_, "rounds": cfg.rounds, "lr": 0.1})
    content["config"] = ConfigRecord(config_values(cfg))
    return Message(content, 1, "train")


def answer(ctx: Context, cfg: TrainConfig, round_: int, extras: dict | None = None) -> str | None:
    """The node's refusal, or None when it trained."""
    reply = client_app(instruction(cfg, round_, extras), ctx)
    assert not reply.has_error()
    rec = reply.content.config_records.get("refusal")
    if rec is None:
        assert "reply" in reply.content.config_records
        return None
    return str(rec["reason"])


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
     r"ALI-DPFL tau 500 above tau_max 100"),
    ("tau above the node's maximum", dict(method="ali-dpfl", target_eps=5.0, tau_max=1000),
     {"tau": 300}, r"300 accesses per round above the node's maximum 200"),
    ("seeded noise", dict(reproducible_noise=True), None, r"reproducible-noise .* refused"),
    ("trusted-server method", dict(method="dp-normfedavg"), None,
     r"dp-normfedavg has no guarantee against the server"),
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
    assert NodePolicy().allowed_methods == (
        "fedlap-dp", "dp-fedavg", "dp-fedprox", "ali-dpfl", "dp-normfedavg", "ldp-fl")
    for bad, match in (({"min-sigmaa": 1}, "unknown key"), ({"epsilon": "3"}, "wrong type"),
                       ({"threat-model": "hidden-selection"}, "server or trusted-server")):
        with pytest.raises(ConfigError, match=match):
            NodePolicy.from_values(bad)


def test_data_file_partition_is_pinned_by_its_hash(tmp_path):
    """A node with its own data file: the server pins its hash at discovery; records that
    change mid-run are refused (by the node's ledger, and the server fails the round)."""
    cfg = cfg_of(rounds=2)
    data = load_dataset(cfg.dataset)
    from fedlap_privacy.fl.simulation import client_parts

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

    def swap(event, info):  # after round 1, node 1's operator swaps its records
        if event == "round_end" and not seen:
            seen.append(1)
            np.savez(files[1], x=original["x"][:-1], y=original["y"][:-1])

    with pytest.raises(ClientFailure, match=r"client 1 refused round 2: this node's records "
                                            r"changed within run 1"):
        train(cfg, tmp_path / "run", "cpu", swap, ask_clients=clients)


def _driver(grid: FakeGrid, cfg: TrainConfig, **kw) -> FlowerClients:
    clients = FlowerClients(grid, node_wait=5.0, log=lambda line: None, **kw)  # type: ignore[arg-type]
    clients.discover(cfg, expected_partitions(cfg))
    return clients


# --------------------------------------------------------------------------- TLS + node auth
def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1 (openssl)."""
    folder.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test CA",
        "-keyout", "ca.key", "-out", "ca.crt")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout",
        "server.key", "-out", "server.csr")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", "server.pem")
    return folder / "ca.crt", folder / "server.pem", folder / "server.key"


def _node_key(path: Path) -> Path:
    """An ECDSA key pair in OpenSSH format (what flower-supernode and `flwr supernode
    register` read): ``path`` and ``path.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    path.with_name(path.name + ".pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    return path


@pytest.mark.flower
def test_round_over_tls_with_authenticated_supernodes(tmp_path):
    """SuperLink with TLS (throw-away CA) and --enable-supernode-auth; two SuperNodes whose
    public keys were registered run one round; a SuperNode with an unregistered key is
    refused by the SuperLink (Flower exit code 305) and never joins."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make the test certificates")
    from fedlap_privacy.fl.flower_app import LocalDeployment, Secure, run_on

    ca, cert, key = _certificates(tmp_path / "certs")
    keys = tuple(_node_key(tmp_path / "certs" / f"node{k}") for k in range(2))
    rogue = _node_key(tmp_path / "certs" / "rogue")
    policy = write_policy(tmp_path / "policy.toml", min_sigma=1.0)
    secure = Secure(ca, cert, key, keys)
    with LocalDeployment(2, tmp_path / "work", "cpu", policy_file=policy,
                         secure=secure) as dep:
        intruder = dep.start_node(0, key=rogue, log_name="rogue.log")
        result = run_on(dep, cfg_of(rounds=1), tmp_path / "run", "cpu")
        assert result.summary["rounds_run"] == 1 and result.history[0]["replies"] == 2
        end = time.monotonic() + 30
        while intruder.poll() is None and time.monotonic() < end:
            time.sleep(0.5)
        log = (tmp_path / "work" / "rogue.log").read_text(errors="replace")
        assert intruder.returncode not in (None, 0), log[-500:]
        assert "Failed to activate SuperNode" in log
        listed = subprocess.run([dep.exe("flwr"), "supernode", "list", dep.CONNECTION,
                                 "--format", "json"], env=dep.env, capture_output=True,
                                text=True, timeout=60)
        assert listed.stdout.count('"status": "online"') == 2, listed.stdout[-800:]
    for k in range(2):  # each node kept its own ledger, in its own state folder
        (path,) = (tmp_path / "work" / f"node-{k}").glob("run-*.json")
        saved = json.loads(path.read_text())
        assert [e["round"] for e in saved["entries"]] == [1]
