"""What a local Flower run no longer waits for: a grace period per process on shutdown
(processes.stop_all); the environment Flower's processes get; and where a run's time goes
(fl/flower/timings.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

pytest.importorskip("flwr")

from fedlap_privacy.fl.flower.deployment import LocalDeployment
from fedlap_privacy.fl.flower.processes import stop_all
from fedlap_privacy.fl.flower.timings import TIMINGS, FlowerTimings, LauncherMarks


def _stubborn() -> subprocess.Popen[bytes]:
    """A process that ignores SIGTERM (so that only the KILL after the grace ends it)."""
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    time.sleep(0.5)  # the handler is set
    return proc


def test_stop_all_gives_every_process_one_grace_period_together():
    """Three processes that ignore TERM are killed after ONE grace period (1 s), not one
    each (3 s: what stopping them one by one took)."""
    procs = [_stubborn() for _ in range(3)]
    start = time.monotonic()
    stop_all(procs, grace=1.0)
    took = time.monotonic() - start
    assert all(p.returncode is not None for p in procs)
    assert 1.0 <= took < 2.0


def test_the_nodes_share_the_machine_and_inherit_the_runtime_defaults(tmp_path, monkeypatch):
    """Flower's processes get the deployment's environment: each node its share of the CPUs
    (N workers) or the explicit --threads, ``FLWR_HOME`` in the working folder, and torch's
    allocator default set before any of them imports torch (runtime_env.py)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    monkeypatch.delenv("FEDLAP_FAST_PATHS", raising=False)
    dep = LocalDeployment(4, tmp_path / "a")
    assert dep.env["FEDLAP_WORKERS"] == "4" and "OMP_NUM_THREADS" not in dep.env
    assert dep.env["FLWR_HOME"] == str(tmp_path / "a" / "home")
    assert dep.env["THP_MEM_ALLOC_ENABLE"] == "1"
    pinned = LocalDeployment(4, tmp_path / "b", threads=3)
    assert pinned.env["OMP_NUM_THREADS"] == "3" and pinned.env["MKL_NUM_THREADS"] == "3"


def test_timings_combine_the_launchers_and_the_servers_instants(tmp_path):
    marks = LauncherMarks(begin=100.0, superlink=103.0, supernodes=103.5, flwr_run=103.5,
                          run_end=160.0, closed=161.5)
    server = {"started": 110.0, "discovered": 118.0, "finished": 158.0}
    timings = FlowerTimings.of(marks, server, [12.0, 9.0, 9.5, 9.0])
    assert (timings.superlink_s, timings.supernodes_s, timings.serverapp_s) == (3.0, 0.5, 6.5)
    assert (timings.discovery_s, timings.training_s) == (8.0, 40.0)
    assert (timings.finish_s, timings.shutdown_s, timings.total_s) == (2.0, 1.5, 61.5)
    timings.write(tmp_path)
    again = FlowerTimings.from_json(json.loads((tmp_path / TIMINGS).read_text()))
    assert again == timings
    assert "discovery 8.0 s" in timings.line() and "rounds 12.0, 9.0, 9.5, 9.0" in timings.line()
