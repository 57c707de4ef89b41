"""``train --engine flower-simulation``: the Flower App on Flower's Simulation Engine (Ray).

Each run starts Ray on this machine and stops it after (Ray's start is the slow part). The
engine's run equals the in-process run bit for bit under
``--reproducible-noise`` (weights, ledger, metrics); each virtual node keeps its own ledger
and applies the node policy, as a SuperNode does. The 1,000-client equality is a slow test
(and ``benchmarks/speed/flower_simulation.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

import pytest
import torch

flwr = pytest.importorskip("flwr")
ray = pytest.importorskip("ray")

import helpers  # noqa: E402
from flower_grid import task_identity, write_policy  # noqa: E402, F401
from typer.testing import CliRunner  # noqa: E402

from fedlap_privacy.cli.main import app  # noqa: E402
from fedlap_privacy.fl.engine.simulation import CHECKPOINT, train  # noqa: E402
from fedlap_privacy.fl.flower.simulation_engine import (  # noqa: E402
    SimulationResources,
    node_config_mod,
)
from fedlap_privacy.fl.run.run_records import RoundRecord  # noqa: E402
from fedlap_privacy.state.checkpoint import PRIVATE, PRIVATE_FORMAT, load_checkpoint  # noqa: E402

SIM = dict(clients=3, reproducible_noise=True)


def _sets(**over) -> list[str]:
    values = {**helpers.TINY, **SIM, **over}
    return [f"--set={k}={v}" for k, v in values.items() if k not in ("rounds", "clients")]


def _strip(history: list) -> list[dict]:
    return [{k: v for k, v in (h if isinstance(h, dict) else h.to_json()).items()
             if k != "seconds"} for h in history]


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """A 3-client, 2-round FedLAP-DP run through the CLI with a node policy that admits
    seeded noise (Ray started for it on this machine, and stopped) and the same run
    in-process. One torch thread everywhere: a thread count reorders float sums."""
    root = tmp_path_factory.mktemp("flower-sim")
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "RAY_ADDRESS", "RAY_TMPDIR")}
    os.environ["OMP_NUM_THREADS"] = "1"
    # another user's cluster, named by the environment and by Ray's session file: the run
    # starts a Ray of its own and never connects to it
    foreign = socket.socket()
    foreign.bind(("127.0.0.1", 0))
    foreign.listen(8)
    foreign.setblocking(False)
    planted = f"127.0.0.1:{foreign.getsockname()[1]}"
    (root / "ray").mkdir()
    (root / "ray" / "ray_current_cluster").write_text(planted)
    os.environ.update(RAY_ADDRESS=planted, RAY_TMPDIR=str(root))
    try:
        allow = write_policy(root / "allow.toml", allow_reproducible_noise=True)
        ok = CliRunner().invoke(app, [
            "train", "--engine", "flower-simulation", "--clients", "3", "--rounds", "2",
            "--device", "cpu", "--json", "--client-cpus", "1", "--out", str(root / "sim"),
            "--node-policy", str(allow), *_sets()])
        if ok.exit_code == 2 and "Ray on this machine did not start" in ok.output:
            pytest.skip(ok.output.strip().splitlines()[-1])  # Ray's 30 s start-up limit
        with pytest.raises(BlockingIOError):
            foreign.accept()  # no connection reached the foreign cluster
        local = train(helpers.tiny(**SIM), root / "local", "cpu")
        yield root, ok, local
    finally:
        foreign.close()
        assert not ray.is_initialized()  # each run stopped the Ray it started
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_simulation_engine_equals_in_process_bit_for_bit(engine_runs):
    root, ok, local = engine_runs
    assert ok.exit_code == 0, ok.output
    summary = json.loads(ok.output.strip().splitlines()[-1])
    a = load_checkpoint(root / "sim" / CHECKPOINT)
    b = load_checkpoint(root / "local" / CHECKPOINT)
    assert a["ledger"] == b["ledger"] and len(a["ledger"]) == 2
    assert a["model_state"].keys() == b["model_state"].keys()
    assert all(torch.equal(a["model_state"][k], b["model_state"][k]) for k in a["model_state"])
    assert set(a) == set(b) and a["format"] == b["format"]  # audit reads it like train's
    assert _strip([RoundRecord.from_json(h) for h in a["history"]]) == _strip(local.history)
    assert summary["epsilon"] == local.summary.privacy.epsilon > 0
    assert summary["rounds_run"] == 2 and summary["stopped"] == "completed"
    pa = load_checkpoint(root / "sim" / PRIVATE, PRIVATE_FORMAT)
    assert pa["client_state"] == [{}, {}, {}]  # FedLAP's synthetic sets stayed on the nodes
    # the equality is not that of an untrained model: the weights moved from their init
    from fedlap_privacy.data.datasets import load_dataset
    from fedlap_privacy.fl.engine.simulation import default_model_config
    from fedlap_privacy.models import build_model

    cfg = helpers.tiny(**SIM)
    torch.manual_seed(cfg.seed)
    init = build_model(default_model_config(cfg, load_dataset(cfg.dataset))).state_dict()
    moved = sum(float((a["model_state"][k] - init[k]).pow(2).sum()) for k in init) ** 0.5
    assert moved > 0.1


def test_virtual_nodes_apply_the_node_policy(tmp_path):
    """A virtual node (the Simulation Engine gives it its partition-id only) reads the node
    policy the engine's mod gives it: a sigma below the policy's minimum is refused at
    discovery, in one line naming the rule, before its records are read."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from fedlap_privacy.fl.flower.client_app import make_client_app
    from fedlap_privacy.fl.flower.run_config import config_values

    strict = write_policy(tmp_path / "strict.toml", min_sigma=5.0)
    app_ = make_client_app([node_config_mod(str(tmp_path), "cpu", str(strict))])
    ctx = Context(run_id=3, node_id=11, node_config={"partition-id": 1, "num-partitions": 3},
                  state=RecordDict(), run_config={})
    cfg = helpers.tiny(clients=3, split_seed=0)
    query = Message(RecordDict({"config": ConfigRecord(config_values(cfg))}), 11, "query")
    reply = app_(query, ctx)
    refusal = reply.content.config_records["refusal"]
    assert "below the node's minimum 5" in str(refusal["reason"])
    assert refusal["partition-id"] == 1
    assert ctx.node_config["state-dir"] == f"{tmp_path}/node-1"


