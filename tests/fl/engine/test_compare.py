"""``compare``: every method gets the budget it is compared at, and the report says so."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import tiny
from typer.testing import CliRunner

from fedlap_privacy.accountant import FedLAPSchedule, epsilon
from fedlap_privacy.cli.main import app
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.engine.compare import (
    COMPARISON,
    budget_config,
    comparison_split_seed,
    plan_jobs,
    run_comparison,
)
from fedlap_privacy.fl.engine.compare_budgets import client_sizes
from fedlap_privacy.fl.engine.simulation import CHECKPOINT, train
from fedlap_privacy.fl.run.privacy import with_planned_sigma

#: this file's runs: the shared tiny configuration, narrower and with fewer local steps
SMALL = dict(width=8, local_steps=2)
#: a target is met when the accountant reports at most it and within this much below it
#: (plan_sigma finds sigma to relative precision 1e-4)
BELOW = 0.01


def test_record_and_client_level_budgets_are_planned_to_the_target(tmp_path):
    base = tiny(**SMALL)
    for method in ("dp-fedavg", "dp-normfedavg"):
        cfg = budget_config(base, method, 3.0)
        assert cfg.sigma is None and cfg.target_eps == 3.0  # planned by the driver
    from fedlap_privacy.fl.engine.simulation import train

    result = train(budget_config(base, "dp-normfedavg", 3.0), None, "cpu")
    privacy = result.summary.privacy
    assert privacy.accountant == "pld"  # the default: planned and reported with PLD
    schedule = FedLAPSchedule.client_level(base.clients, base.client_fraction)
    spent = epsilon(schedule, privacy.sigma, 2, base.delta, accountant="pld")
    assert spent == pytest.approx(privacy.epsilon) and 3.0 - BELOW < spent <= 3.0
    # RDP's figure of the same run, kept beside it: looser, so above the target PLD meets
    rdp = epsilon(schedule, privacy.sigma, 2, base.delta, accountant="rdp")
    assert privacy.epsilon_by_accountant == pytest.approx({"pld": spent, "rdp": rdp})
    assert rdp > 3.0


def test_planned_sigma_with_pld_is_below_rdps_for_the_same_guarantee():
    """compare's cells plan sigma with the run's accountant: PLD (the default) needs less
    noise than RDP for the same (target epsilon, delta), and each meets it by its own count."""
    base = tiny(**SMALL)
    sigma = {}
    for acc in ("pld", "rdp"):
        cfg = budget_config(dataclasses.replace(base, accountant=acc), "dp-fedavg", 3.0)
        planned = with_planned_sigma(cfg, client_sizes(cfg))
        schedule = FedLAPSchedule(batch_size=cfg.batch_size, client_size=min(client_sizes(cfg)),
                                  local_steps=cfg.accesses_per_round)
        spent = epsilon(schedule, planned.sigma, cfg.rounds, cfg.delta, accountant=acc)
        assert 3.0 - BELOW < spent <= 3.0
        sigma[acc] = planned.sigma
    assert sigma["pld"] < 0.97 * sigma["rdp"]


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
    assert saved["rounds"] == 2 and saved["round_counts"] == [2]
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
            # planned and reported with PLD; RDP's figure of the same run is above the target
            assert r["accountant"] == "pld" and r["epsilon_by_accountant"]["pld"] == r["epsilon"]
            assert r["epsilon_by_accountant"]["rdp"] > float(target)
        assert cell["mean_by_round"][-1] == pytest.approx(cell["mean"])
        assert cell["std"] == pytest.approx(abs(accs[0] - accs[1]) / 2)
        # one round count: one by_rounds record, the cell's own numbers
        [point] = cell["by_rounds"]
        assert point["rounds"] == 2 and point["seeds"] == [0, 1]
        assert (point["mean"], point["std"]) == (cell["mean"], cell["std"])
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
        return [(run.test_accuracy, run.epsilon)
                for cell in r.methods["dp-fedavg"].results.values() for run in cell.runs]

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


def test_each_round_count_is_planned_for_its_own_budget():
    base = tiny(**SMALL)
    jobs = plan_jobs(base, [3.0], ["dp-fedavg", "ali-dpfl", "ldp-fl", "fedavg"], 1, [3, 1, 3])
    by = {(j.method, j.rounds): j for j in jobs}
    assert len(jobs) == len(by) == 8  # duplicates dropped: counts 1 and 3, one job each
    assert [(j.method, j.rounds) for j in jobs][:2] == [("dp-fedavg", 1), ("dp-fedavg", 3)]
    for (method, r), job in by.items():
        assert job.config.rounds == r and job.seed == base.seed
        assert job.eps == (None if method == "fedavg" else 3.0)
    # record level: sigma planned by the driver for R rounds; fewer rounds, less noise
    sigma = {r: with_planned_sigma(by["dp-fedavg", r].config,
                                   client_sizes(by["dp-fedavg", r].config)).sigma
             for r in (1, 3)}
    assert by["dp-fedavg", 1].config.sigma is None and by["dp-fedavg", 1].config.target_eps == 3
    assert 0 < sigma[1] < sigma[3]
    # ALI-DPFL: DP-FedAvg's sigma for the same R; LDP-FL: target / R per weight per round
    assert by["ali-dpfl", 1].config.sigma == pytest.approx(sigma[1])
    assert by["ali-dpfl", 3].config.sigma == pytest.approx(sigma[3])
    assert by["ldp-fl", 1].config.ldp_epsilon == pytest.approx(3.0)
    assert by["ldp-fl", 3].config.ldp_epsilon == pytest.approx(1.0)
    # no counts: base.rounds alone, as before
    assert {j.rounds for j in plan_jobs(base, [3.0], ["dp-fedavg"])} == {base.rounds}
    for bad in ([], [0], [1, -3], [2.5], [True]):
        with pytest.raises(ConfigError, match="round counts"):
            plan_jobs(base, [3.0], ["dp-fedavg"], 1, bad)


def test_comparison_tables_final_accuracy_per_round_count(tmp_path):
    base = tiny(**SMALL)
    report = run_comparison(base, [3.0], ["dp-fedavg", "fedavg"], 2, tmp_path, "cpu",
                            rounds=[3, 1])
    saved = json.loads((tmp_path / COMPARISON).read_text())
    assert saved["round_counts"] == [1, 3]
    assert saved["rounds"] == saved["configs"]["dp-fedavg"]["rounds"] == 3
    cell = saved["methods"]["dp-fedavg"]["results"]["3"]
    runs = {(r["rounds"], r["seed"]): r for r in cell["runs"]}
    assert sorted(runs) == [(1, 0), (1, 1), (3, 0), (3, 1)]
    for (r, seed), run in runs.items():
        # every run spends its target after its own number of rounds
        assert run["rounds_run"] == len(run["accuracy_by_round"]) == r
        assert 3.0 - BELOW < run["epsilon"] <= 3.0 + 1e-9
        assert run["epsilon_by_round"][-1] == pytest.approx(run["epsilon"])
        assert run["out"].endswith(f"dp-fedavg-eps3-rounds{r}-seed{seed}")
    for seed in (0, 1):  # one round at epsilon 3 needs less noise than three
        assert runs[1, seed]["sigma"] < runs[3, seed]["sigma"]
    assert [p["rounds"] for p in cell["by_rounds"]] == [1, 3]
    for point in cell["by_rounds"]:
        mine = [runs[point["rounds"], seed] for seed in (0, 1)]
        accs = [m["test_accuracy"] for m in mine]
        assert point["seeds"] == [0, 1]
        assert point["mean"] == pytest.approx(sum(accs) / 2)
        assert point["std"] == pytest.approx(abs(accs[0] - accs[1]) / 2)
        assert point["epsilon_mean"] == pytest.approx(sum(m["epsilon"] for m in mine) / 2)
        assert 3.0 - BELOW < point["epsilon_mean"] <= 3.0 + 1e-9
        assert point["sigma_mean"] == pytest.approx(sum(m["sigma"] for m in mine) / 2)
        assert point["mean_by_round"][-1] == pytest.approx(point["mean"])
        assert len(point["mean_by_round"]) == point["rounds"]
    # the cell's own mean / std are those of the largest count (report["rounds"])
    largest = cell["by_rounds"][1]
    assert (cell["mean"], cell["std"]) == (largest["mean"], largest["std"])
    # non-private: one run per seed and count, no epsilon
    plain = saved["methods"]["fedavg"]["results"]["non-private"]
    assert sorted((r["rounds"], r["seed"]) for r in plain["runs"]) == sorted(runs)
    assert [(p["rounds"], p["epsilon_mean"], p["sigma_mean"]) for p in plain["by_rounds"]] == [
        (1, None, None), (3, None, None)]
    # run folders carry the count (several counts), so no count's run overwrites another's
    assert not (tmp_path / "runs" / "dp-fedavg-eps3-seed0").exists()
    assert (tmp_path / "accuracy_vs_rounds.png").stat().st_size > 0
    assert report.round_counts == [1, 3] and report.to_json() == saved
    # resumed, not trained again
    ckpt = tmp_path / "runs" / "dp-fedavg-eps3-rounds1-seed0" / CHECKPOINT
    stamp = ckpt.stat().st_mtime_ns
    again = run_comparison(base, [3.0], ["dp-fedavg", "fedavg"], 2, tmp_path, "cpu",
                           rounds=[1, 3])
    assert ckpt.stat().st_mtime_ns == stamp
    assert again.to_json()["methods"]["dp-fedavg"]["results"]["3"]["by_rounds"] == cell["by_rounds"]


def test_methods_share_one_secret_split_which_a_resumed_comparison_keeps(tmp_path):
    """Issue 33 item 5: the split is drawn from a secret split seed, not from the seed the
    released weights reveal; within one comparison every run holds the same records (and
    the same validation hold-out), also after a resume, and the secret is never reported."""
    from fedlap_privacy.state.checkpoint import PRIVATE
    from fedlap_privacy.state.run_state import PrivateRunState

    base = tiny(**SMALL, rounds=1, split="iid", validation_records=60)
    methods = ["fedavg", "fedprox"]
    report = run_comparison(base, [3.0], methods, 2, tmp_path, "cpu")
    states = [PrivateRunState.load(p) for p in sorted(tmp_path.glob(f"runs/*/{PRIVATE}"))]
    assert len(states) == 4 and len({s.split_seed for s in states}) == 1
    secret = states[0].split_seed
    assert len({tuple(map(tuple, (i.tolist() for i in s.client_indices))) for s in states}) == 1
    assert all(r.validation_accuracy is not None
               for row in report.methods.values() for cell in row.results.values()
               for r in cell.runs)
    assert str(secret) not in (tmp_path / COMPARISON).read_text()
    assert comparison_split_seed(base, tmp_path) == secret  # a resume keeps the split
    assert comparison_split_seed(base, tmp_path / "elsewhere") != secret  # a fresh secret
    assert comparison_split_seed(dataclasses.replace(base, split_seed=5), tmp_path) == 5
    # a run on another split in the same folder is refused, not mixed in silently
    other = tmp_path / "runs" / "fedavg-nodp-seed9"
    train(dataclasses.replace(base, method="fedavg"), other, "cpu")
    with pytest.raises(ConfigError, match="different splits"):
        run_comparison(base, [3.0], methods, 2, tmp_path, "cpu")
