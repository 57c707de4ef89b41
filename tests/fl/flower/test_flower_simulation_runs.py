"""``--engine flower-simulation`` across runs: a stopped run resumed, and ``--ray-address``.

* A run stopped between rounds (SIGTERM, as a job scheduler stops it) and resumed with
  ``--resume`` on the Simulation Engine gives the uninterrupted in-process run bit for bit:
  its ledger holds each round once (none free, none counted twice), its weights are the same.
* A ``--ray-address`` where no Ray answers is one line and exit 2 within seconds, before the
  run folder is made (Ray itself retries such an address for minutes); one that is not an
  address is refused as such.
* ``--ray-address auto`` joins a Ray cluster started beside the run (``ray start --head`` in
  a folder of its own, stopped after by its process group: never ``ray stop``, which stops
  every Ray on the machine) and leaves it running.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

flwr = pytest.importorskip("flwr")
ray = pytest.importorskip("ray")

import helpers  # noqa: E402
from flower_grid import task_identity, write_policy  # noqa: E402, F401
from typer.testing import CliRunner  # noqa: E402

from fedlap_privacy.cli.main import app  # noqa: E402
from fedlap_privacy.fl.config import TrainConfig  # noqa: E402
from fedlap_privacy.fl.engine.events import RoundEnded  # noqa: E402
from fedlap_privacy.fl.engine.simulation import CHECKPOINT, train  # noqa: E402
from fedlap_privacy.fl.engine.stop import (  # noqa: E402
    STOPPED,
    stop_between_rounds,
    stop_requested,
)
from fedlap_privacy.fl.flower.grid_clients import FlowerError  # noqa: E402
from fedlap_privacy.fl.flower.simulation_engine import (  # noqa: E402
    SimulationResources,
    check_ray_address,
    ray_init_args,
    resolve_ray_address,
    run_simulation_engine,
)
from fedlap_privacy.state.checkpoint import load_checkpoint  # noqa: E402


@pytest.fixture
def one_thread():
    """One torch thread here and in the actors: a thread count reorders float sums."""
    saved, threads = os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if saved is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = saved


def _sigterm_after_round(round_: int):
    """SIGTERM to this process at the end of ``round_``. The ServerApp runs in a thread of
    its own under the Simulation Engine and Python runs the handler in the main thread: the
    callback waits for it, as a signal from outside would arrive during the round."""

    def callback(event):
        if isinstance(event, RoundEnded) and event.round == round_:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not stop_requested() and time.monotonic() < deadline:
                time.sleep(0.05)

    return callback


def _skip_if_ray_did_not_start(exc: FlowerError) -> None:
    if "Ray on this machine did not start" in str(exc):
        pytest.skip(str(exc))  # Ray's 30 s start-up limit on a loaded machine


@pytest.mark.slow
def test_a_stopped_run_resumed_on_the_engine_equals_the_uninterrupted_run(tmp_path,
                                                                         one_thread):
    cfg = helpers.tiny(method="dp-fedavg", clients=3, rounds=2, reproducible_noise=True)
    allow = write_policy(tmp_path / "allow.toml", allow_reproducible_noise=True)
    full = train(helpers.tiny(method="dp-fedavg", clients=3, rounds=2,
                              reproducible_noise=True), tmp_path / "full", "cpu")
    out = tmp_path / "cut"
    try:
        with stop_between_rounds():
            cut = run_simulation_engine(cfg, out, "cpu", _sigterm_after_round(1),
                                        node_policy=allow)
        assert cut.summary.stopped == STOPPED and cut.summary.rounds_run == 1
        assert [e["round"] for e in load_checkpoint(out / CHECKPOINT)["ledger"]] == [1]
        resumed = run_simulation_engine(None, out, "cpu", resume_run=True, node_policy=allow)
    except FlowerError as exc:
        _skip_if_ray_did_not_start(exc)
        raise
    assert resumed.summary.stopped == "completed" and resumed.summary.rounds_run == 2
    a, b = load_checkpoint(out / CHECKPOINT), load_checkpoint(tmp_path / "full" / CHECKPOINT)
    assert [e["round"] for e in a["ledger"]] == [1, 2]  # each round once
    assert a["ledger"] == b["ledger"]
    assert all(torch.equal(a["model_state"][k], b["model_state"][k]) for k in b["model_state"])
    assert resumed.summary.privacy.epsilon == full.summary.privacy.epsilon > 0


def test_a_ray_address_where_nothing_answers_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as free:  # a port where nothing listens
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    start = time.monotonic()
    out = CliRunner().invoke(app, [
        "train", "--engine", "flower-simulation", "--clients", "3", "--rounds", "1",
        "--ray-address", f"127.0.0.1:{port}", "--out", str(tmp_path / "run")])
    assert out.exit_code == 2, out.output
    assert f"the Ray cluster at 127.0.0.1:{port} did not answer" in out.output
    assert "Traceback" not in out.output and not ray.is_initialized()
    assert time.monotonic() - start < 60 and not (tmp_path / "run").exists()
    for bad in ("nonsense", "10.0.0.5", "10.0.0.5:port", "ray://host:99999"):
        with pytest.raises(Exception, match="expected auto, HOST:PORT or ray://HOST:PORT"):
            check_ray_address(bad)


def _listener() -> socket.socket:
    """A loopback TCP listener that accepts and says nothing (not Ray)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    return server