def test_resources_and_flags(tmp_path):
    res = SimulationResources(cpus=2, gpus=0.25, address="auto")
    config = res.backend_config()
    assert config["client_resources"] == {"num_cpus": 2, "num_gpus": 0.25}
    assert config["init_args"]["address"] == "auto" and res.node_device == "auto"
    assert SimulationResources().node_device == "cpu"
    assert SimulationResources().backend_config()["init_args"]["address"] == "local"
    with pytest.raises(Exception, match=r"needs at least 0\.1 CPU"):
        SimulationResources(cpus=0).validate()
    out = CliRunner().invoke(app, ["train", "--client-gpus", "1", "--out", str(tmp_path / "r"),
                                   "--rounds", "1"])
    assert out.exit_code == 2 and "apply to --engine flower-simulation only" in out.output
    assert not (tmp_path / "r").exists()


def test_the_pool_counts_clients_node_by_node_as_flower_sizes_its_actors():
    """Two Ray nodes of 2 and 4 CPUs hold 1 + 2 clients of 2 CPUs, one of 3 CPUs (a count
    over the cluster's 6 CPUs would say 2); a GPU share caps each node by its GPUs, a
    node without GPUs holds none; a node that left (no resources, not alive) holds none."""
    nodes = [{"Alive": True, "Resources": {"CPU": 2.0}},
             {"Alive": True, "Resources": {"CPU": 4.0, "GPU": 1.0}},
             {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}},
             {"Alive": True, "Resources": {}}]
    assert SimulationResources(cpus=1).pool_size(nodes) == 6
    assert SimulationResources(cpus=2).pool_size(nodes) == 3
    assert SimulationResources(cpus=3).pool_size(nodes) == 1
    assert SimulationResources(cpus=0.5, gpus=0.25).pool_size(nodes) == 4
    assert SimulationResources(cpus=1, gpus=0.5).pool_size(nodes) == 2
    assert SimulationResources(cpus=5).pool_size(nodes) == 0
    assert SimulationResources(cpus=1, gpus=0.5).pool_size(nodes[:1]) == 0


