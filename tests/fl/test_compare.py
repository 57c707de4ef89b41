"""``compare``: every method gets the budget it is compared at, and the report says so."""

from __future__ import annotations

import json

import pytest
from helpers import tiny
from typer.testing import CliRunner

from fedlap_privacy.accountant import FedLAPSchedule, epsilon
from fedlap_privacy.cli.main import app
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.compare import COMPARISON, budget_config, run_comparison
from fedlap_privacy.fl.simulation import CHECKPOINT

#: this file's runs: the shared tiny configuration, narrower and with fewer local steps
SMALL = dict(width=8, local_steps=2)


def test_record_and_client_level_budgets_are_planned_to_the_target(tmp_path):
    base = tiny(**SMALL)
    for method in ("dp-fedavg", "dp-normfedavg"):
        cfg = budget_config(base, method, 3.0)
        assert cfg.sigma is None and cfg.target_eps == 3.0  # planned by the driver
    from fedlap_privacy.fl.simulation import train

    result = train(budget_config(base, "dp-normfedavg", 3.0), None, "cpu")
    schedule = FedLAPSchedule.client_level(base.clients, base.client_fraction)
    spent = epsilon(schedule, result.summary["sigma"], 2, base.delta)
    assert spent == pytest.approx(result.summary["epsilon"]) and 2.99 < spent <= 3.0


def test_local_budget_is_split_over_rounds_and_non_private_has_none():
    cfg = budget_config(tiny(**SMALL), "ldp-fl", 3.0)
    assert cfg.ldp_epsilon == pytest.approx(1.5) and cfg.rounds * cfg.ldp_epsilon == 3.0
    assert budget_config(tiny(**SMALL), "fedavg", None).notion == "none"
    with pytest.raises(ConfigError, match="not private"):
        budget_config(tiny(**SMALL), "fedavg", 3.0)
    with pytest.raises(ConfigError, match="target epsilon"):
        budget_config(tiny(**SMALL), "dp-fedavg", None)


def test_comparison_report_table_and_resume(tmp_path):
    base = tiny(**SMALL)
    report = run_comparison(base, [2.0, 8.0], ["dp-fedavg", "fedavg"], 2, tmp_path, "cpu")
    saved = json.loads((tmp_path / COMPARISON).read_text())
    assert saved["methods"].keys() == {"dp-fedavg", "fedavg"}
    dp = saved["methods"]["dp-fedavg"]
    assert dp["notion"] == "record-level" and set(dp["results"]) == {"2", "8"}
    for target in ("2", "8"):
        cell = dp["results"][target]
        runs = cell["runs"]
        assert [r["seed"] for r in runs] == [0, 1]
        assert all(r["epsilon"] <= float(target) + 1e-9 for r in runs)
        accs = [r["test_accuracy"] for r in runs]
        assert cell["mean"] == pytest.approx(sum(accs) / 2)
        for r in runs:  # the per-round record ends where the run ended
            assert len(r["accuracy_by_round"]) == r["rounds_run"] == 2
            assert r["accuracy_by_round"][-1] == r["test_accuracy"]
            assert r["epsilon_by_round"][-1] == pytest.approx(r["epsilon"])
        assert cell["mean_by_round"][-1] == pytest.approx(cell["mean"])
        assert cell["std"] == pytest.approx(abs(accs[0] - accs[1]) / 2)
    assert set(saved["methods"]["fedavg"]["results"]) == {"non-private"}
    # the upload of weight-uploading methods is the model: the same for both
    assert dp["upload_bytes"] == saved["methods"]["fedavg"]["upload_bytes"] > 0
    assert (tmp_path / "accuracy_vs_epsilon.png").stat().st_size > 0
    assert (tmp_path / "accuracy_vs_round.png").stat().st_size > 0
    # a second call finds finished runs and resumes them without training again
    ckpt = tmp_path / "runs" / "dp-fedavg-eps2-seed0" / CHECKPOINT
    stamp = ckpt.stat().st_mtime_ns
    again = run_comparison(base, [2.0, 8.0], ["dp-fedavg", "fedavg"], 2, tmp_path, "cpu")
    assert ckpt.stat().st_mtime_ns == stamp
    def numbers(r):
        return [(run["test_accuracy"], run["epsilon"]) for cell in r["methods"]["dp-fedavg"][
            "results"].values() for run in cell["runs"]]

    assert numbers(again) == numbers(report)
    # ... but refuses a directory whose runs had other settings
    with pytest.raises(ConfigError, match="other settings"):
        run_comparison(tiny(**{**SMALL, "local_steps": 3}), [2.0], ["dp-fedavg"], 1,
                       tmp_path, "cpu")


def test_cli_compare_prints_the_table_and_rejects_bad_input(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["compare", "--methods", "dp-fedavg", "--eps", "5", "--rounds", "1",
                             "--set", "width=8", "--set", "local_steps=2", "--out",
                             str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    assert "record-level" in ok.output and "eps 5" in ok.output
    for args in (["--eps", "three"], ["--eps", "-1"], ["--methods", "fedfoo"],
                 ["--set", "nonsense=1"], ["--seeds", "0"]):
        bad = runner.invoke(app, ["compare", "--out", str(tmp_path / "bad"), *args])
        assert bad.exit_code == 2, (args, bad.output)
        assert "Traceback" not in bad.output and len(bad.output.strip().splitlines()) == 1
