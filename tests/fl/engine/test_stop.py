"""SIGTERM stops a run between rounds: the round under way is trained and checkpointed,
nothing is charged for a round not trained, and resuming gives the uninterrupted run."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import tiny

from fedlap_privacy.fl.engine.compare import COMPARISON, run_comparison
from fedlap_privacy.fl.engine.events import RoundEnded
from fedlap_privacy.fl.engine.simulation import resume, train
from fedlap_privacy.fl.engine.stop import (
    STOP_EXIT_CODE,
    STOPPED,
    StopRequested,
    request_stop,
    stop_between_rounds,
    stop_requested,
)
from fedlap_privacy.fl.run.run_files import METRICS, PENDING


def _sigterm_after_round(round_: int):
    def callback(event):
        if isinstance(event, RoundEnded) and event.round == round_:
            os.kill(os.getpid(), signal.SIGTERM)

    return callback


def test_sigterm_stops_after_the_round_and_resume_equals_the_uninterrupted_run(tmp_path):
    cfg = tiny(method="dp-fedavg", rounds=3, reproducible_noise=True)
    full = train(dataclasses.replace(cfg), tmp_path / "full", device="cpu")
    with stop_between_rounds():
        cut = train(cfg, tmp_path / "cut", device="cpu", callback=_sigterm_after_round(1))
    assert cut.summary.stopped == STOPPED and cut.summary.rounds_run == 1
    assert not stop_requested()  # cleared on leaving the block
    assert not (tmp_path / "cut" / PENDING).exists()
    assert [(e.round, e.status) for e in cut.ledger.entries] == [(1, "completed")]
    resumed = resume(tmp_path / "cut", device="cpu")
    assert resumed.ledger.to_list() == full.ledger.to_list()  # nothing charged twice or lost
    for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values(),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_previous_sigterm_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with stop_between_rounds():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_stopped_comparison_says_so_and_the_same_call_resumes_it(tmp_path):
    base = tiny(width=8, local_steps=2)
    with stop_between_rounds():
        request_stop()
        with pytest.raises(StopRequested, match="after round 0 of 2"):
            run_comparison(base, [3.0], ["dp-fedavg"], 1, tmp_path, "cpu")
    assert not (tmp_path / COMPARISON).exists()  # no table of unfinished runs
    report = run_comparison(base, [3.0], ["dp-fedavg"], 1, tmp_path, "cpu")
    [run] = report.methods["dp-fedavg"].results["3"].runs
    assert run.rounds_run == 2 and run.stopped == "completed"
    assert 3.0 - 0.01 < run.epsilon <= 3.0


def test_train_command_stops_on_sigterm_with_exit_143_and_resumes(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fedlap_privacy", "train", "--rounds", "30", "--set", "width=8",
           "--set", "max_loops=1", "--set", "server_epochs=5", "--threads", "1", "--out",
           str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((out / METRICS).exists() and (out / METRICS).read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == STOP_EXIT_CODE, err
    done = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
    assert 1 <= len(done) < 30 and not (out / PENDING).exists()
    resumed = subprocess.run([sys.executable, "-m", "fedlap_privacy", "train", "--resume",
                              "--rounds", str(len(done) + 1), "--json", "--out", str(out)],
                             capture_output=True, text=True, timeout=300, check=False)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert summary["rounds_run"] == len(done) + 1 and summary["stopped"] == "completed"
    rows = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
    assert rows[-1]["rounds_spent"] == len(rows) == len(done) + 1  # no round charged untrained