def test_node_config_mod_gives_each_virtual_node_its_state_folder(tmp_path):
    from flwr.app import Context, RecordDict

    seen = {}

    def call_next(msg, context):
        seen.update(context.node_config)
        return msg

    mod = node_config_mod(str(tmp_path), "cpu", "/p.toml")
    ctx = Context(run_id=1, node_id=9, node_config={"partition-id": 4, "num-partitions": 5},
                  state=RecordDict(), run_config={})
    mod("m", ctx, call_next)  # type: ignore[arg-type]
    assert seen == {"partition-id": 4, "num-partitions": 5, "state-dir": f"{tmp_path}/node-4",
                    "device": "cpu", "policy-file": "/p.toml"}


def test_virtual_nodes_keep_their_ledgers_in_the_run_folder_whatever_the_ray_address(
        tmp_path, monkeypatch):
    """Node ledgers live where the nodes do: a virtual node has no machine of its own, so
    its ledger is in the run folder (``flower-nodes/node-k``), for every ``--ray-address``
    (``local`` included), and survives the launch; a node that does not see this launch's
    run folder (a Ray node without the shared file system) refuses at discovery."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    import fedlap_privacy.fl.flower.simulation_engine as engine
    from fedlap_privacy.fl.flower.client_app import make_client_app
    from fedlap_privacy.fl.flower.grid_clients import FlowerError
    from fedlap_privacy.fl.flower.node_ledger import NODE_STATE
    from fedlap_privacy.fl.flower.run_config import config_values

    cfg = helpers.tiny(clients=3, split_seed=0)
    query = Message(RecordDict({"config": ConfigRecord(config_values(cfg))}), 11, "query")
    seen: list[tuple[str, dict]] = []

    def run_simulation(server_app, client_app, num_supernodes, backend_config):
        ctx = Context(run_id=3, node_id=11, node_config={"partition-id": 1,
                                                          "num-partitions": 3},
                      state=RecordDict(), run_config={})
        reply = client_app(query, ctx)
        seen.append((reply.metadata.message_type, dict(ctx.node_config)))

    monkeypatch.setattr(engine, "_ray", lambda resources: contextlib.nullcontext())
    monkeypatch.setattr("flwr.simulation.run_simulation", run_simulation)
    for address in (None, "local", "10.0.0.5:6379"):
        out = tmp_path / f"run-{address}"
        with pytest.raises(FlowerError, match="ended without a result"):
            engine.run_simulation_engine(cfg, out, "cpu", resources=SimulationResources(
                address=address))
        _, node_config = seen[-1]
        assert node_config["state-dir"] == str(out / NODE_STATE / "node-1")
        assert (out / NODE_STATE).is_dir()  # kept after the launch
    # the same node in a folder of the same name that is not this launch's: refused
    app_ = make_client_app([node_config_mod(str(tmp_path / "elsewhere"), "cpu", None,
                                            node_config["state-token"])])
    ctx = Context(run_id=3, node_id=11, node_config={"partition-id": 1, "num-partitions": 3},
                  state=RecordDict(), run_config={})
    refusal = app_(query, ctx).content.config_records["refusal"]
    assert "does not see the run's node ledgers" in str(refusal["reason"])


@pytest.mark.slow
def test_thousand_virtual_nodes_equal_in_process(tmp_path):
    """1,000 clients (FashionMNIST shards, FedAvg, a tenth of them per round, seeded
    batches): the Simulation Engine's checkpoint equals the in-process run's bit for bit."""
    import subprocess
    import sys

    data_dir = os.environ.get("FEDLAP_FMNIST", "/work/shared/data/fashion-mnist")
    if not Path(data_dir).is_dir():
        pytest.skip("FashionMNIST not found (set FEDLAP_FMNIST)")
    bench = helpers.repo_root() / "benchmarks" / "speed" / "flower_simulation.py"
    done = subprocess.run([sys.executable, str(bench), "--data-dir", data_dir, "--clients",
                           "1000", "--rounds", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bit for bit (flower-simulation): True" in done.stdout, done.stdout
