"""``train`` as a user of the ecosystem drives it: a named target is spent, sizes are reported."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedlap_privacy.cli.main import app

runner = CliRunner()
SMALL = ["--method", "dp-fedavg", "--local-steps", "2", "--set", "width=8"]


def _summary(args: list[str]) -> dict:
    result = runner.invoke(app, ["train", *SMALL, *args, "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_target_eps_alone_plans_sigma_and_spends_it(tmp_path: Path) -> None:
    summary = _summary(["--target-eps", "3", "--rounds", "3", "--out", str(tmp_path / "a")])
    assert summary["sigma_planned"] is True and summary["rounds_run"] == 3
    assert summary["epsilon"] == pytest.approx(3.0, rel=2e-3) and summary["epsilon"] <= 3.0


def test_explicit_sigma_keeps_the_stop_early_behaviour(tmp_path: Path) -> None:
    summary = _summary(["--target-eps", "3", "--sigma", "1", "--rounds", "10",
                        "--out", str(tmp_path / "b")])
    assert summary["sigma_planned"] is False and summary["sigma"] == 1.0
    assert summary["rounds_run"] < 10 and "would be exceeded" in summary["stopped"]


def test_summary_reports_upload_bytes(tmp_path: Path) -> None:
    summary = _summary(["--rounds", "2", "--out", str(tmp_path / "c")])
    history = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text()
               .splitlines()]
    assert summary["upload_bytes_mean"] == history[0]["upload_bytes"] > 0
    assert summary["upload_bytes_total"] == pytest.approx(
        sum(h["upload_bytes"] * h["replies"] for h in history))


def test_one_resolver_layers_preset_flags_and_settings() -> None:
    from fedlap_privacy.fl.config_resolve import config_value, resolve_config

    cfg = resolve_config("paper-dp", {"rounds": 3, "sigma": None}, ["lr_net=0.01"])
    assert (cfg.method, cfg.rounds, cfg.lr_net, cfg.sigma) == ("fedlap-dp", 3, 0.01, 1.0)
    planned = resolve_config(None, {"target_eps": 3.0}, [])
    assert planned.sigma is None  # planned for the rounds by the driver
    kept = resolve_config(None, {"target_eps": 3.0}, ["sigma=2"])  # a sigma set via --set
    assert kept.sigma == 2.0
    ali = resolve_config(None, {"method": "ali-dpfl", "target_eps": 3.0}, [])
    assert ali.sigma == 1.5  # ALI-DPFL keeps a fixed sigma
    # the same parser reads text (--set) and TOML-typed values (Flower's run config)
    assert config_value("rounds", "12", text=True) == config_value("rounds", 12.0, text=False)
    with pytest.raises(ValueError, match="must be int"):
        config_value("rounds", "12", text=False)


# ------------------------------------------------- bad input still escaped (issue 33, item 7)


def _refusal(args: list[str]) -> str:
    """The one stderr line of a refused command (exit 2, no traceback)."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def data_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every dataset read of the command (none may happen before the configuration is valid)."""
    import fedlap_privacy.data.datasets
    import fedlap_privacy.fl.engine.training_run

    reads: list[str] = []
    real = fedlap_privacy.data.datasets.load_dataset

    def spy(name: str, *args, **kwargs):
        reads.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(fedlap_privacy.data.datasets, "load_dataset", spy)
    monkeypatch.setattr(fedlap_privacy.fl.engine.training_run, "load_dataset", spy)
    return reads


@pytest.mark.parametrize("setting", [
    # NaN / inf momenta and weights trained a NaN model and exited 0
    "server_momentum=nan", "server_momentum=inf", "mse_weight=nan", "mse_weight=inf",
    "img_momentum=nan", "img_momentum=-inf",
    # accepted, then a traceback or a nonsense run
    "width=0", "width=-1", "depth=-1", "server_epochs=-1", "syn_steps=-1", "server_batch=-1",
    # failed inside round 1, after the private data was read and the round charged
    "server_batch=0", "lr_img=-1",
])
def test_bad_keys_are_refused_before_data_access_and_nothing_is_written(
    tmp_path: Path, data_reads: list[str], setting: str
) -> None:
    out = tmp_path / "run"
    key = setting.split("=")[0]
    line = _refusal(["train", "--set", setting, "--set", "max_loops=1", "--out", str(out)])
    # one line naming the key, its value and the allowed range
    assert line.startswith(f"error: {key} ") and " must be " in line
    assert "[" in line or ">" in line
    assert data_reads == []  # refused before any record was read
    assert not out.exists()  # nothing written, so no ledger and no round charged


def test_the_library_refuses_before_data_access_too(tmp_path: Path, data_reads) -> None:
    from helpers import tiny

    from fedlap_privacy.errors import ConfigError
    from fedlap_privacy.fl.engine.simulation import train

    for bad in (dict(server_batch=0), dict(lr_img=-1.0), dict(server_momentum=float("nan"))):
        with pytest.raises(ConfigError, match=f"{next(iter(bad))} .* must be"):
            train(tiny(**bad), tmp_path / "run", device="cpu")
    assert data_reads == [] and not (tmp_path / "run").exists()


