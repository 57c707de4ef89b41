"""``train --method dp-fedavg-client``: each bad input is one line, exit 2, nothing written;
``--dry-run`` shows the method, its sampling and how it is accounted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedlap_privacy.cli.main import app

runner = CliRunner()
BASE = ["train", "--method", "dp-fedavg-client", "--rounds", "2", "--set", "width=8"]


def _refusal(args: list[str]) -> str:
    """The one stderr line of a refused command (exit 2, no traceback)."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    assert "Traceback" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("error")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "message"), [
    (["--clients", "5", "--clients-per-round", "6"], "clients per round 6 is larger than the 5"),
    (["--clients", "5", "--clients-per-round", "0"], "clients_per_round 0 must be an integer"),
    (["--client-fraction", "0"], "client_fraction 0.0 must be a finite number in (0, 1]"),
    (["--client-fraction", "1.5"], "client_fraction 1.5 must be a finite number in (0, 1]"),
    (["--clients", "6", "--client-fraction", "0.5", "--clients-per-round", "3"],
     "not both"),
    (["--clients", "20", "--split", "iid", "--target-eps", "0.001"],
     "epsilon 0.001 is out of reach"),
    (["--clients", "20", "--split", "iid", "--target-eps", "1", "--set", "clip_quantile=0.5",
      "--set", "clip_count_sigma=0.1"], "clip_count_sigma 0.1 must exceed sigma/2"),
    (["--clients", "300", "--split", "dirichlet", "--alpha", "0.05"], "without records"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_is_written(tmp_path: Path, args, message):
    out = tmp_path / "run"
    line = _refusal([*BASE, *args, "--out", str(out)])
    assert message in line
    assert not out.exists()


def test_clients_per_round_is_refused_for_a_poisson_accounted_method(tmp_path: Path):
    line = _refusal(["train", "--method", "dp-normfedavg", "--clients", "5",
                     "--clients-per-round", "2", "--out", str(tmp_path / "r")])
    assert "assumes Poisson client sampling" in line


def test_a_client_without_records_is_refused(tmp_path: Path):
    from fedlap_privacy.data.datasets import load_dataset
    from fedlap_privacy.errors import ConfigError
    from fedlap_privacy.fl.config import TrainConfig
    from fedlap_privacy.fl.engine.simulation import train

    data = load_dataset("digits")
    n = len(data.y_train)
    parts = (np.arange(0, n // 2), np.arange(0, 0), np.arange(n // 2, n))
    import dataclasses

    data = dataclasses.replace(data, partition=parts)
    cfg = TrainConfig(method="dp-fedavg-client", clients=3, sigma=1.0, rounds=1, width=8)
    with pytest.raises(ConfigError, match="client 1 holds no records"):
        train(cfg, tmp_path / "run", "cpu", data=data)
    assert not (tmp_path / "run").exists()


def test_dry_run_shows_the_method_and_its_sampling(tmp_path: Path):
    result = runner.invoke(app, [*BASE, "--clients", "20", "--split", "iid",
                                 "--clients-per-round", "5", "--target-eps", "4", "--dry-run",
                                 "--out", str(tmp_path / "d")])
    assert result.exit_code == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "dp-fedavg-client" in text and "5 per round" in text
    assert "without replacement" in text and "trusted" in text
    assert not (tmp_path / "d").exists()