def _connections(server: socket.socket) -> int:
    """How many connections reached ``server`` (each accepted and closed)."""
    count = 0
    while True:
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def test_a_ray_cluster_named_by_a_file_or_the_environment_is_never_joined(tmp_path,
                                                                          monkeypatch):
    """Another local user writes ``<tmp>/ray/ray_current_cluster`` (Ray makes that folder
    world-writable) or the environment names a cluster: without ``--ray-address`` the run
    asks Ray for a new instance in a private folder, so Ray reads neither; only an address
    the user typed is joined."""
    from ray._private import services

    server = _listener()
    planted = f"127.0.0.1:{server.getsockname()[1]}"
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(planted)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    port = server.getsockname()[1]  # the plant works (Ray names this machine by its IP)
    assert services.canonicalize_bootstrap_address(None, None).endswith(f":{port}")
    monkeypatch.setenv("RAY_ADDRESS", planted)
    args = ray_init_args(SimulationResources(), str(tmp_path / "private"))
    assert args["address"] == "local" and args["_temp_dir"] == str(tmp_path / "private")
    assert services.canonicalize_bootstrap_address(args["address"], args["_temp_dir"]) is None
    named = ray_init_args(SimulationResources(address=planted), None)
    assert named["address"] == planted and "_temp_dir" not in named
    assert _connections(server) == 0
    server.close()


def test_ray_address_auto_takes_only_a_session_file_this_user_wrote(tmp_path, monkeypatch):
    """``--ray-address auto`` is resolved here, not by Ray (which would also take another
    user's session file in the world-writable ``/tmp/ray``, or another user's GCS process):
    ``RAY_ADDRESS`` first, else ``ray_current_cluster`` only where this user owns it and
    nobody else can write it; a link, a shared-writable or missing file is one line."""
    from fedlap_privacy.errors import ConfigError

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert resolve_ray_address("auto") == "10.0.0.5:6379"
    assert resolve_ray_address("10.0.0.7:6379") == "10.0.0.7:6379"
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(ConfigError, match="no Ray cluster started here"):
        resolve_ray_address("auto")
    (tmp_path / "ray").mkdir()
    session = tmp_path / "ray" / "ray_current_cluster"
    session.write_text("127.0.0.1:6380\n")
    session.chmod(0o644)
    assert resolve_ray_address("auto") == "127.0.0.1:6380"
    session.chmod(0o666)
    with pytest.raises(ConfigError, match="written by another user"):
        resolve_ray_address("auto")
    session.chmod(0o644)
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(session, 4242, 4242)
        with pytest.raises(ConfigError, match="written by another user"):
            resolve_ray_address("auto")
    session.unlink()
    planted = tmp_path / "planted"
    planted.write_text("127.0.0.1:6381")
    session.symlink_to(planted)
    with pytest.raises(ConfigError, match="no Ray cluster started here"):
        resolve_ray_address("auto")


