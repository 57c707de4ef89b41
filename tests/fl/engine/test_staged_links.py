"""The files of a run's pair under their staged names (``.ckpt.pt.gN``, ``.private.pt.gN``)
are checked like the committed ones (issue 46, item 5): a symbolic link to another run's
files is refused in one line, exit 2, rather than followed (the run silently became the
other one); a folder under a staged name is one line too, not a raw Errno 21."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from helpers import tiny
from typer.testing import CliRunner

from fedlap_privacy.cli.main import app
from fedlap_privacy.fl.engine.simulation import train
from fedlap_privacy.state.checkpoint import CHECKPOINT, COMMIT, PRIVATE, staged_name
from fedlap_privacy.state.run_state import PrivateRunState

runner = CliRunner()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A finished one-round run (the victim's) and another run's files (its copy with
    another split seed: one training for both)."""
    root = tmp_path_factory.mktemp("staged")
    train(tiny(method="dp-fedavg", rounds=1, local_steps=1, width=8), root / "victim", "cpu")
    other = _copy(root / "victim", root / "other")
    private = PrivateRunState.load(other / PRIVATE)
    dataclasses.replace(private, split_seed=(private.split_seed or 0) + 1).save(other / PRIVATE)
    return root / "victim", other


def _generation(out: Path) -> int:
    return json.loads((out / COMMIT).read_text())["generation"]


def _refused(args: list[str], words: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output and "Errno" not in lines[0]
    assert words in lines[0], lines[0]


def _copy(run: Path, to: Path) -> Path:
    to.mkdir()
    for name in (CHECKPOINT, PRIVATE, COMMIT, "metrics.jsonl"):
        (to / name).write_bytes((run / name).read_bytes())
    return to


def test_staged_links_to_another_run_are_refused(runs: tuple[Path, Path],
                                                 tmp_path: Path) -> None:
    victim, other = runs
    run = _copy(victim, tmp_path / "run")
    generation = _generation(run)
    for name in (PRIVATE, CHECKPOINT):  # the committed pair, "still under staged names"
        os.symlink(other / name, run / staged_name(name, generation))
    seed = PrivateRunState.load(other / PRIVATE).split_seed
    _refused(["train", "--resume", "--out", str(run), "--rounds", "2", "--threads", "1"],
             "is a symbolic link")
    _refused(["audit", "--model", str(run / CHECKPOINT), "--attacks", "loss"],
             "is a symbolic link")
    assert not (run / PRIVATE).is_symlink() and not (run / CHECKPOINT).is_symlink()
    assert PrivateRunState.load(run / PRIVATE).split_seed != seed  # still the victim's
    assert PrivateRunState.load(other / PRIVATE).split_seed == seed


def test_a_committed_file_that_is_a_link_is_refused(runs: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    victim, other = runs
    run = _copy(victim, tmp_path / "run")
    (run / PRIVATE).unlink()
    os.symlink(other / PRIVATE, run / PRIVATE)
    _refused(["train", "--resume", "--out", str(run), "--rounds", "2", "--threads", "1"],
             "is a symbolic link")


@pytest.mark.parametrize("committed", [True, False], ids=["committed", "stale"])
def test_a_staged_folder_is_one_line(runs: tuple[Path, Path], tmp_path: Path,
                                     committed: bool) -> None:
    victim, _ = runs
    run = _copy(victim, tmp_path / "run")
    generation = _generation(run) + (0 if committed else 3)
    (run / staged_name(CHECKPOINT, generation)).mkdir()
    _refused(["train", "--resume", "--out", str(run), "--rounds", "2", "--threads", "1"],
             "is a folder")