def test_an_out_that_cannot_be_created_is_one_line_before_data_access(
    tmp_path: Path, data_reads: list[str]
) -> None:
    file = tmp_path / "file"
    file.write_text("keep")
    line = _refusal(["train", *SMALL, "--out", str(file / "run")])  # was: NotADirectoryError
    assert "cannot be created" in line and "is a file, not a folder" in line
    assert data_reads == [] and file.read_text() == "keep"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_out_is_one_line_before_data_access(tmp_path: Path, data_reads) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        line = _refusal(["train", *SMALL, "--out", str(locked / "run")])  # was: PermissionError
    finally:
        locked.chmod(0o700)
    assert "cannot be written" in line and "ermission denied" in line
    assert data_reads == [] and list(locked.iterdir()) == []


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-round dp-fedavg run on digits to resume (recorded: sigma 1.5, seed 0, width 8)."""
    out = tmp_path_factory.mktemp("resume") / "run"
    result = runner.invoke(app, ["train", *SMALL, "--rounds", "1", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    return out


@pytest.mark.parametrize(("flags", "named"), [
    (["--sigma", "3"], ["--sigma 3.0 (the run has 1.5)"]),
    (["--method", "fedavg"], ["--method 'fedavg' (the run has 'dp-fedavg')"]),
    (["--dataset", "mnist", "--seed", "7"],
     ["--dataset 'mnist' (the run has 'digits')", "--seed 7 (the run has 0)"]),
    (["--set", "lr_local=0.2", "--target-eps", "3"],
     ["--target-eps 3.0 (the run has None)", "--set lr_local=0.2 (the run has 0.5)"]),
    (["--delta", "1e-6", "--reproducible-noise"], ["--delta 1e-06", "--reproducible-noise True"]),
    (["--preset", "paper-dp"], ["--preset paper-dp (method='fedlap-dp') (the run has "
                                "'dp-fedavg')", "--preset paper-dp (sigma=1.0)"]),
])
def test_resume_refuses_flags_that_differ_from_the_recorded_run(
    run_dir: Path, flags: list[str], named: list[str]
) -> None:
    before = (run_dir / "ckpt.pt").read_bytes()
    line = _refusal(["train", "--resume", "--out", str(run_dir), "--rounds", "2", *flags])
    assert "--resume continues the run with its recorded settings" in line
    for text in named:  # each conflicting flag by name, with both values
        assert text in line, line
    assert "--rounds" not in line.split("differ:")[1].split("(only")[0]  # more rounds: allowed
    assert (run_dir / "ckpt.pt").read_bytes() == before  # the run was not touched


def test_resume_accepts_flags_equal_to_the_recorded_run_and_more_rounds(
    run_dir: Path, tmp_path: Path
) -> None:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    summary = _summary(["--resume", "--out", str(copy), "--rounds", "2", "--dataset", "digits",
                        "--sigma", "1.5", "--seed", "0"])  # SMALL's flags are the run's own
    assert summary["rounds_run"] == 2 and summary["sigma"] == 1.5


@pytest.mark.parametrize(("args", "needle"), [
    (["--split", "iid", "--clients", "1439"], "clients 1439: digits has 1,438 training records"),
    (["--split", "shards", "--clients", "720"], "2 shards of at least one record each"),
    (["--clients", "0"], "clients 0 must be an integer in [1, 100000]"),
    (["--clients", "-5"], "clients -5 must be"),
])
def test_more_clients_than_records_is_one_line_before_data_access(
    tmp_path: Path, data_reads: list[str], args: list[str], needle: str
) -> None:
    out = tmp_path / "run"
    line = _refusal(["train", "--method", "fedavg", *args, "--out", str(out)])
    assert needle in line
    assert data_reads == [] and not out.exists()


def test_a_refused_run_prints_its_error_and_no_progress_bar(tmp_path: Path) -> None:
    """A second run into a folder holding one: the one-line refusal, no empty "training
    0:00:00" bar after it."""
    args = ["train", *SMALL, "--sigma", "2", "--rounds", "1", "--out", str(tmp_path / "r")]
    assert runner.invoke(app, args).exit_code == 0
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and "already holds a run" in refused.output
    assert "training" not in refused.output and "0:00:00" not in refused.output


def test_a_download_says_what_it_fetches_before_it_starts(tmp_path: Path, monkeypatch) -> None:
    """train --download names the files, megabytes and host first (here the network is
    refused: the failure is one line, nothing trained)."""
    from fedlap_privacy.data import dataset_files
    from fedlap_privacy.errors import DataError

    def offline(url: str, target: Path, md5: str) -> None:
        raise DataError(f"cannot download {target.name} from {url}: offline")

    monkeypatch.setattr(dataset_files, "_download", offline)
    result = runner.invoke(app, ["train", *SMALL, "--dataset", "fashion-mnist", "--data-dir",
                                 str(tmp_path / "data"), "--sigma", "1", "--rounds", "1",
                                 "--download", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "downloading 4 files, 30.9 MB, from fashion-mnist.s3" in " ".join(
        result.output.split())
    assert "offline" in result.output and not (tmp_path / "r" / "ckpt.pt").exists()
