"""The Flower driver (fl/flower/): same training as the simulator, failures counted.

Fast tests drive the real ServerApp logic (:class:`FlowerClients`) and the real ClientApp
through an in-process stand-in for Flower's Grid; the tests marked ``flower`` start a real
SuperLink and SuperNodes on 127.0.0.1 (shared by the module) and kill one of them.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch

flwr = pytest.importorskip("flwr")

import helpers  # noqa: E402
from flower_grid import FakeGrid, task_identity, write_policy  # noqa: E402, F401
from helpers import METHOD_EXTRAS  # noqa: E402

from fedlap_privacy.fl.config import TrainConfig  # noqa: E402
from fedlap_privacy.fl.engine.flower_app import (  # noqa: E402
    STATUS,
    ClientFailure,
    FlowerClients,
    FlowerError,
    LocalDeployment,
    config_from_run_config,
    decode_state,
    encode_state,
    expected_partitions,
    run_config_of,
    run_on,
    write_app,
)
from fedlap_privacy.fl.engine.simulation import CHECKPOINT, PENDING, train  # noqa: E402
from fedlap_privacy.fl.flower.node_ledger import NODE_STATE  # noqa: E402
from fedlap_privacy.fl.methods.method_table import METHOD_TABLE  # noqa: E402
from fedlap_privacy.fl.run.run_records import RoundRecord  # noqa: E402
from fedlap_privacy.state.checkpoint import PRIVATE, PRIVATE_FORMAT, load_checkpoint  # noqa: E402

#: the shared tiny configuration runs here on two clients, with seeded noise: the driver's
#: equality with the simulator is bit for bit
FLOWER = dict(clients=2, reproducible_noise=True)
tiny = partial(helpers.tiny, **FLOWER)


def _driver(grid: FakeGrid, cfg: TrainConfig, **kw) -> FlowerClients:
    clients = FlowerClients(grid, node_wait=5.0, log=lambda line: None, **kw)  # type: ignore[arg-type]
    clients.discover(cfg, expected_partitions(cfg))
    return clients


def _same_model(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


def _moved(cfg: TrainConfig, state: dict) -> float:
    """||w - w_0|| from the initial weights of a run with ``cfg`` (seeded as TrainingRun does)."""
    from fedlap_privacy.data.datasets import load_dataset
    from fedlap_privacy.fl.engine.simulation import default_model_config
    from fedlap_privacy.models import build_model

    torch.manual_seed(cfg.seed)
    init = build_model(default_model_config(cfg, load_dataset(cfg.dataset))).state_dict()
    return float(sum((state[k] - init[k]).pow(2).sum() for k in init) ** 0.5)


def _strip(history: list[RoundRecord]) -> list[dict]:
    """The rounds' metrics as written, without their timings."""
    return [{k: v for k, v in h.to_json().items() if k != "seconds"} for h in history]


# --------------------------------------------------------------------------- codec, config
def test_state_codec_keeps_tensors_bits_and_plain_values():
    state = {"synthetic": {"images": torch.randn(3, 1, 8, 8), "labels": torch.arange(3)},
             "tau": 7, "mu": [torch.ones(2, dtype=torch.float64), 0.1 + 0.2], "none": None}
    back = decode_state(*encode_state(state))
    assert torch.equal(back["synthetic"]["images"], state["synthetic"]["images"])
    assert back["synthetic"]["labels"].dtype == torch.int64
    assert back["mu"][0].dtype == torch.float64 and back["mu"][1] == 0.1 + 0.2
    assert back["tau"] == 7 and back["none"] is None
    with pytest.raises(TypeError, match="cannot send"):
        encode_state({"x": object()})


