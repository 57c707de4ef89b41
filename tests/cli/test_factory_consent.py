"""A model factory recorded in a run's files is shown, never imported on its own (issue 46,
item 1): a ckpt.pt / private.pt edited to name another file or a module makes ``audit``
(also ``--dry-run``, a lone ckpt.pt, ``--reference-models``) and ``train --resume`` (also
``--dry-run``) refuse in one line, exit 2, before the named code runs; the person running
the command names the factory (``audit --model-factory``, ``train --resume --model``) and
then it runs. The package's own factory is rebuilt from an exact match only."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner
from user_records import tabular_folder

from fedlap_privacy.cli.main import app
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.simulation import resume, train
from fedlap_privacy.state.checkpoint import CHECKPOINT, PRIVATE
from fedlap_privacy.state.run_state import ModelRelease, PrivateRunState

runner = CliRunner()

MODEL_CODE = ("from torch import nn\n"
              "def make(shape, k):\n"
              "    return nn.Sequential(nn.Linear(shape[0], 8), nn.ReLU(), nn.Linear(8, k))\n")


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of the owner's own factory ``<root>/net.py:make`` (absolute spec)."""
    root = tmp_path_factory.mktemp("consent")
    (root / "net.py").write_text(MODEL_CODE)
    data = tabular_folder(root / "d")
    cfg = TrainConfig(method="fedavg", rounds=1, batch_size=32, local_steps=2, lr_local=0.3,
                      model=f"{root / 'net.py'}:make", seed=0)
    train(cfg, root / "run", "cpu", data=data)
    return root


def _forged(genuine: Path, tmp_path: Path, spec: str) -> Path:
    """A copy of the genuine run whose ckpt.pt and private.pt both name ``spec``."""
    run = tmp_path / "shared"
    shutil.copytree(genuine / "run", run)
    release = ModelRelease.load(run / CHECKPOINT)
    assert release.model_factory is not None
    dataclasses.replace(release, model_factory={**release.model_factory, "factory": spec}
                        ).save(run / CHECKPOINT)
    private = PrivateRunState.load(run / PRIVATE)
    dataclasses.replace(private, config={**private.config, "model": spec}).save(run / PRIVATE)
    return run


def _evil(tmp_path: Path) -> tuple[str, Path]:
    """An attacker's factory file that writes a marker when it is imported."""
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.py"
    path.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
                    + MODEL_CODE)
    return f"{path}:make", marker


def _refused(result, spec: str, flag: str) -> None:  # type: ignore[no-untyped-def]
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1
    assert f"built by {spec}" in result.stderr and "not imported" in result.stderr
    assert f"rerun with {flag} {spec}" in result.stderr


@pytest.mark.parametrize("extra", [[], ["--dry-run"], ["--reference-models", "1"]],
                         ids=["audit", "dry-run", "reference-models"])
def test_audit_never_imports_the_factory_a_ckpt_names(genuine: Path, tmp_path: Path,
                                                      extra: list[str]) -> None:
    spec, marker = _evil(tmp_path)
    run = _forged(genuine, tmp_path, spec)
    result = runner.invoke(app, ["audit", "--model", str(run / CHECKPOINT), "--attacks",
                                 "loss", *extra])
    _refused(result, spec, "--model-factory")
    assert not marker.exists()


def test_a_lone_ckpt_never_imports_its_factory(genuine: Path, tmp_path: Path) -> None:
    spec, marker = _evil(tmp_path)
    run = _forged(genuine, tmp_path, spec)
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(run / CHECKPOINT, lone / CHECKPOINT)
    result = runner.invoke(app, ["audit", "--model", str(lone / CHECKPOINT)])
    _refused(result, spec, "--model-factory")
    assert not marker.exists()


@pytest.mark.parametrize("extra", [[], ["--dry-run"]], ids=["resume", "dry-run"])
def test_resume_never_imports_the_factory_a_shared_folder_names(
        genuine: Path, tmp_path: Path, extra: list[str]) -> None:
    spec, marker = _evil(tmp_path)
    run = _forged(genuine, tmp_path, spec)
    result = runner.invoke(app, ["train", "--resume", "--out", str(run), "--rounds", "2",
                                 *extra])
    _refused(result, spec, "--model")
    assert not marker.exists()
    other = runner.invoke(app, ["train", "--resume", "--out", str(run), "--rounds", "2",
                                "--model", f"{genuine / 'net.py'}:make", *extra])
    assert other.exit_code == 2 and "differ" in other.stderr and not marker.exists()


