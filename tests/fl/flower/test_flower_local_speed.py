"""What a local Flower run no longer waits for: Flower's idle 3 s on every SuperNode
(fl/flower/local_supernode.py), a grace period per process on shutdown (processes.stop_all),
and where the rest of its time goes (fl/flower/timings.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import types

import pytest

pytest.importorskip("flwr")

from fedlap_privacy.fl.flower import local_supernode
from fedlap_privacy.fl.flower.deployment import LocalDeployment
from fedlap_privacy.fl.flower.local_supernode import NodeClock, loop_matches, patch
from fedlap_privacy.fl.flower.processes import stop_all
from fedlap_privacy.fl.flower.timings import TIMINGS, FlowerTimings, LauncherMarks


def test_the_installed_flower_has_the_loop_the_local_supernode_shortens():
    """Flower 1.41's SuperNode loop sleeps 3 s when idle: the local nodes' patch applies to
    the installed Flower (a Flower whose loop changed fails here, not silently in a run)."""
    import flwr.supernode.start_client_internal as loop

    assert loop_matches(loop)


def test_idle_waits_back_off_from_a_tenth_to_one_second_and_reset_on_a_message():
    slept: list[float] = []
    clock = NodeClock(slept.append)
    for _ in range(6):
        clock.sleep(3)  # Flower's idle wait
    clock.sleep(0.5)  # Flower's wait for the ClientApp's reply
    clock.sleep(2.0)  # any other wait is Flower's own
    assert slept == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 0.05, 2.0]
    clock.reset()
    clock.sleep(3)
    assert slept[-1] == 0.1
    assert clock.monotonic() == pytest.approx(time.monotonic(), abs=1.0)  # time's own


def _fake_loop() -> types.ModuleType:
    """A module with a SuperNode-like pull function and Flower's ``time``."""
    module = types.ModuleType("fake_loop")
    exec("import time\ndef _pull_and_store_message(**kw):\n    return kw.get('run')\n",
         module.__dict__)
    return module


def test_patch_resets_the_backoff_on_each_message_and_leaves_another_loop_alone(monkeypatch):
    import inspect

    module = _fake_loop()
    monkeypatch.setattr(inspect, "getsource", lambda m: "time.sleep(3)\ntime.sleep(0.5)\n")
    slept: list[float] = []
    clock = NodeClock(slept.append)
    assert patch(module, clock)
    module.time.sleep(3)
    module.time.sleep(3)
    assert module._pull_and_store_message(run=None) is None
    module.time.sleep(3)  # no message: still backing off
    assert module._pull_and_store_message(run=7) == 7
    module.time.sleep(3)  # a message came: from the start again
    assert slept == [0.1, 0.2, 0.4, 0.1]

    other = _fake_loop()
    monkeypatch.setattr(inspect, "getsource", lambda m: "time.sleep(5)\n")
    assert not patch(other) and other.time is time


def test_local_supernode_runs_flower_supernode_with_the_patch(monkeypatch):
    """``python -m ...local_supernode ARGS`` is ``flower-supernode ARGS``: Flower's own
    command line (its --help here), after the patch."""
    done = subprocess.run([sys.executable, "-m", local_supernode.__name__, "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "flower-supernode" in done.stdout and "--isolation" in done.stdout
    assert "not the one expected" not in done.stderr


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


def test_the_server_app_takes_the_machine_and_the_nodes_their_share(tmp_path, monkeypatch):
    """The ServerApp's environment counts one worker, the nodes' N; an explicit --threads is
    everyone's (the ServerApp is forked from the nodes' zygote and keeps the rest)."""
    from fedlap_privacy.fl.flower.serverapp_worker import SERVER_ENV

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    dep = LocalDeployment(4, tmp_path / "a")
    assert dep.env["FEDLAP_WORKERS"] == "4" and {**dep.env, **SERVER_ENV}["FEDLAP_WORKERS"] == "1"
    pinned = LocalDeployment(4, tmp_path / "b", threads=3)
    assert pinned.env["OMP_NUM_THREADS"] == "3" and "OMP_NUM_THREADS" not in SERVER_ENV


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