def test_state_codec_is_exact_for_every_dtype_and_shape():
    """One byte array per state: every tensor comes back with its dtype, shape and bits
    (NaN payloads, -0.0, empty and zero-dimensional tensors included)."""
    odd = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45], dtype=torch.float32)
    state = {"odd": odd, "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5),
             "tensors": [torch.randn(2, 3).to(dtype) for dtype in (
                 torch.float16, torch.bfloat16, torch.float64)]
             + [torch.tensor([1, -2, 3], dtype=dtype) for dtype in (
                 torch.int8, torch.int16, torch.int32, torch.int64)]
             + [torch.tensor([True, False]), torch.arange(4, dtype=torch.uint8)]}
    arrays, tree = encode_state(state)
    assert list(arrays) == ["blob"]  # one array on Flower's wire, whatever the state holds
    back = decode_state(arrays, tree)
    assert torch.equal(back["odd"].view(torch.int32), odd.view(torch.int32))  # the bits
    assert back["empty"].shape == (0, 3) and back["scalar"].shape == ()
    for a, b in zip(back["tensors"], state["tensors"], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("entry, why", [
    ([4000, "float32", [2]], "outside"),  # bytes the record does not hold
    ([-4, "float32", [2]], "outside"),
    ([0, "float32", [10**12, 10**12]], "outside"),  # a forged shape: no allocation
    ([0, "object", [1]], "bad tensor entry"),  # only numeric dtypes
    ([0, "float32", [-1]], "bad tensor entry"),
    ([True, "float32", [1]], "bad tensor entry"),
    ([0, "float32", "2"], "bad tensor entry"),
])
def test_a_forged_state_is_refused_in_one_line(entry, why):
    """A malicious server's instruction or a malicious node's reply names bytes, dtypes or
    shapes of its choosing: each is checked against the one array before anything is read."""
    from flwr.app import Array, ArrayRecord

    from fedlap_privacy.fl.flower.codec import CodecError

    arrays, _ = encode_state({"w": torch.ones(2)})
    with pytest.raises(CodecError, match=why):
        decode_state(arrays, json.dumps({"__dict__": {"w": {"__tensor__": entry}}}))
    two = ArrayRecord({"blob": arrays["blob"], "more": Array(torch.ones(1).numpy())})
    with pytest.raises(CodecError, match="expected one array"):
        decode_state(two, json.dumps(None))


def test_run_config_round_trip_and_app_is_a_valid_flower_app(tmp_path):
    from flwr.common.config import validate_config
    from flwr.common.constant import FAB_CONFIG_FILE

    cfg = tiny(sigma=None, target_eps=3.0, method="dp-fedavg")
    values = run_config_of(cfg, out="/x", allow_client_failures=True)
    assert values["sigma"] == "" and values["target-eps"] == 3.0 and values["batch-size"] == 32
    back, driver = config_from_run_config(values)
    assert back == cfg and driver["allow-client-failures"] is True and driver["out"] == "/x"
    back, _ = config_from_run_config({**values, "sigma": 2})  # a TOML int for a float key
    assert back.sigma == 2.0 and isinstance(back.sigma, float)
    with pytest.raises(Exception, match="unknown run-config key"):
        config_from_run_config({"sigmaa": 1.0})
    for key, bad in (("sigma", "1.0"), ("clients", True), ("clients", 2.5), ("dsa", 1)):
        with pytest.raises(Exception, match=f"configuration key {key} must be"):
            config_from_run_config({**values, key: bad})

    import tomllib

    app = write_app(tmp_path / "app", cfg)
    pyproject = tomllib.loads((app / FAB_CONFIG_FILE).read_text())
    ok, errors, _ = validate_config(pyproject, check_module=True, project_dir=app)
    assert ok, errors
    assert config_from_run_config(pyproject["tool"]["flwr"]["app"]["config"])[0] == cfg


# --------------------------------------------------------------------------- driver, in-process
#: what some methods need beyond tiny() (their own budgets, the non-private radius rule)
@pytest.mark.parametrize("method", sorted(METHOD_TABLE))
def test_flower_driver_equals_simulator(tmp_path, method):
    """Every method, same seed: the ServerApp's driver + the ClientApp give the simulator's
    model, ledger and metrics bit for bit (one implementation, two drivers)."""
    extra = METHOD_EXTRAS.get(method, {})
    cfg = tiny(method=method, **extra)
    grid = FakeGrid(2, partitions=[1, 0])  # node ids do not follow partitions
    flower = train(cfg, tmp_path / "flower", "cpu", ask_clients=_driver(grid, cfg))
    # the loop: the nodes' clients one by one (a packed cohort equals it up to rounding)
    local = train(tiny(method=method, **extra, cohort_training="loop"), tmp_path / "local",
                  "cpu")
    a = load_checkpoint(tmp_path / "flower" / CHECKPOINT)
    b = load_checkpoint(tmp_path / "local" / CHECKPOINT)
    assert a["ledger"] == b["ledger"] and len(a["ledger"]) == 2
    assert _same_model(a["model_state"], b["model_state"])
    assert _strip(flower.history) == _strip(local.history)
    assert [h.replies for h in flower.history] == [2, 2]
    train_msgs = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(train_msgs) == 4  # 2 rounds x 2 clients
    if method.startswith("fedlap") or method == "scaffold":  # node-local state: on the node
        for ctx in grid.contexts.values():
            assert "state-tree" in ctx.state.config_records
        private = load_checkpoint(tmp_path / "flower" / PRIVATE, PRIVATE_FORMAT)
        assert private["client_state"] == [{}, {}]  # ... and never reached the server


def test_a_secret_split_reaches_the_simulated_nodes_only(tmp_path):
    """A split that draws (iid, a hold-out) from the run's secret split seed: the server
    sends it in its instructions, so simulated-split nodes recompute exactly the server's
    partitions; the releasable checkpoint neither holds it nor declares a split public."""
    from fedlap_privacy.fl.flower.grid_clients import instruction_config
    from fedlap_privacy.fl.run.randomness import run_split_seed
    from fedlap_privacy.state.run_state import ModelRelease, PrivateRunState

    cfg = tiny(method="dp-fedavg", rounds=1, split="iid", validation_records=30)
    secret = run_split_seed(cfg)
    sent = instruction_config(cfg, secret)
    clients = FlowerClients(FakeGrid(2), node_wait=5.0, log=lambda line: None)  # type: ignore[arg-type]
    clients.discover(sent, expected_partitions(sent))
    train(cfg, tmp_path / "run", "cpu", ask_clients=clients, split_seed=secret)
    private = PrivateRunState.load(tmp_path / "run" / PRIVATE)
    assert private.split_seed == secret and private.round == 1
    assert [len(p) for p in private.client_indices] == [e.size for e in expected_partitions(sent)]
    release = ModelRelease.load(tmp_path / "run" / CHECKPOINT)
    assert release.config["split_seed"] is None
    assert not any("split_seed" in item for item in release.privacy["public"])


@pytest.mark.parametrize("how", ["silent", "unavailable"])
def test_client_that_does_not_answer_fails_round_and_round_is_counted(tmp_path, how):
    cfg = tiny(rounds=3)
    grid = FakeGrid(2)
    getattr(grid, how)[101] = 2  # partition 1 dies in round 2
    with pytest.raises(ClientFailure) as err:
        train(cfg, tmp_path, "cpu", ask_clients=_driver(grid, cfg, round_timeout=1.0))
    message = str(err.value)
    assert message.startswith("round 2 failed: client 1") and "\n" not in message
    assert "interrupted" in message and "--allow-client-failures" in message
    ckpt = load_checkpoint(tmp_path / CHECKPOINT)
    assert not (tmp_path / PENDING).exists()
    assert [(e["round"], e["status"]) for e in ckpt["ledger"]] == [
        (1, "completed"), (2, "interrupted")]
    interrupted = ckpt["ledger"][1]
    assert interrupted["local_steps"] == cfg.accesses_per_round == interrupted["accesses"]
    assert interrupted["participants"] == [0, 1] and ckpt["round"] == 1
    # privacy spent is that of two full rounds: the simulator's after 2 rounds
    local = train(tiny(rounds=2), None, "cpu")
    assert ckpt["privacy"]["epsilon"] == pytest.approx(local.summary.privacy.epsilon, rel=1e-12)


def test_allow_client_failures_continues_and_counts_every_round(tmp_path):
    cfg = tiny(rounds=3)
    grid = FakeGrid(2)
    grid.silent[101] = 2
    result = train(cfg, tmp_path, "cpu",
                   ask_clients=_driver(grid, cfg, round_timeout=1.0, allow_failures=True))
    ledger = load_checkpoint(tmp_path / CHECKPOINT)["ledger"]
    assert [e["status"] for e in ledger] == ["completed"] * 3
    assert [e["participants"] for e in ledger] == [[0, 1]] * 3
    assert [h.replies for h in result.history] == [2, 1, 1]
    local = train(tiny(rounds=3), None, "cpu")
    assert result.summary.privacy.epsilon == pytest.approx(local.summary.privacy.epsilon, rel=1e-12)
    assert not _same_model(result.model.state_dict(), local.model.state_dict())


def test_allow_client_failures_still_fails_a_round_nobody_answers(tmp_path):
    cfg = tiny()
    grid = FakeGrid(2)
    grid.silent.update({100: 1, 101: 1})
    with pytest.raises(ClientFailure, match="round 1 failed"):
        train(cfg, tmp_path, "cpu",
              ask_clients=_driver(grid, cfg, round_timeout=0.5, allow_failures=True))
    assert [e["status"] for e in load_checkpoint(tmp_path / CHECKPOINT)["ledger"]] == [
        "interrupted"]


def test_discovery_refuses_missing_duplicate_and_mismatched_partitions():
    cfg = tiny()
    with pytest.raises(FlowerError, match=r"partition\(s\) 1 within .*partition-id=K"):
        FlowerClients(FakeGrid(2, [0]), node_wait=1.0, log=print).discover(
            cfg, expected_partitions(cfg))
    with pytest.raises(FlowerError, match="two SuperNodes hold partition 0"):
        FlowerClients(FakeGrid(2, [0, 0, 1]), node_wait=2.0, log=print).discover(
            cfg, expected_partitions(cfg))
    wrong = [dataclasses.replace(e, size=e.size + 1) for e in expected_partitions(cfg)]
    with pytest.raises(FlowerError, match=r"holds \d+ records, the run's split gives"):
        FlowerClients(FakeGrid(2), node_wait=2.0, log=print).discover(cfg, wrong)
    other = [dataclasses.replace(e, content_hash="0" * 64) for e in expected_partitions(cfg)]
    with pytest.raises(FlowerError, match="other records than the run's split"):
        FlowerClients(FakeGrid(2), node_wait=2.0, log=print).discover(cfg, other)


# --------------------------------------------------------------------------- optional extra
def test_core_commands_work_without_flwr_and_flower_engine_says_how_to_install(tmp_path):
    code = (
        "import sys; sys.modules['flwr'] = None\n"
        "from typer.testing import CliRunner\n"
        "from fedlap_privacy.cli.main import app\n"
        "import fedlap_privacy.fl.engine.simulation\n"
        "r = CliRunner().invoke(app, ['train', '--engine', 'flower', '--out', sys.argv[1]])\n"
        "print(r.exit_code, repr(r.output))\n"
        "r = CliRunner().invoke(app, ['plan', '--help'])\n"
        "print(r.exit_code)\n"
        "assert 'flwr' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()[-2:]
    assert first.startswith("2 ") and "pip install '.[flower]' in a clone" in first
    assert second == "0"
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- real deployment
@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """A SuperLink and two SuperNodes (partitions 0, 1) on 127.0.0.1 for this module."""
    work = tmp_path_factory.mktemp("flower")
    policy = write_policy(work / "policy.toml", allow_reproducible_noise=True)
    with LocalDeployment(2, work, device="cpu", policy_file=policy) as dep:
        yield dep
    time.sleep(0.5)
    for proc in [dep.superlink, *dep.supernodes]:
        assert proc is not None and proc.poll() is not None  # all torn down


def _revive(dep: LocalDeployment) -> None:
    for k, proc in enumerate(dep.supernodes):
        if proc.poll() is not None:
            dep.start_node(k)


@pytest.mark.flower
def test_train_engine_flower_two_rounds_equal_simulator(tmp_path, monkeypatch):
    """``train --engine flower --clients 2``: SuperLink + 2 SuperNodes on 127.0.0.1, two
    FedLAP-DP rounds on digits; model and ledger are the in-process simulator's with the
    same seed, bit for bit (the same CPU arithmetic: one torch thread everywhere, as a
    different thread count reorders float sums), and everything is torn down."""
    from typer.testing import CliRunner

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the nodes, the server app and this process

    from fedlap_privacy.cli.main import app

    sets = [f"--set={k}={v}" for k, v in {**helpers.TINY, **FLOWER}.items()
            if k not in ("rounds", "clients")]
    policy = write_policy(tmp_path / "policy.toml", allow_reproducible_noise=True)
    args = ["train", "--engine", "flower", "--clients", "2", "--rounds", "2", "--device", "cpu",
            "--out", str(tmp_path / "flower"), "--json", "--node-policy", str(policy), *sets]
    work = tmp_path / "tmp"  # the deployment's temporary working folder goes here
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    seen: set[int] = set()  # the deployment's processes, looked at while it runs
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            seen.update(_flower_processes(work))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = CliRunner().invoke(app, args)
    finally:
        done.set()
        watcher.join()
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    local = train(tiny(), tmp_path / "local", "cpu")
    a = load_checkpoint(tmp_path / "flower" / CHECKPOINT)
    b = load_checkpoint(tmp_path / "local" / CHECKPOINT)
    assert a["ledger"] == b["ledger"] and len(a["ledger"]) == 2
    assert _same_model(a["model_state"], b["model_state"])
    assert set(a) == set(b) and a["format"] == b["format"]  # audit reads it like train's
    pa, pb = (load_checkpoint(tmp_path / d / PRIVATE, PRIVATE_FORMAT) for d in ("flower", "local"))
    assert pa["client_indices"][1].tolist() == pb["client_indices"][1].tolist()
    assert summary["epsilon"] == local.summary.privacy.epsilon > 0
    assert summary["rounds_run"] == 2 and summary["stopped"] == "completed"
    assert _strip([RoundRecord.from_json(h) for h in a["history"]]) == _strip(local.history)
    # the equality is not that of an untrained model: the weights moved from their init
    assert _moved(tiny(), a["model_state"]) > 0.1
    # SuperLink, 2 SuperNodes, their SuperExecs, flwr run, the app processes: all gone
    assert len(seen) >= 6 and _flower_processes(work) == set()
    for k in range(2):  # each node's ledger is kept in the run folder, for --resume
        (path,) = (tmp_path / "flower" / NODE_STATE / f"node-{k}").glob("run-*.json")
        assert [e["round"] for e in json.loads(path.read_text())["entries"]] == [1, 2]


def _flower_processes(under: Path) -> set[int]:
    """Pids of the processes of a deployment whose working folder is in ``under``: Flower's
    processes inherit the deployment's ``FLWR_HOME`` (its working folder's ``home``), so
    those of another test running beside this one (pytest -n) are not counted."""
    marker = b"\0FLWR_HOME=" + str(under).encode()
    pids = set()
    for entry in Path("/proc").glob("[0-9]*/environ"):
        try:
            environ = b"\0" + entry.read_bytes()
        except OSError:
            continue
        if marker in environ:
            pids.add(int(entry.parent.name))
    return pids


def _kill_in_round(m: int, out: Path, node: int = 1):
    """on_poll hook: SIGKILL SuperNode ``node`` once round ``m`` has started (its
    ``round.pending`` marker is written before the round's messages go out)."""
    done = []

    def hook(dep: LocalDeployment) -> None:
        if done or not (out / PENDING).exists():
            return
        if json.loads((out / PENDING).read_text())["round"] == m:
            dep.kill_node(node)
            done.append(time.monotonic())

    return hook, done


@pytest.mark.flower
# the default (a failed run with the round in the ledger) in CI; the allowed failure as slow
@pytest.mark.parametrize("allow", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_killed_supernode(deployment, tmp_path, allow):
    """SIGKILL SuperNode 1 once round 1 has started. Default: the run fails with one clear
    line and the round is in the ledger (interrupted, full T, both clients). With the
    option: the run completes with client 0 and the ledger counts the round for both."""
    _revive(deployment)
    out = tmp_path / "run"
    hook, killed = _kill_in_round(1, out)
    cfg = tiny(rounds=1)
    # the live node answers within the timeout: Flower starts a ClientApp process for every
    # message (imports included: 10 to 20 s on a loaded machine)
    kwargs = dict(round_timeout=40.0, allow_client_failures=allow, on_poll=hook)
    if allow:
        result = run_on(deployment, cfg, out, "cpu", **kwargs)
        assert [h.replies for h in result.history] == [1]
        assert result.summary.stopped == "completed"
    else:
        with pytest.raises(FlowerError) as err:
            run_on(deployment, cfg, out, "cpu", **kwargs)
        message = str(err.value)
        assert message.startswith("round 1 failed: client 1") and "\n" not in message
        assert "--allow-client-failures" in message
    assert killed
    ckpt = load_checkpoint(out / CHECKPOINT)
    assert not (out / PENDING).exists()
    entries = [(e["round"], e["status"], len(e["participants"]), e["local_steps"])
               for e in ckpt["ledger"]]
    status = "completed" if allow else "interrupted"
    assert entries == [(1, status, 2, cfg.accesses_per_round)]
    local = train(tiny(rounds=1), None, "cpu")
    assert ckpt["privacy"]["epsilon"] == pytest.approx(local.summary.privacy.epsilon, rel=1e-12)
    assert json.loads((out / STATUS).read_text())["status"] == ("completed" if allow else "failed")


def test_local_nodes_threads(tmp_path, monkeypatch):
    """``train --engine flower --threads N`` gives every SuperNode N torch threads; without
    it, each node takes its share of the CPUs (FEDLAP_WORKERS = number of nodes)."""
    from fedlap_privacy.compute.threads import threads_for
    from fedlap_privacy.fl.flower.deployment import LocalDeployment

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    shared = LocalDeployment(4, tmp_path / "a").env
    assert shared["FEDLAP_WORKERS"] == "4" and "OMP_NUM_THREADS" not in shared
    pinned = LocalDeployment(4, tmp_path / "b", threads=3).env
    assert threads_for(env=pinned) == 3
    assert threads_for(env=shared) == threads_for(4, env={})


def test_each_node_prices_its_answers_with_pld_as_the_in_process_engine(tmp_path):
    """The node's own ledger (never the server's figure) uses PLD by default, at its own
    N_k: the node with the smallest client spends exactly the in-process run's epsilon (the
    ledger's worst client, against the server), the other node less."""
    cfg = tiny(method="dp-fedavg")
    grid = FakeGrid(2)
    result = train(cfg, tmp_path / "flower", "cpu", ask_clients=_driver(grid, cfg))
    privacy = result.summary.privacy
    assert privacy.accountant == "pld" and privacy.threat_model == "server"
    nodes = [json.loads((grid.state_root / f"node-{i}" / "run-1.json").read_text())
             for i in range(2)]
    assert {e["accountant"] for n in nodes for e in n["entries"]} == {"pld"}
    spent = {n["size"]: n["entries"][-1]["epsilon"] for n in nodes}
    assert len(spent) == 2  # the two partitions differ in size
    assert spent[min(spent)] == pytest.approx(privacy.epsilon, rel=1e-9)
    assert spent[max(spent)] < privacy.epsilon
    assert privacy.epsilon < privacy.epsilon_by_accountant["rdp"]
