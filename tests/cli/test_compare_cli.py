"""``fedlap-privacy compare --rounds 1,3,10``: a list of round counts, each with its own budget.

Good input: a table with one column per round count (final accuracy and the epsilon spent)
and comparison.json with a record per count. Bad input: exit 2, one line, no traceback.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fedlap_privacy.cli.main import app
from fedlap_privacy.fl.engine.compare import COMPARISON

#: a narrow model with few local steps on the digits defaults (about a second a round)
FAST = ["--set", "width=8", "--set", "local_steps=2"]


@pytest.mark.parametrize("args", [
    ["--rounds", "0"], ["--rounds", "1,x"], ["--rounds", ""], ["--rounds", ","],
    ["--rounds", "1.5"], ["--rounds=-1"], ["--rounds", "1,0,3"],
    ["--rounds", "1,2", "--set", "rounds=2"],
])
def test_bad_round_counts_are_one_line_and_exit_2(tmp_path, args):
    bad = CliRunner().invoke(app, ["compare", "--methods", "dp-fedavg", "--out",
                                   str(tmp_path), *args])
    assert bad.exit_code == 2, (args, bad.output)
    lines = bad.output.strip().splitlines()
    assert "Traceback" not in bad.output and len(lines) == 1, bad.output
    assert "rounds" in lines[0]
    assert not (tmp_path / COMPARISON).exists()


@pytest.mark.parametrize("key", ["sigma=0.5", "target_eps=1", "ldp_epsilon=2"])
def test_a_budget_setting_is_refused_not_dropped(tmp_path, key):
    """compare plans each cell's noise from --eps; a --set sigma used to be ignored silently."""
    bad = CliRunner().invoke(app, ["compare", "--methods", "dp-fedavg", "--eps", "1", "--set",
                                   key, "--out", str(tmp_path)])
    assert bad.exit_code == 2, bad.output
    lines = bad.output.strip().splitlines()
    assert len(lines) == 1 and key.split("=")[0] in lines[0] and "train --sigma" in lines[0]
    assert not (tmp_path / COMPARISON).exists()


def test_several_round_counts_table_one_column_each(tmp_path):
    ok = CliRunner().invoke(
        app, ["compare", "--methods", "dp-fedavg,fedavg", "--eps", "5", "--rounds", "2,1,2",
              *FAST, "--out", str(tmp_path)],
        env={"COLUMNS": "200"},
    )
    assert ok.exit_code == 0, ok.output
    assert "1 round " in ok.output and "2 rounds" in ok.output  # duplicates dropped
    saved = json.loads((tmp_path / COMPARISON).read_text())
    assert saved["round_counts"] == [1, 2] and saved["rounds"] == 2
    points = saved["methods"]["dp-fedavg"]["results"]["5"]["by_rounds"]
    assert [p["rounds"] for p in points] == [1, 2]
    for p in points:  # each count spends the target after its own rounds
        assert 4.99 < p["epsilon_mean"] <= 5.0 + 1e-9
        assert f"{100 * p['mean']:.2f}" in ok.output
    assert points[0]["sigma_mean"] < points[1]["sigma_mean"]
    assert ok.output.count("eps 5.00") == 2  # the epsilon spent, in each count's cell
    assert (tmp_path / "accuracy_vs_rounds.png").stat().st_size > 0
    assert (tmp_path / "runs" / "fedavg-nodp-rounds1-seed0").is_dir()


def test_one_round_count_keeps_the_epsilon_table_and_layout(tmp_path):
    ok = CliRunner().invoke(
        app, ["compare", "--methods", "dp-fedavg", "--eps", "5", "--rounds", "1", *FAST,
              "--out", str(tmp_path)],
        env={"COLUMNS": "200"},
    )
    assert ok.exit_code == 0, ok.output
    assert "eps 5" in ok.output and "1 round " not in ok.output
    saved = json.loads((tmp_path / COMPARISON).read_text())
    assert saved["rounds"] == 1 and saved["round_counts"] == [1]
    assert (tmp_path / "runs" / "dp-fedavg-eps5-seed0").is_dir()


#: one access, one local step and a 4-channel model for every method (FedLAP's knobs too)
TINIEST = ["--set", "width=4", "--set", "local_steps=1", "--set", "reinits=1",
           "--set", "max_loops=1", "--set", "real_batches=1", "--set", "syn_steps=1",
           "--set", "ipc=1", "--set", "server_epochs=1", "--set", "local_model_steps=0"]


def test_compare_with_the_default_methods_runs_every_method(tmp_path):
    """No --methods: all of them, ALI-DPFL (a fixed sigma and its own budget) and LDP-FL (a
    per-weight epsilon) included; each private one spends at most its target."""
    from fedlap_privacy.fl.config_rules import METHODS

    ok = CliRunner().invoke(
        app, ["compare", "--eps", "5", "--rounds", "1", *TINIEST, "--out", str(tmp_path)],
        env={"COLUMNS": "200"},
    )
    assert ok.exit_code == 0, ok.output
    saved = json.loads((tmp_path / COMPARISON).read_text())
    assert list(saved["methods"]) == list(METHODS)
    for method, row in saved["methods"].items():
        (column,) = row["results"]
        (run,) = row["results"][column]["runs"]
        assert run["rounds_run"] == 1, method
        if row["notion"] == "none":
            assert column == "non-private" and run["epsilon"] is None
        else:
            assert column == "5" and 0 < run["epsilon"] <= 5.0 + 1e-9, (method, run)
    ali = saved["methods"]["ali-dpfl"]["results"]["5"]["runs"][0]
    fedavg = saved["methods"]["dp-fedavg"]["results"]["5"]["runs"][0]
    assert ali["sigma"] == fedavg["sigma"]  # DP-FedAvg's planned sigma, its own budget
    assert saved["configs"]["ali-dpfl"]["target_eps"] is None  # the base is a template
