"""``--dry-run`` on train, compare and audit: the plan is the run's own (sigma, epsilon, data),
nothing is written, bad input is one line and exit 2, the timing reads no record."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner
from user_records import blobs, tabular_folder

from fedlap_privacy.cli.main import app
from fedlap_privacy.data.datasets import Dataset

TINY = ["--set", "width=4", "--set", "local_steps=1"]


def _invoke(args: list[str]):
    return CliRunner().invoke(app, args, env={"COLUMNS": "200"})


@pytest.fixture
def constant_timing(monkeypatch):
    """A fixed round timing (the real one is tested below, on one method)."""
    from fedlap_privacy.fl.engine import dry_run

    monkeypatch.setattr(dry_run, "time_steps",
                        lambda cfg, data, device: dry_run.RoundTiming(1, 2, 0.5, 1, 0, "cpu"))


def test_train_dry_run_plans_sigma_for_the_target_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    ok = _invoke(["train", "--method", "dp-fedavg", "--target-eps", "3", "--rounds", "2", *TINY,
                  "--out", str(out), "--dry-run", "--json"])
    assert ok.exit_code == 0, ok.output
    plan = json.loads(ok.output)
    run = plan["run"]
    assert run["sigma_planned"] and run["rounds_run"] == 2 and run["stop"] is None
    assert 2.99 < run["privacy"]["epsilon"] <= 3.0 + 1e-9  # spends the target, no more
    assert run["privacy"]["threat_model"] == "server"
    assert plan["data"]["client_sizes"] and sum(plan["data"]["client_sizes"]) == 1438
    assert run["seconds"] > 0
    assert not out.exists()


def test_train_dry_run_says_where_a_target_stops_a_run(tmp_path, constant_timing):
    ok = _invoke(["train", "--method", "dp-fedavg", "--sigma", "1", "--target-eps", "2",
                  "--rounds", "20", *TINY, "--out", str(tmp_path / "r"), "--dry-run"])
    assert ok.exit_code == 0, ok.output
    assert "stops after" in ok.output and "target epsilon 2 would be exceeded" in ok.output


def test_train_dry_run_refuses_what_train_refuses(tmp_path, constant_timing):
    (tmp_path / "ckpt.pt").write_bytes(b"")
    bad = _invoke(["train", "--out", str(tmp_path), "--dry-run"])
    assert bad.exit_code == 2 and "already holds a run" in bad.output
    bad = _invoke(["train", "--set", "clip=0", "--out", str(tmp_path / "x"), "--dry-run"])
    assert bad.exit_code == 2 and len(bad.output.strip().splitlines()[-1:]) == 1
    assert "Traceback" not in bad.output and not (tmp_path / "x").exists()


def test_a_dry_run_reports_every_problem_and_plans_the_download_it_would_make(
        tmp_path, constant_timing):
    """A folder holding a run and files not yet downloaded: both said, the plan made on the
    dataset's standard sizes, exit 2; with --download and a new --out the same command plans
    the download (files, size, host) and passes; nothing is written or fetched."""
    held = tmp_path / "held"
    held.mkdir()
    (held / "ckpt.pt").write_bytes(b"")
    data_dir = tmp_path / "data"
    args = ["train", "--method", "dp-fedavg", "--dataset", "fashion-mnist", "--data-dir",
            str(data_dir), "--target-eps", "3", "--rounds", "2", "--dry-run"]
    bad = _invoke([*args, "--out", str(held)])
    assert bad.exit_code == 2, bad.output
    assert "already holds a run" in bad.output and "fetch it with --download" in bad.output
    assert "about 31 MB" in bad.output and "60,000 training" in bad.output
    assert "Traceback" not in bad.output
    ok = _invoke([*args, "--out", str(tmp_path / "new"), "--download"])
    assert ok.exit_code == 0, ok.output
    assert "would fetch 4 files, 30.9 MB" in ok.output and "amazonaws.com" in ok.output
    assert "fetch it with --download" not in ok.output
    plan = json.loads(_invoke([*args, "--out", str(tmp_path / "new"), "--download",
                               "--json"]).output)
    assert [d["bytes"] for d in plan["downloads"]] == [26_421_880, 29_515, 4_422_102, 5_148]
    assert plan["problems"] == [] and sum(plan["data"]["client_sizes"]) <= 60_000
    assert 2.99 < plan["run"]["privacy"]["epsilon"] <= 3.0 + 1e-9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held"]


def test_a_dry_run_flags_an_epsilon_far_above_the_usual_range(tmp_path, constant_timing):
    """getting-started's first check: the paper's preset on digits' small clients plans an
    epsilon in the thousands; the dry run says so, why, and what to change."""
    out = _invoke(["train", "--preset", "paper-dp", "--out", str(tmp_path / "r"),
                   "--dry-run"]).output
    text = " ".join(out.split())
    assert "above the usual range" in text and "few records per client" in text
    assert "--sigma" in text and "--target-eps" in text and "fewer --rounds" in text
    plan = json.loads(_invoke(["train", "--preset", "paper-dp", "--out", str(tmp_path / "r"),
                               "--dry-run", "--json"]).output)
    assert plan["run"]["privacy"]["epsilon"] > 1000 and len(plan["warnings"]) == 1
    usual = json.loads(_invoke(["train", "--method", "dp-fedavg", "--target-eps", "3",
                                "--rounds", "2", *TINY, "--out", str(tmp_path / "r"),
                                "--dry-run", "--json"]).output)
    assert usual["warnings"] == []


def test_resume_dry_run_continues_the_ledger(tmp_path, constant_timing):
    out = tmp_path / "run"
    ran = _invoke(["train", "--method", "dp-fedavg", "--sigma", "2", "--rounds", "1", *TINY,
                   "--out", str(out)])
    assert ran.exit_code == 0, ran.output
    before = sorted(p.name for p in out.iterdir())
    ok = _invoke(["train", "--out", str(out), "--resume", "--rounds", "3", "--dry-run",
                  "--json"])
    assert ok.exit_code == 0, ok.output
    run = json.loads(ok.output)["run"]
    assert run["start_round"] == 2 and run["rounds_run"] == 2
    one_round = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["epsilon"]
    assert run["privacy"]["epsilon"] > one_round  # three rounds spend more than one
    assert sorted(p.name for p in out.iterdir()) == before


def test_compare_dry_run_plans_every_method(tmp_path, constant_timing):
    from fedlap_privacy.fl.config_rules import METHODS

    ok = _invoke(["compare", "--eps", "3", "--rounds", "1", *TINY, "--set", "max_loops=1",
                  "--set", "real_batches=1", "--set", "server_epochs=1", "--out",
                  str(tmp_path / "cmp"), "--dry-run", "--json"])
    assert ok.exit_code == 0, ok.output
    plan = json.loads(ok.output)
    runs = {r["method"]: r for r in plan["runs"]}
    assert list(runs) == list(METHODS)
    assert runs["ali-dpfl"]["privacy"]["sigma"] == runs["dp-fedavg"]["privacy"]["sigma"]
    assert 2.99 < runs["dp-fedavg"]["privacy"]["epsilon"] <= 3.0 + 1e-9
    assert runs["fedavg"]["privacy"]["epsilon"] is None
    # 10 private runs and 5 non-private ones of 1 round: 5 clients x (2 + 0.5 T) + 1 + setup 1
    expected = sum(2 + 5 * (2 + 0.5 * r["accesses_per_round"]) for r in plan["runs"])
    assert plan["seconds"] == pytest.approx(expected)
    assert not (tmp_path / "cmp").exists()


def test_the_timing_reads_shapes_and_sizes_only():
    """time_steps gets a dataset whose images cannot be read: it times random ones."""
    from fedlap_privacy.fl.config import TrainConfig
    from fedlap_privacy.fl.engine.dry_run import time_steps

    class Unreadable:
        shape = (300, 1, 8, 8)

        def __array__(self, *args, **kwargs):
            raise AssertionError("the timing read a private record")

    y = np.zeros(300, dtype=np.int64)
    data = Dataset("digits", Unreadable(), y, Unreadable(), y[:50], 10, (0.3,), (0.4,))  # type: ignore[arg-type]
    cfg = TrainConfig(method="dp-fedavg", width=4, local_steps=3, clients=2, split="iid",
                      batch_size=16)
    timing = time_steps(cfg, data, "cpu")
    assert (timing.cohort, timing.mode) == (2, "loop")  # both clients, one by one
    assert timing.steps == 2 * 5
    assert timing.fixed >= 0 and timing.per_access >= 0 and timing.server > 0
    assert timing.per_access > 0 or timing.fixed > 0
    assert timing.seconds(cfg, 10, 3) > timing.seconds(cfg, 1, 3)


def test_a_thousand_client_dry_run_times_a_few_steps_not_rounds(tmp_path, mini_mnist):
    """Issue 45: the dry run of a 1,000-client dp-fedavg-client command times a few client
    steps of a cohort (as many for 1,000 clients as for 50) and says it is an estimate."""
    from fedlap_privacy.fl.engine.dry_run import TIMED_ACCESSES, TIMED_COHORT

    folder = mini_mnist(n_train=2000, n_test=100)
    args = ["train", "--method", "dp-fedavg-client", "--dataset", "mnist", "--data-dir",
            str(folder), "--clients", "1000", "--split", "shards", "--client-fraction", "0.05",
            "--target-eps", "2", "--rounds", "30", "--out", str(tmp_path / "r"), "--dry-run"]
    planned = _invoke([*args, "--json"])
    assert planned.exit_code == 0, planned.output
    run = json.loads(planned.stdout)["run"]
    timing = run["timing"]
    # 16 of the 50 expected clients, packed: a warm-up, then 1 and 3 steps each
    assert (timing["cohort"], timing["mode"]) == (TIMED_COHORT, "packed")
    assert timing["steps"] == TIMED_COHORT * (2 * TIMED_ACCESSES[0] + TIMED_ACCESSES[1]) == 80
    assert run["config"]["width"] == 32 and run["rounds_run"] == 30
    # the run's time: set-up, then 30 rounds of 50 clients x 10 local steps and the server
    per_client = timing["fixed"] + timing["per_access"] * run["config"]["local_steps"]
    assert run["seconds"] == pytest.approx(
        timing["setup"] + 30 * (50 * per_client + timing["server"]), rel=1e-6)
    shown = _invoke(args)
    assert shown.exit_code == 0, shown.output
    assert "an estimate from 80 client steps of 16 clients" in " ".join(shown.output.split())
    assert not (tmp_path / "r").exists()


def test_external_audit_dry_run_checks_headers_and_never_runs_the_factory(tmp_path):
    (tmp_path / "w.pt").write_bytes(b"x")
    (tmp_path / "net.py").write_text("raise SystemExit('imported')\ndef build():\n    pass\n")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "m.npz", x=rng.standard_normal((10, 1, 8, 8)), y=np.arange(10) % 3)
    np.savez(tmp_path / "n.npz", x=rng.standard_normal((8, 1, 8, 8)), y=np.arange(8) % 3)
    common = ["audit", "--model", str(tmp_path / "w.pt"), "--members", str(tmp_path / "m.npz"),
              "--dry-run", "--json"]
    ok = _invoke([*common, "--nonmembers", str(tmp_path / "n.npz"), "--model-factory",
                  f"{tmp_path / 'net.py'}:build", "--claimed-eps", "2"])
    assert ok.exit_code == 0, ok.output
    plan = json.loads(ok.output)
    assert plan["per_half"] == 4 and plan["claim"]["epsilon_tested"] == 2
    np.savez(tmp_path / "bad.npz", x=rng.standard_normal((8, 1, 8, 8)))
    for extra, word in ((["--nonmembers", str(tmp_path / "bad.npz")], "'y'"),
                        (["--nonmembers", str(tmp_path / "n.npz"), "--model-factory",
                          f"{tmp_path / 'net.py'}:other"], "defines no other")):
        bad = _invoke([*common, *extra])
        assert bad.exit_code == 2 and word in bad.output and "Traceback" not in bad.output


@pytest.mark.parametrize("args", [["--attacks", "nope"], ["--max-per-half", "0"]])
def test_audit_dry_run_bad_flags_are_one_line(tmp_path, args):
    bad = _invoke(["audit", "--model", str(tmp_path / "missing.pt"), "--dry-run", *args])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert len(bad.output.strip().splitlines()) == 1


def test_flower_dry_run_on_user_data(tmp_path, constant_timing):
    """train --dry-run --engine flower --data: the run the Flower engine would start on a
    user's natural partition (its clients, hence SuperNodes, from the files), nothing
    written; bad records are one line, as the real run refuses them."""
    data = tabular_folder(tmp_path / "d")
    out = tmp_path / "run"
    ok = _invoke(["train", "--engine", "flower", "--data", str(data), "--method", "dp-fedavg",
                  "--target-eps", "3", "--rounds", "2", "--out", str(out), "--dry-run", "--json"])
    assert ok.exit_code == 0, ok.output
    plan = json.loads(ok.output)
    assert plan["data"]["dataset"] == "custom" and plan["data"]["client_sizes"] == [90, 80, 70]
    assert plan["run"]["config"]["clients"] == 3
    assert 2.99 < plan["run"]["privacy"]["epsilon"] <= 3.0 + 1e-9
    assert not out.exists()
    x, y = blobs(10, 0)
    np.savez(data / "site2.npz", x=x[:, :4], y=y)
    bad = _invoke(["train", "--engine", "flower", "--data", str(data), "--out", str(out),
                   "--dry-run"])
    assert bad.exit_code == 2 and "4 features" in bad.output and "Traceback" not in bad.output
    assert not out.exists()


def test_the_files_a_download_would_fetch_and_the_stand_in_sizes(tmp_path):
    """Only the missing files are named (an MNIST folder holding two of its four, raw or
    gzipped), CIFAR-10's one archive; the stand-in has each dataset's published sizes."""
    from fedlap_privacy.data.dataset_files import SIZES, missing_downloads
    from fedlap_privacy.data.datasets import TRAIN_RECORDS, standard_stand_in

    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"")
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"")
    assert [d.target.name for d in missing_downloads("mnist", tmp_path)] == [
        "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz"]
    (cifar,) = missing_downloads("cifar10", tmp_path)
    assert cifar.url.startswith("https://www.cs.toronto.edu/") and cifar.size > 170e6
    assert set(SIZES) == set(TRAIN_RECORDS) - {"digits"}
    for name in SIZES:
        data = standard_stand_in(name)
        assert len(data.y_train) == TRAIN_RECORDS[name] and len(data.y_test) == 10_000
        assert data.x_train.shape[0] == len(data.y_train) and not data.x_train.any()
