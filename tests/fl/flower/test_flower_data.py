"""Flower nodes on a user's records and model (issue 34): a node's data-file in the formats
of ``--data`` (tabular too), the model factory named by the run config and imported only when
the node's policy lists it, the server's model and the node's checked against each other.

The node-side pieces run through the real ClientApp in-process (:class:`FakeGrid`); the one
test marked ``flower`` starts a real local deployment from the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")

import helpers  # noqa: E402
from flower_grid import FakeGrid, task_identity, write_policy  # noqa: E402, F401
from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from user_records import CLASSES, FEATURES, blobs, tabular_folder  # noqa: E402

from fedlap_privacy.errors import ConfigError  # noqa: E402
from fedlap_privacy.fl.config import TrainConfig  # noqa: E402
from fedlap_privacy.fl.engine.flower_app import client_app  # noqa: E402
from fedlap_privacy.fl.engine.simulation import CHECKPOINT, client_parts, train  # noqa: E402
from fedlap_privacy.fl.flower.codec import pack, pack_into  # noqa: E402
from fedlap_privacy.fl.flower.grid_clients import (  # noqa: E402
    FlowerClients,
    FlowerError,
    expected_partitions,
    instruction_config,
    model_shape,
    run_data,
)
from fedlap_privacy.fl.flower.node_model import ModelShape  # noqa: E402
from fedlap_privacy.fl.flower.policy import NodePolicy  # noqa: E402
from fedlap_privacy.fl.flower.run_config import config_values  # noqa: E402
from fedlap_privacy.fl.run.user_runs import with_data  # noqa: E402
from fedlap_privacy.model_factory import DEFAULT_TABULAR  # noqa: E402
from fedlap_privacy.state.checkpoint import PRIVATE, load_checkpoint  # noqa: E402

SECRET = 20240607  # the run's split seed (the ServerApp draws a secret one)
#: a factory file; importing it leaves a marker beside it (a node must not import it unless
#: its policy lists it)
FACTORY_CODE = '''
from pathlib import Path

from torch import nn

Path(__file__).with_suffix(".imported").touch()


def mlp(input_shape, num_classes):
    return nn.Sequential(nn.Linear(input_shape[0], 12), nn.LayerNorm(12), nn.Tanh(),
                         nn.Linear(12, num_classes))


def wider(input_shape, num_classes):
    return nn.Sequential(nn.Linear(input_shape[0], 16), nn.LayerNorm(16), nn.Tanh(),
                         nn.Linear(16, num_classes))
'''


def factory(folder: Path, name: str = "mlp") -> str:
    """The spec ``/abs/models.py:NAME`` of :data:`FACTORY_CODE` written into ``folder``."""
    path = folder / "models.py"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(FACTORY_CODE)
    return f"{path.resolve()}:{name}"


def imported(spec: str) -> bool:
    return Path(spec.rpartition(":")[0]).with_suffix(".imported").exists()


def tabular_cfg(data: Path, spec: str, **kw) -> TrainConfig:
    """Three sites of blobs, DP-FedAvg with seeded noise (the engines agree bit for bit)."""
    values = dict(method="dp-fedavg", sigma=2.0, clients=3, reproducible_noise=True,
                  model=spec)
    return with_data(helpers.tiny(**{**values, **kw}), data)


def node(tmp_path: Path, **config) -> Context:
    """A SuperNode holding partition 0 of 3 with the default policy, updated by ``config``."""
    values = {"partition-id": 0, "num-partitions": 3, "device": "cpu",
              "state-dir": str(tmp_path / "state"), **config}
    return Context(run_id=7, node_id=1, node_config=values, state=RecordDict(), run_config={})


def query(cfg: TrainConfig, shape: ModelShape | None = None) -> Message:
    content = RecordDict({"config": ConfigRecord(config_values(cfg))})
    if shape is not None:
        content["model"] = shape.to_record()
    return Message(content, 1, "query")


def refusal(ctx: Context, msg: Message) -> str | None:
    reply = client_app(msg, ctx)
    assert not reply.has_error()
    rec = reply.content.config_records.get("refusal")
    return None if rec is None else str(rec["reason"])


SHAPE = ModelShape((FEATURES,), CLASSES)


# ----------------------------------------------------------------------- a whole run, in-process
@pytest.mark.parametrize("source", ["data-file", "simulated-split"])
def test_tabular_custom_model_on_flower_equals_in_process(tmp_path, source):
    """Tabular records and a custom model: the nodes (their own data files, or the simulated
    split of the run's data) and the in-process engine give the same model, ledger and
    metrics bit for bit; the factory reaches the nodes as a spec their policy lists."""
    spec = factory(tmp_path / "code")
    cfg = tabular_cfg(tabular_folder(tmp_path / "d"), spec)
    sent, data = run_data(instruction_config(cfg, SECRET))
    grid = FakeGrid(3, partitions=[2, 0, 1], node_config={"allowed-models": spec})
    if source == "data-file":
        parts = client_parts(sent, data)
        for ctx in grid.contexts.values():
            k = int(ctx.node_config["partition-id"])
            path = tmp_path / f"node{k}.npz"
            np.savez(path, x=data.x_train[parts[k]].astype(np.float64),
                     y=data.y_train[parts[k]].astype(np.int32), num_classes=CLASSES)
            ctx.node_config["data-file"] = str(path)
    clients = FlowerClients(grid, node_wait=5.0, log=lambda line: None)  # type: ignore[arg-type]
    clients.discover(sent, expected_partitions(sent), model_shape(data))
    assert {i.source for i in clients.nodes.values()} == {source}
    flower = train(cfg, tmp_path / "flower", "cpu", ask_clients=clients, split_seed=SECRET)
    local = train(cfg, tmp_path / "local", "cpu", split_seed=SECRET)
    a, b = (load_checkpoint(tmp_path / d / CHECKPOINT) for d in ("flower", "local"))
    assert a["ledger"] == b["ledger"] and len(a["ledger"]) == 2
    assert a["model_state"].keys() == b["model_state"].keys()
    assert all(torch.equal(a["model_state"][k], b["model_state"][k]) for k in a["model_state"])
    assert a["model_factory"] == b["model_factory"] == {
        "factory": spec, "input_shape": [FEATURES], "num_classes": CLASSES}
    strip = [dataclasses.replace(h, seconds=None) for h in flower.history]
    assert strip == [dataclasses.replace(h, seconds=None) for h in local.history]
    sent_train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert sent_train and all(m.content.config_records["model"]["input-shape"] == [FEATURES]
                              for m in sent_train)


# ----------------------------------------------------------------------- the node's model policy
@pytest.mark.parametrize("named", ["file", "installed module"])
def test_a_factory_the_policy_does_not_list_is_never_imported(tmp_path, named):
    spec = factory(tmp_path / "code") if named == "file" else "this_module_is_not_there:f"
    cfg = tabular_cfg(tabular_folder(tmp_path / "d"), spec, split_seed=SECRET,
                      reproducible_noise=False)
    reason = refusal(node(tmp_path), query(cfg, SHAPE))
    assert reason == (f"model {spec!r} is not allowed by the node's policy (allowed-models: "
                      f"{DEFAULT_TABULAR}); importing it would run its code on this node")
    if named == "file":
        assert not imported(spec)
    listed = node(tmp_path, **{"allowed-models": spec})
    if named == "file":
        assert refusal(listed, query(cfg, SHAPE)) is None and imported(spec)
    else:  # listed but not installed on the node: one line
        assert refusal(listed, query(cfg, SHAPE)).startswith(
            f"--model {spec!r}: cannot import it (ModuleNotFoundError")


def test_the_default_policy_admits_the_built_in_tabular_model(tmp_path):
    cfg = with_data(helpers.tiny(method="dp-fedavg", sigma=0.8, clients=3, split_seed=SECRET),
                    tabular_folder(tmp_path / "d"))
    assert refusal(node(tmp_path), query(cfg, SHAPE)) is None
    assert refusal(node(tmp_path, **{"allowed-models": ""}), query(cfg, SHAPE)).startswith(
        f"model {DEFAULT_TABULAR!r} is not allowed by the node's policy (allowed-models: none)")


def test_allowed_models_policy_values():
    assert NodePolicy().allowed_models == (DEFAULT_TABULAR,)
    policy = NodePolicy.from_values({"allowed-models": "a.b:f, /srv/m.py:g"})
    assert policy.allowed_models == ("a.b:f", "/srv/m.py:g")
    for bad, match in (({"allowed-models": "a.b"}, "'a.b' is not module:FUNC"),
                       ({"allowed-models": [1]}, "wrong type")):
        with pytest.raises(ConfigError, match=match):
            NodePolicy.from_values(bad)


# ----------------------------------------------------------------------- the node's data file
def _bad_files(tmp_path: Path) -> list[tuple[str, dict, str]]:
    x, y = blobs(20, 3)
    return [
        ("pickle", dict(x=np.array([object()] * 20, dtype=object), y=y),
         r"array 'x' holds Python objects \(a pickle\), which is never loaded"),
        ("nan", dict(x=np.where(np.arange(20)[:, None] == 4, np.nan, x), y=y),
         r"x holds NaN or inf \(record 4\)"),
        ("features", dict(x=x[:, :5], y=y),
         rf"holds 5 features, the server's model takes {FEATURES} features$"),
        ("images", dict(x=x.reshape(20, 1, 2, 3), y=y),
         rf"holds images 1x2x3, the server's model takes {FEATURES} features$"),
        ("label", dict(x=x, y=np.full(20, CLASSES)),
         rf"label {CLASSES} is out of range for the server's model \(classes 0..2\)$"),
        ("declared", dict(x=x, y=y, num_classes=CLASSES + 1),
         rf"declares num_classes {CLASSES + 1}, the server's model has {CLASSES} classes$"),
        ("client", dict(x=x, y=y, client=np.zeros(20, dtype=np.int64)),
         r"a node's data file holds its own records only$"),
        ("no-y", dict(x=x), r"needs arrays 'x' and 'y' \(missing y\)$"),
        ("float-labels", dict(x=x, y=y.astype(np.float32)),
         r"y must hold one integer label per record"),
    ]


def test_bad_data_files_are_refused_in_one_line(tmp_path):
    """Each bad file: the node refuses discovery (and a round) with one line naming the file;
    nothing is unpickled; the server's discovery fails with that line."""
    cfg = tabular_cfg(tabular_folder(tmp_path / "d"), DEFAULT_TABULAR, split_seed=SECRET,
                      reproducible_noise=False)
    for name, arrays, reason in _bad_files(tmp_path):
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        got = refusal(node(tmp_path, **{"data-file": str(path)}), query(cfg, SHAPE))
        assert got is not None and "\n" not in got, name
        assert str(path) in got, got
        assert re.search(reason, got), (name, got)
    grid = FakeGrid(3, node_config={"data-file": str(tmp_path / "label.npz")})
    clients = FlowerClients(grid, node_wait=5.0, log=lambda line: None)  # type: ignore[arg-type]
    with pytest.raises(FlowerError, match=r"^client \d refused the run: data-file .*label.npz: "
                                          r"label 3 is out of range"):
        clients.discover(cfg, expected_partitions(cfg), SHAPE)


def test_a_node_file_of_any_numeric_dtype_with_one_class_is_taken(tmp_path):
    """Labels need not cover every class on one node; x of any numeric dtype is used as
    float32 (the content hash is that of the float32 records)."""
    x, _ = blobs(30, 5)
    path = tmp_path / "mine.npz"
    np.savez(path, x=(x * 10).astype(np.int16), y=np.zeros(30, dtype=np.uint8))
    cfg = tabular_cfg(tabular_folder(tmp_path / "d"), DEFAULT_TABULAR, split_seed=SECRET,
                      reproducible_noise=False)
    reply = client_app(query(cfg, SHAPE), node(tmp_path, **{"data-file": str(path)}))
    rec = reply.content.config_records["node"]
    assert rec["num-examples"] == 30 and rec["source"] == "data-file"


# ----------------------------------------------------------------------- server and node models
def _train_msg(cfg: TrainConfig, weights: dict, shape: ModelShape | None) -> Message:
    content = pack("extras", {})
    pack_into(content, "weights", weights)
    content["round"] = ConfigRecord({"round": 1, "rounds": cfg.rounds, "lr": 0.1})
    content["config"] = ConfigRecord(config_values(cfg))
    if shape is not None:
        content["model"] = shape.to_record()
    return Message(content, 1, "train")


def test_weights_of_another_model_are_refused_before_the_ledger(tmp_path):
    """The node builds its model from its own installation: weights of another model (another
    version of the factory on the server) or no model record are refused in one line, and
    the round never reaches the node's ledger."""
    from fedlap_privacy.model_factory import FactorySpec, build_model

    spec = factory(tmp_path / "code")
    cfg = tabular_cfg(tabular_folder(tmp_path / "d"), spec, split_seed=SECRET)
    ctx = node(tmp_path, **{"allowed-models": spec, "allow-reproducible-noise": True})
    wider = build_model(FactorySpec(spec.replace(":mlp", ":wider"), (FEATURES,), CLASSES))
    assert refusal(ctx, _train_msg(cfg, wider.state_dict(), SHAPE)) == (
        "the server's weights are not this node's model (parameter '0.weight' is (16, 6) from "
        "the server, (12, 6) here): check that every node has the same model factory installed")
    mlp = build_model(FactorySpec(spec, (FEATURES,), CLASSES))
    assert refusal(ctx, _train_msg(cfg, mlp.state_dict(), None)) == (
        "the instruction has no model record (input-shape, num-classes)")
    bad = _train_msg(cfg, mlp.state_dict(), SHAPE)
    bad.content["model"] = ConfigRecord({"input-shape": [FEATURES], "num-classes": True})
    assert refusal(ctx, bad).startswith("the instruction's model record is malformed")
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())
    assert refusal(ctx, _train_msg(cfg, mlp.state_dict(), SHAPE)) is None  # the same model