def test_a_recorded_module_is_not_imported(genuine: Path, tmp_path: Path) -> None:
    """``this:make``: the module ``this`` (it prints on import) is never imported."""
    sys.modules.pop("this", None)
    run = _forged(genuine, tmp_path, "this:make")
    for args in (["audit", "--model", str(run / CHECKPOINT)],
                 ["audit", "--model", str(run / CHECKPOINT), "--dry-run"],
                 ["train", "--resume", "--out", str(run), "--rounds", "2"]):
        result = runner.invoke(app, args)
        _refused(result, "this:make", "--model-factory" if args[0] == "audit" else "--model")
        assert "this" not in sys.modules


def test_a_spec_with_markup_is_shown_quoted_and_not_imported(genuine: Path,
                                                             tmp_path: Path) -> None:
    spec = "[bold]x\ny.py:make"
    run = _forged(genuine, tmp_path, spec)
    result = runner.invoke(app, ["audit", "--model", str(run / CHECKPOINT)])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "'[bold]x\\ny.py:make'" in result.stderr


def test_the_user_who_names_the_factory_runs_it(genuine: Path, tmp_path: Path) -> None:
    spec, marker = _evil(tmp_path)
    run = _forged(genuine, tmp_path, spec)
    dry = runner.invoke(app, ["audit", "--model", str(run / CHECKPOINT), "--attacks", "loss",
                              "--model-factory", spec, "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.stdout)["seconds"] is None and not marker.exists()
    result = runner.invoke(app, ["audit", "--model", str(run / CHECKPOINT), "--attacks",
                                 "loss", "--model-factory", spec, "--json"])
    assert result.exit_code == 0, result.output
    assert marker.read_text() == "ran"
    assert json.loads(result.stdout.splitlines()[-1])["dataset"]["name"] == "custom"


def test_resume_with_the_recorded_model_continues(genuine: Path, tmp_path: Path) -> None:
    run = tmp_path / "own"
    shutil.copytree(genuine / "run", run)
    spec = f"{genuine / 'net.py'}:make"
    with pytest.raises(ConfigError, match="rerun with --model"):
        resume(run, rounds=2, device="cpu")
    result = runner.invoke(app, ["train", "--resume", "--out", str(run), "--rounds", "2",
                                 "--model", spec, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[-1])["rounds_run"] == 2


def test_only_the_exact_package_factory_passes_without_consent() -> None:
    from fedlap_privacy.model_factory import DEFAULT_TABULAR, named_factory

    assert named_factory(DEFAULT_TABULAR, None, "ckpt.pt", "--model-factory") == DEFAULT_TABULAR
    for recorded in ("fedlap_privacy.models:build_model", f" {DEFAULT_TABULAR}",
                     "fedlap_privacy.models:tabular_mlp.py:make", "os:system"):
        with pytest.raises(ConfigError, match="not imported"):
            named_factory(recorded, None, "ckpt.pt", "--model-factory")
    assert named_factory("/tmp/evil.py:make", "mine.py:make", "ckpt.pt",
                         "--model-factory") == "mine.py:make"
    with pytest.raises(ConfigError, match="is not the factory of this run"):
        named_factory("/tmp/evil.py:make", "mine.py:make", "private.pt", "--model", exact=True)


def test_reference_models_and_flower_resume_need_the_named_factory(genuine: Path,
                                                                   tmp_path: Path) -> None:
    """The other readers of a recorded configuration: reference models (trained like the
    run) and a Flower resume's launcher refuse without the user's factory, take it with."""
    from fedlap_privacy.fl.auditing.reference_models import reference_config

    spec, marker = _evil(tmp_path)
    run = _forged(genuine, tmp_path, spec)
    with pytest.raises(ConfigError, match="rerun with --model-factory"):
        reference_config(run, 0)
    assert reference_config(run, 0, "mine.py:make").model == "mine.py:make"
    pytest.importorskip("flwr")
    from fedlap_privacy.fl.flower.runner import prepare_run

    with pytest.raises(ConfigError, match="rerun with --model"):
        prepare_run(None, run, True)
    assert prepare_run(None, run, True, spec).model == spec
    assert not marker.exists()
