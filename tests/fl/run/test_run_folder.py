"""Privacy spent is never lost to the run folder: one writer at a time (two ``train`` on one
new ``--out``, two ``--resume`` at once, a comparison), a folder only its owner can change,
and the two checkpoints committed as one pair (a crash between their writes, between their
renames, or just after the commit leaves a run that ``--resume`` continues, counting exactly
the rounds whose data was touched)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import tiny
from lock_holder import lock_held_elsewhere
from typer.testing import CliRunner

from fedlap_privacy.cli.main import app
from fedlap_privacy.fl.engine.compare import run_comparison
from fedlap_privacy.fl.engine.simulation import resume, train
from fedlap_privacy.fl.engine.stop import STOP_EXIT_CODE
from fedlap_privacy.fl.run import run_files
from fedlap_privacy.fl.run.run_files import (
    CHECKPOINT,
    METRICS,
    PENDING,
    PRIVATE,
    committed_file,
    holds_run,
    load_private,
    load_release,
)
from fedlap_privacy.state.run_lock import LOCK_FILE, RunBusyError
from fedlap_privacy.state.run_state import ModelRelease, PrivateRunState

runner = CliRunner()
SMALL = ["--method", "dp-fedavg", "--local-steps", "1", "--set", "width=8", "--threads", "1"]


def _fails(args: list[str]) -> str:
    """The one line a refused command prints (exit 2, no traceback)."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return " ".join(lines[0].split())


def _rounds(out: Path) -> list[tuple[int, str]]:
    """(round, status) of every entry of the committed ledger."""
    return [(e["round"], e["status"]) for e in load_release(out).ledger]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / METRICS).read_text().splitlines()]


# ------------------------------------------------------------------ one writer
def test_two_trainings_on_one_new_out_the_second_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with lock_held_elsewhere(out) as (first, _):  # the first train: locked, reading its data
        line = _fails(["train", *SMALL, "--rounds", "1", "--out", str(out)])
        assert f"another process (pid {first.pid}) holds the run" in line
        assert [p.name for p in out.iterdir()] == [LOCK_FILE]  # the second wrote nothing
    result = runner.invoke(app, ["train", *SMALL, "--rounds", "1", "--out", str(out)])
    assert result.exit_code == 0, result.stderr  # the first is gone: the folder is free
    assert _rounds(out) == [(1, "completed")]


def test_two_resumes_at_once_the_second_is_refused(tmp_path: Path) -> None:
    """A job scheduler restarts ``--resume`` while the first copy still runs: the copy is
    refused, and the ledger holds every round the first trained, each once."""
    out = tmp_path / "run"
    train(tiny(method="dp-fedavg", rounds=1, local_steps=1, width=8), out, "cpu")
    cmd = [sys.executable, "-m", "fedlap_privacy", "train", "--resume", "--rounds", "100000",
           "--threads", "1", "--out", str(out)]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(_metrics(out)) < 2:  # the first copy holds the run and trains round 2+
            assert first.poll() is None and time.monotonic() < deadline, first.stderr
            time.sleep(0.05)
        line = _fails(["train", "--resume", "--rounds", "3", "--out", str(out)])
        assert f"another process (pid {first.pid}) holds the run" in line
        line = _fails(["train", *SMALL, "--out", str(out)])  # nor a new run over it
        assert f"another process (pid {first.pid}) holds the run" in line
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == STOP_EXIT_CODE, err
    rounds = _rounds(out)
    assert rounds == [(m, "completed") for m in range(1, len(rounds) + 1)]
    assert len(_metrics(out)) == len(rounds) == load_private(out).round
    assert not (out / PENDING).exists()


