"""FedLAP-DP's client schedule by client size (fl/methods/schedule.py).

The rule picks the authors' client schedule with their 4 re-initialisations spread over the
run (B 256, T = 200 in one round, 50 from three rounds on) and a tuned server rate when
clients hold at least 1,024 records on average, train's cheap defaults below; a key the user
sets always wins, the preset keeps the authors' values (T = 200, their server rate), no
other method gets the schedule's keys, and the decision needs no data (so compare and the
Flower run config carry explicit values).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner
from user_records import blobs, tabular_folder

from fedlap_privacy.cli.main import app
from fedlap_privacy.data.datasets import TRAIN_RECORDS, load_dataset
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import PRESETS, TrainConfig
from fedlap_privacy.fl.config_resolve import fedlap_schedule, resolve_config
from fedlap_privacy.fl.engine.compare import bases_by_rounds, method_bases, plan_jobs
from fedlap_privacy.fl.methods.schedule import (
    AUTHORS_DP,
    LARGE_MIN_RECORDS,
    SCHEDULES,
    large_reinits,
)

SMALL_T, LARGE_T, AUTHORS_T = 1 * 5 * 2, 1 * 5 * 10, 4 * 5 * 10


def test_digits_keeps_the_cheap_defaults():
    cfg = resolve_config(None, {}, [])
    assert cfg == TrainConfig().validate()
    assert (cfg.batch_size, cfg.accesses_per_round, cfg.lr_net) == (64, SMALL_T, 0.05)
    chosen = fedlap_schedule("auto", cfg.to_dict())
    assert chosen is not None and chosen.name == "small"
    assert chosen.records == TRAIN_RECORDS["digits"] // 5 == 287


def test_user_data_is_sized_from_its_files(tmp_path: Path):
    """--data: the rule reads the clients' sizes from the files' headers (less the held-out
    fifth without a test.npz) and the console line says what it chose, not "as asked"."""
    cases = [
        (tabular_folder(tmp_path / "t"), {}, "small", 80),  # (90 + 80 + 70) / 3
        (tabular_folder(tmp_path / "h", test=0), {}, "small", 64),  # (72 + 64 + 56) / 3
        (tmp_path / "t" / "site0.npz", {"clients": 2}, "small", 36),  # 90 less 18, in 2
    ]
    x, y = blobs(3 * 1400, 1)
    np.savez(tmp_path / "big.npz", x=x, y=y, client=np.repeat(np.arange(3), 1400))
    cases.append((tmp_path / "big.npz", {}, "large", 1_120))  # 1,400 less 280 held out
    for data, flags, name, records in cases:
        cfg = resolve_config(None, {"data": str(data), "dataset": "custom", **flags}, [])
        chosen = fedlap_schedule("auto", cfg.to_dict())
        assert chosen is not None and (chosen.name, chosen.records) == (name, records)
        line = chosen.describe(cfg.batch_size, str(cfg.accesses_per_round))
        assert "as asked" not in line and f"hold {records:,} records on average" in line
        assert cfg.batch_size == (256 if name == "large" else 64)


def test_the_digits_size_is_the_loaders():
    assert len(load_dataset("digits").y_train) == TRAIN_RECORDS["digits"]


@pytest.mark.parametrize(("settings", "name", "records"), [
    ([], "large", 12_000),  # FashionMNIST's non-IID split: 2 classes x 6,000 per client
    (["client_records=1600"], "large", 1_600),
    ([f"client_records={LARGE_MIN_RECORDS}"], "large", 1_024),
    ([f"client_records={LARGE_MIN_RECORDS - 1}"], "small", 1_023),
    (["clients=58"], "large", 1_034),
    (["clients=59"], "small", 1_016),
    (["validation_records=54880"], "large", 1_024),
    (["validation_records=54885"], "small", 1_023),
])
def test_the_rule_follows_the_mean_client_size(settings, name, records):
    cfg = resolve_config(None, {"dataset": "fashion-mnist"}, settings)
    chosen = fedlap_schedule("auto", cfg.to_dict())
    assert chosen is not None and (chosen.name, chosen.records) == (name, records)
    expected = (256, LARGE_T, 0.002, 0.0) if name == "large" else (64, SMALL_T, 0.05, 0.5)
    assert (cfg.batch_size, cfg.accesses_per_round, cfg.lr_net, cfg.server_momentum) == expected


def test_keys_the_user_sets_win_over_the_schedule():
    cfg = resolve_config(None, {"dataset": "mnist", "batch_size": 128},
                         ["real_batches=1", "server_lr=2"])
    assert (cfg.batch_size, cfg.real_batches, cfg.server_lr) == (128, 1, 2.0)
    assert (cfg.reinits, cfg.lr_net, cfg.lr_schedule) == (1, 0.002, "cosine-open")


def test_a_named_schedule_overrides_the_rule():
    small = resolve_config(None, {"dataset": "cifar10"}, [], schedule="small")
    assert (small.batch_size, small.accesses_per_round) == (64, SMALL_T)
    large = resolve_config(None, {}, [], schedule="large")  # digits
    assert (large.batch_size, large.accesses_per_round) == (256, LARGE_T)
    with pytest.raises(ConfigError, match="schedule 'huge' must be one of auto, small, large"):
        resolve_config(None, {}, [], schedule="huge")


def test_the_preset_keeps_the_authors_values_and_wins():
    assert AUTHORS_DP.items() <= PRESETS["paper-dp"].items()
    # the large schedule is the authors' with the server's rate tuned (and reinits by rounds)
    differs = {k for k in AUTHORS_DP if SCHEDULES["large"][k] != AUTHORS_DP[k]}
    assert differs == {"server_lr", "lr_schedule"}
    for schedule in ("auto", "small", "large"):
        cfg = resolve_config("paper-dp", {"dataset": "fashion-mnist"}, [], schedule=schedule)
        assert (cfg.batch_size, cfg.accesses_per_round, cfg.rounds) == (256, AUTHORS_T, 30)
        assert (cfg.server_lr, cfg.lr_schedule) == (1.0, "cosine")
    tuned = resolve_config(None, {"dataset": "fashion-mnist"}, [])
    assert (tuned.accesses_per_round, tuned.server_lr, tuned.lr_schedule) == (
        LARGE_T, 10.0, "cosine-open")


def test_other_methods_never_get_the_schedule():
    cfg = resolve_config(None, {"dataset": "fashion-mnist", "method": "dp-fedavg"}, [])
    assert (cfg.batch_size, cfg.lr_net) == (64, 0.05)
    with pytest.raises(ConfigError, match="schedules are FedLAP-DP's, not dp-fedavg's"):
        resolve_config(None, {"method": "dp-fedavg"}, [], schedule="large")


def test_compare_gives_the_schedule_to_fedlap_dp_only():
    """One base per method: DP-FedAvg's cells keep B 64 beside FedLAP-DP's B 256."""
    flags = {"dataset": "fashion-mnist", "rounds": 1}
    bases = method_bases(flags, [], ["fedlap-dp", "dp-fedavg"])
    jobs = plan_jobs(bases, [3.0], ["fedlap-dp", "dp-fedavg"])
    sizes = {j.method: (j.config.batch_size, j.config.accesses_per_round) for j in jobs}
    assert sizes == {"fedlap-dp": (256, AUTHORS_T), "dp-fedavg": (64, 10)}  # one round
    with pytest.raises(ConfigError, match="--methods leaves out"):
        method_bases(flags, [], ["dp-fedavg"], "large")


@pytest.mark.parametrize(("rounds", "reinits"), [(1, 4), (2, 2), (3, 1), (4, 1), (30, 1)])
def test_the_large_schedule_spreads_the_authors_reinitialisations_over_the_run(rounds, reinits):
    """R_i = max(1, 4 // rounds): T = 200 in one round, 100 in two, 50 from three on."""
    assert large_reinits(rounds) == reinits
    cfg = resolve_config(None, {"dataset": "fashion-mnist", "rounds": rounds}, [])
    assert (cfg.reinits, cfg.accesses_per_round) == (reinits, reinits * 5 * 10)
    mine = resolve_config(None, {"dataset": "fashion-mnist", "rounds": rounds}, ["reinits=3"])
    assert mine.reinits == 3


def test_compare_resolves_the_schedule_for_each_round_count():
    """compare --rounds 1,2,10 gives each count the T that train --rounds R would use; a
    reinits the user sets wins in every count, and the other methods never change."""
    flags = {"dataset": "fashion-mnist", "rounds": 10}
    methods = ["fedlap-dp", "dp-fedavg"]
    for settings, expected in (([], {1: 200, 2: 100, 10: 50}),
                               (["reinits=2"], {1: 100, 2: 100, 10: 100})):
        by_rounds = bases_by_rounds(flags, settings, methods, "auto", [1, 2, 10])
        jobs = plan_jobs(by_rounds[10], [3.0], methods, 1, [1, 2, 10], by_rounds)
        got = {j.rounds: j.config.accesses_per_round for j in jobs if j.method == "fedlap-dp"}
        assert got == expected
        assert {j.config.local_steps for j in jobs if j.method == "dp-fedavg"} == {10}
        assert [(j.method, j.rounds) for j in jobs] == [
            (m, r) for m in methods for r in (1, 2, 10)]


def test_the_schedule_line_gives_t_per_round_count(capsys):
    from fedlap_privacy.cli.common import print_schedule

    cfgs = [resolve_config(None, {"dataset": "fashion-mnist", "rounds": r}, []) for r in (1, 3)]
    print_schedule("auto", *cfgs)
    print_schedule("auto", cfgs[1])
    printed = " ".join(capsys.readouterr().out.split())
    assert "B 256, T = 200 / 50 for 1 / 3 rounds" in printed
    assert "B 256, T = 50)" in printed


@pytest.mark.parametrize("args", [
    ["train", "--method", "dp-fedavg", "--schedule", "large"],
    ["train", "--schedule", "medium"],
    ["compare", "--methods", "dp-fedavg", "--schedule", "small"],
    ["compare", "--methods", "dp-fedavg", "--set", "method=fedlap-dp"],
])
def test_bad_schedule_requests_are_one_line(tmp_path, args):
    bad = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "out")])
    assert bad.exit_code == 2, bad.output
    assert "Traceback" not in bad.output
    assert not (tmp_path / "out").exists()


def test_files_smaller_than_the_standard_size_get_a_clear_hint(tmp_path, mini_mnist):
    """The rule reads no data: a miniature MNIST (200 records per client) gets the large
    schedule, whose B 256 does not fit; the error says what to do, and --schedule small runs."""
    data = mini_mnist(n_train=1000)
    args = ["train", "--dataset", "mnist", "--data-dir", str(data), "--rounds", "1",
            "--set", "width=8", "--json"]
    bad = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "large")])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert "batch size 256 is larger than the smallest client" in bad.output
    assert "--schedule small" in bad.output
    good = CliRunner().invoke(app, [*args, "--schedule", "small", "--out", str(tmp_path / "s")])
    assert good.exit_code == 0, good.output


def test_train_says_which_schedule_it_picked(tmp_path):
    fast = ["--set", "width=8", "--set", "max_loops=1", "--set", "server_epochs=1"]
    result = CliRunner().invoke(app, ["train", "--rounds", "1", "--batch-size", "32", *fast,
                                      "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    line = " ".join(result.output.split())
    assert ("FedLAP-DP schedule: small (train's defaults; this run: B 32, T = 2): clients hold "
            "287 records on average (< 1,024)") in line
