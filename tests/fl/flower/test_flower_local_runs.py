"""Whole local Flower runs through ``train --engine flower``'s launcher (fl/flower/runner.py):
a resumed run keeps each node's budget; a stopped run leaves no process behind. (In a file of
their own so that pytest -n runs them beside test_flower.py's deployment tests.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

flwr = pytest.importorskip("flwr")

import helpers  # noqa: E402
from flower_grid import write_policy  # noqa: E402

from fedlap_privacy.fl.engine.flower_app import FlowerError  # noqa: E402
from fedlap_privacy.fl.flower.node_ledger import NODE_STATE  # noqa: E402

#: the shared tiny configuration on two clients, with seeded noise (as test_flower.py)
FLOWER = dict(clients=2, reproducible_noise=True)
tiny = partial(helpers.tiny, **FLOWER)


@pytest.mark.flower
def test_a_resumed_run_keeps_each_nodes_budget(tmp_path, monkeypatch):
    """The attacker's way around a node's budget: stop the run and ``--resume`` it. The
    local nodes' ledgers stay in the run folder, so the resumed run's nodes still count the
    first round: with a budget that fits one round but not two, the node refuses round 2
    (with the nodes' ledgers in the deployment's temporary folder it admitted it)."""
    from fedlap_privacy.fl.flower.runner import run_flower

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "run"
    allow = write_policy(tmp_path / "allow.toml", allow_reproducible_noise=True)
    first = run_flower(tiny(method="dp-fedavg", rounds=1), out, device="cpu",
                       node_policy=allow)
    one_round = first.summary.privacy.epsilon
    assert first.summary.rounds_run == 1 and one_round > 0
    strict = write_policy(tmp_path / "strict.toml", allow_reproducible_noise=True,
                          epsilon=1.1 * one_round)
    with pytest.raises(FlowerError, match="refused"):
        run_flower(None, out, device="cpu", resume_run=True, rounds=2, node_policy=strict)
    (path,) = (out / NODE_STATE / "node-0").glob("run-*.json")
    assert [e["round"] for e in json.loads(path.read_text())["entries"]] == [1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT,
                                                                marks=pytest.mark.slow)],
                         ids=["SIGTERM", "Ctrl-C"])
def test_a_stopped_local_run_leaves_no_process_behind(tmp_path, sig):
    """``train --engine flower`` stopped from outside (a job scheduler's SIGTERM, Ctrl-C):
    every process it started (SuperLink, SuperNodes, the SuperExecs they start and their
    ServerApp and ClientApp processes, ``flwr run``; each in a session of its own, so a
    signal to the command's group reaches none of them) is gone when the command exits,
    with one line,
    its exit status and the run folder's lock free. The processes are those seen under the
    command in /proc while it ran (pid and start time: a reused pid is not counted)."""
    from fedlap_privacy.fl.flower.processes import family

    sets = [f"--set={k}={v}" for k, v in {**helpers.TINY, **FLOWER}.items()
            if k not in ("rounds", "clients")]
    policy = write_policy(tmp_path / "policy.toml", allow_reproducible_noise=True)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedlap_privacy", "train", "--engine", "flower", "--clients",
         "2", "--rounds", "200", "--device", "cpu", "--json", "--out", str(out),
         "--node-policy", str(policy), *sets],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen: set[tuple[int, int]] = set()
    deadline = time.monotonic() + 120
    try:  # until the first round is done: every process is up
        while not (out / "metrics.jsonl").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "the run did not finish a round in 120 s"
            seen.update(family(proc.pid))
            time.sleep(0.1)
        seen.update(family(proc.pid))
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(seen) >= 8  # the command, SuperLink and its SuperExec, ServerApp, flwr run,
    # 2 x (node, its SuperExec)
    expected = 128 + signal.SIGTERM if sig == signal.SIGTERM else 130
    assert proc.returncode == expected, output
    lines = output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in output, output
    assert ("stopped by SIGTERM" if sig == signal.SIGTERM else "interrupted") in lines[0]
    time.sleep(0.5)
    alive = []
    for pid, started in seen:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[19]) == started:
            alive.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120])
    assert alive == []
    import fcntl  # the run folder's lock is free (its file stays, by design: run_lock.py)

    with open(out / "run.lock", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