def test_a_listener_that_is_not_ray_is_refused_in_one_line_within_seconds(tmp_path):
    """A TCP service that accepts and never answers (Ray would retry it for minutes): the
    run is refused in one line, exit 2, within the probe's time, no run folder, no Ray."""
    server = _listener()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    start = time.monotonic()
    with pytest.raises(FlowerError, match=f"the service at {address} is not a Ray cluster"):
        check_ray_address(address, timeout=1)
    assert time.monotonic() - start < 5 and _connections(server) == 1
    out = CliRunner().invoke(app, [
        "train", "--engine", "flower-simulation", "--clients", "3", "--rounds", "1",
        "--ray-address", address, "--out", str(tmp_path / "run")])
    assert out.exit_code == 2, out.output
    assert "is not a Ray cluster" in out.output and "Traceback" not in out.output
    assert time.monotonic() - start < 30 and not ray.is_initialized()
    assert not (tmp_path / "run").exists()
    server.close()


@pytest.mark.parametrize("flags, message", [
    (["--client-gpus", "nan"], "--client-gpus nan: expected a finite number"),
    (["--client-cpus", "nan"], "--client-cpus nan: expected a finite number"),
    (["--client-cpus", "inf"], "--client-cpus inf: expected a finite number"),
    (["--client-cpus", "1e-9"], "--client-cpus 1e-09: each virtual SuperNode needs at least"),
    (["--client-cpus", "-1"], "--client-cpus -1: each virtual SuperNode needs at least"),
    (["--client-gpus", "-0.5"], "--client-gpus -0.5: expected 0"),
    (["--client-gpus", "1e-6"], "--client-gpus 1e-06: expected 0"),
    (["--client-gpus", "-inf"], "--client-gpus -inf: expected a finite number"),
])
def test_resource_values_are_refused_before_flower_sees_them(tmp_path, flags, message):
    out = CliRunner().invoke(app, [
        "train", "--engine", "flower-simulation", "--clients", "3", "--rounds", "1",
        "--out", str(tmp_path / "run"), *flags])
    assert out.exit_code == 2, out.output
    assert message in out.output and "Traceback" not in out.output
    assert len(out.output.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists() and not ray.is_initialized()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_ray_address_auto_joins_a_running_cluster(tmp_path, one_thread, monkeypatch):
    """A head node started here (2 CPUs), found through ``RAY_ADDRESS`` as ``auto`` finds
    the cluster a user started; the run trains on it and leaves it running."""
    exe = Path(sys.executable).with_name("ray")
    if not exe.exists():
        pytest.skip("the ray command is not installed beside this Python")
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # Ray's socket paths must stay short
    head = subprocess.Popen(
        [str(exe), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 60
        while True:  # the head's GCS answers on its port
            try:
                check_ray_address(f"127.0.0.1:{port}", timeout=1)
                break
            except FlowerError:
                if head.poll() is not None or time.monotonic() > deadline:
                    pytest.skip("ray start --head did not come up within 60 s")
                time.sleep(1)
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        allow = write_policy(tmp_path / "allow.toml", allow_reproducible_noise=True)
        out = CliRunner().invoke(app, [
            "train", "--engine", "flower-simulation", "--clients", "3", "--rounds", "1",
            "--method", "dp-fedavg", "--device", "cpu", "--json", "--ray-address", "auto",
            "--node-policy", str(allow), "--out", str(tmp_path / "run"),
            *[f"--set={k}={v}" for k, v in helpers.TINY.items()
              if k not in ("rounds", "clients")], "--reproducible-noise"])
        assert out.exit_code == 0, out.output
        assert json.loads(out.output.strip().splitlines()[-1])["rounds_run"] == 1
        assert not ray.is_initialized() and head.poll() is None  # the cluster still runs
        local = train(helpers.tiny(method="dp-fedavg", clients=3, rounds=1,
                                   reproducible_noise=True), tmp_path / "local", "cpu")
        a = load_checkpoint(tmp_path / "run" / CHECKPOINT)
        assert a["ledger"] == load_checkpoint(tmp_path / "local" / CHECKPOINT)["ledger"]
        assert all(torch.equal(a["model_state"][k], v)
                   for k, v in local.model.state_dict().items())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_a_resumed_simulation_keeps_each_virtual_nodes_budget(tmp_path, one_thread):
    """Issue's replay: two launches of the same run with ``--ray-address local``, a node
    budget that fits one round but not two. The virtual nodes' ledgers stay in the run
    folder between launches, so the resumed launch's nodes still count round 1 and refuse
    round 2 (with the ledgers in a temporary folder of each launch, they admitted it)."""
    from fedlap_privacy.fl.flower.node_ledger import NODE_STATE

    out = tmp_path / "run"
    local = SimulationResources(address="local")
    allow = write_policy(tmp_path / "allow.toml", allow_reproducible_noise=True)
    try:
        first = run_simulation_engine(helpers.tiny(method="dp-fedavg", clients=3, rounds=1,
                                                   reproducible_noise=True), out, "cpu",
                                      resources=local, node_policy=allow)
        one_round = first.summary.privacy.epsilon
        assert first.summary.rounds_run == 1 and one_round > 0
        strict = write_policy(tmp_path / "strict.toml", allow_reproducible_noise=True,
                              epsilon=1.1 * one_round)
        with pytest.raises(FlowerError, match="refused"):
            run_simulation_engine(None, out, "cpu", resources=local, resume_run=True,
                                  rounds=2, node_policy=strict)
    except FlowerError as exc:
        _skip_if_ray_did_not_start(exc)
        raise
    for k in range(3):
        entries = [e for path in (out / NODE_STATE / f"node-{k}").glob("run-*.json")
                   for e in json.loads(path.read_text())["entries"]]
        assert [e["round"] for e in entries] == [1]  # round 2 never entered


def test_a_secure_run_on_the_simulation_engine_spends_what_it_spends_in_process(tmp_path):
    """--secure-aggregation over Flower's Simulation Engine: each virtual node masks its own
    upload, a node whose policy names dp-fedavg-client admits it under threat-model server,
    and the epsilon against the server is the in-process run's (every share arrived)."""
    cfg = TrainConfig(method="dp-fedavg-client", clients=4, rounds=2, sigma=1.0, split="iid",
                      local_steps=2, lr_local=0.1, width=8, secure_aggregation="skellam")
    policy = write_policy(tmp_path / "policy.toml", allowed_methods=["dp-fedavg-client"],
                          min_batch_size=1)
    try:
        run = run_simulation_engine(cfg, tmp_path / "run", "cpu", node_policy=policy,
                                    resources=SimulationResources(address="local"))
    except FlowerError as exc:
        _skip_if_ray_did_not_start(exc)
        raise
    entries = load_checkpoint(tmp_path / "run" / CHECKPOINT)["ledger"]
    assert [e["status"] for e in entries] == ["completed", "completed"]
    assert [e["secure"]["received"] for e in entries] == [4, 4]
    assert run.summary.privacy.threat_model == "server"
    assert run.summary.privacy.epsilon == pytest.approx(
        train(cfg, None, "cpu").summary.privacy.epsilon, rel=1e-12)