def test_a_comparison_is_refused_a_run_another_process_holds(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "dp-fedavg-eps3-seed0"
    with lock_held_elsewhere(run_dir):
        with pytest.raises(RunBusyError, match="holds the run"):
            run_comparison(tiny(width=8, local_steps=1), [3.0], ["dp-fedavg"], 1, tmp_path, "cpu")
        assert not holds_run(run_dir)


# ------------------------------------------------------------------ the owner's folder
@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_an_out_others_can_change_is_refused(tmp_path: Path, mode: int) -> None:
    out = tmp_path / "shared"
    out.mkdir()
    out.chmod(mode)  # pre-created for us: its other users could delete or rename the ledger
    line = _fails(["train", *SMALL, "--rounds", "1", "--out", str(out)])
    assert "writable by its group or by others" in line and "chmod go-w" in line
    assert list(out.iterdir()) == []
    done = tmp_path / "done"
    train(tiny(method="dp-fedavg", rounds=1, local_steps=1, width=8), done, "cpu")
    done.chmod(mode)  # opened up after the fact: resuming is refused too
    assert "writable by its group or by others" in _fails(
        ["train", "--resume", "--rounds", "2", "--out", str(done)])
    assert _rounds(done) == [(1, "completed")]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder away needs root")
def test_an_out_of_another_user_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "theirs"
    out.mkdir(mode=0o755)
    os.chown(out, 65534, 65534)
    assert "belongs to another user" in _fails(["train", *SMALL, "--rounds", "1", "--out",
                                                str(out)])
    assert list(out.iterdir()) == []


# ------------------------------------------------------------------ the pair, committed
def _staged(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("."))


def test_a_crash_between_the_two_checkpoint_writes_is_resumed(tmp_path, monkeypatch) -> None:
    out = tmp_path / "run"
    write = ModelRelease.save

    def disk_full(release: ModelRelease, path: Path) -> None:  # the pair's second write
        if release.round == 2:
            raise OSError("No space left on device")
        write(release, path)

    with monkeypatch.context() as patch:
        patch.setattr(ModelRelease, "save", disk_full)
        with pytest.raises(OSError, match="No space"):
            train(tiny(method="dp-fedavg", rounds=3, local_steps=2), out, "cpu")
    # round 2's private state was written, never committed: the pair is round 1's
    assert ModelRelease.load(out / CHECKPOINT).round == 1  # ckpt.pt stays audit-able
    assert PrivateRunState.load(out / PRIVATE).round == 1 == load_private(out).round
    assert (out / PENDING).exists()
    result = resume(out, device="cpu")
    # round 2 touched the data twice (the crashed attempt, then again): both are counted
    assert [(e.round, e.status) for e in result.ledger.entries] == [
        (1, "completed"), (2, "interrupted"), (2, "completed"), (3, "completed")]
    assert result.ledger.rounds_spent == 4 and result.summary.rounds_run == 3
    assert _staged(out) == [] and not (out / PENDING).exists()


def test_a_crash_between_the_two_renames_is_resumed(tmp_path, monkeypatch) -> None:
    out = tmp_path / "run"
    rename = run_files._roll_forward

    def power_cut(staged: Path, target: Path) -> None:
        if target.name == CHECKPOINT and ModelRelease.load(staged).round == 2:
            raise OSError("power cut")
        rename(staged, target)

    with monkeypatch.context() as patch:
        patch.setattr(run_files, "_roll_forward", power_cut)
        with pytest.raises(OSError, match="power cut"):
            train(tiny(method="dp-fedavg", rounds=3, local_steps=2), out, "cpu")
    # the pair of round 2 is committed; ckpt.pt (round 1) is still a whole checkpoint
    assert ModelRelease.load(out / CHECKPOINT).round == 1
    assert ModelRelease.load(committed_file(out, CHECKPOINT)).round == 2
    assert load_private(out).round == 2 and (out / PENDING).exists()
    # an audit of ckpt.pt reads the committed pair too, not ckpt.pt of round 1
    from fedlap_privacy.audit.inference.report import _load_target

    target = _load_target(out / CHECKPOINT, None)
    assert target.release.round == 2 == target.private.round
    result = resume(out, device="cpu")
    # round 2 was trained once and committed: its marker is not counted again
    assert [(e.round, e.status) for e in result.ledger.entries] == [
        (1, "completed"), (2, "completed"), (3, "completed")]
    assert result.ledger.rounds_spent == 3 and _staged(out) == []
    assert ModelRelease.load(out / CHECKPOINT).round == 3 == load_private(out).round


def test_a_crash_just_after_the_commit_is_not_counted_twice(tmp_path, monkeypatch) -> None:
    """The pair of round 2 is committed, its marker is not yet removed: today's code
    resumes (the round is in the ledger once); earlier, ``--resume`` refused forever."""
    out = tmp_path / "run"
    from fedlap_privacy.fl.engine import training_run

    write = training_run.write_text_atomic

    def crash_after_commit(path, text: str) -> None:
        if Path(path).name == METRICS and text.count("\n") == 2:
            raise OSError("killed")
        write(path, text)

    with monkeypatch.context() as patch:
        patch.setattr(training_run, "write_text_atomic", crash_after_commit)
        with pytest.raises(OSError, match="killed"):
            train(tiny(method="dp-fedavg", rounds=3, local_steps=2), out, "cpu")
    assert json.loads((out / PENDING).read_text())["round"] == 2 == load_private(out).round
    result = resume(out, device="cpu")
    assert [(e.round, e.status) for e in result.ledger.entries] == [
        (1, "completed"), (2, "completed"), (3, "completed")]
    assert len(_metrics(out)) == 3


def test_a_run_folder_of_an_earlier_version_resumes_and_a_broken_pointer_is_refused(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    train(tiny(method="dp-fedavg", rounds=1, local_steps=1, width=8), out, "cpu")
    (out / run_files.COMMIT).unlink()  # written before commit.json existed: ckpt.pt is read
    assert resume(out, rounds=2, device="cpu").ledger.rounds_spent == 2
    assert json.loads((out / run_files.COMMIT).read_text())["generation"] == 1
    (out / run_files.COMMIT).write_text('{"generation": "../../etc/passwd"}')
    assert "commit.json is unreadable" in _fails(["train", "--resume", "--rounds", "3",
                                                  "--out", str(out)])
    assert _staged(out) == []