# ----------------------------------------------------------------------- a real local deployment
@pytest.mark.flower
@pytest.mark.slow  # 20 s; CI keeps test_flower.py's two-round deployment equal to in-process
def test_train_engine_flower_on_tabular_data_with_a_custom_model(tmp_path, monkeypatch):
    """``train --engine flower --data FOLDER --model FILE.py:FUNC``: three sites of tabular
    records, a custom model the node policy lists; SuperLink + 3 SuperNodes on 127.0.0.1 give
    the in-process engine's model and ledger bit for bit (--reproducible-noise, one torch
    thread everywhere)."""
    from typer.testing import CliRunner

    from fedlap_privacy.cli.main import app

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spec = factory(tmp_path / "code")
    data = tabular_folder(tmp_path / "d")
    policy = write_policy(tmp_path / "policy.toml", allow_reproducible_noise=True,
                          allowed_models=[spec])
    sets = [f"--set={k}={v}" for k, v in helpers.TINY.items() if k != "rounds"]
    common = ["--data", str(data), "--model", spec, "--method", "dp-fedavg", "--sigma", "2.0",
              "--rounds", "2", "--device", "cpu", "--reproducible-noise", "--seed", "3",
              "--json", *sets]
    result = CliRunner().invoke(app, ["train", "--engine", "flower", "--node-policy",
                                      str(policy), "--out", str(tmp_path / "flower"), *common])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["rounds_run"] == 2 and summary["dataset"] == "custom"
    a = load_checkpoint(tmp_path / "flower" / CHECKPOINT)
    assert a["model_factory"]["factory"] == spec
    # the in-process engine on the same split seed (the Flower run's secret one)
    from fedlap_privacy.state.run_state import PrivateRunState

    secret = PrivateRunState.load(tmp_path / "flower" / PRIVATE).split_seed
    cfg = with_data(helpers.tiny(method="dp-fedavg", sigma=2.0, rounds=2, seed=3,
                                 reproducible_noise=True, model=spec), data)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = train(cfg, tmp_path / "local", "cpu", split_seed=secret)
    finally:
        torch.set_num_threads(threads)
    b = load_checkpoint(tmp_path / "local" / CHECKPOINT)
    assert a["ledger"] == b["ledger"] and len(a["ledger"]) == 2
    assert all(torch.equal(a["model_state"][k], b["model_state"][k]) for k in b["model_state"])
    assert summary["epsilon"] == local.summary.privacy.epsilon > 0
