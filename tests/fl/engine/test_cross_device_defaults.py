"""Defaults by scale (issue 45, item 1): a cross-device run (many clients of few records
each) gets the small CNN and the cross-device schedule without flags, says so, and a user's
keys win; FedLAP-DP keeps its ConvNet; the run's epsilon is dp-accounting's for the
schedule. And the Python API plans sigma for a target as the CLI does (item 6)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fedlap_privacy.cli.main import app
from fedlap_privacy.fl.config import DEFAULT_SIGMA, TrainConfig
from fedlap_privacy.fl.config_resolve import cross_device_defaults, resolve_config
from fedlap_privacy.fl.methods.schedule import (
    CROSS_DEVICE,
    CROSS_DEVICE_MAX_RECORDS,
    CROSS_DEVICE_MIN_CLIENTS,
)

#: the README's cross-device command (issue 45), as configuration keys
README_RUN = dict(method="dp-fedavg-client", dataset="fashion-mnist", clients=3000,
                  split="dirichlet", client_fraction=1 / 30, target_eps=2.0, rounds=30)


def test_the_readme_command_gets_the_small_cnn_and_the_cross_device_schedule() -> None:
    cfg = resolve_config(None, README_RUN)
    assert (cfg.width, cfg.depth, cfg.batch_size, cfg.local_steps, cfg.lr_local) == (
        32, 2, 10, 10, 0.1)
    assert {k: getattr(cfg, k) for k in CROSS_DEVICE} == CROSS_DEVICE
    chosen = cross_device_defaults(cfg.to_dict())
    assert chosen is not None and (chosen.clients, chosen.records) == (3000, 20)
    line = chosen.describe(cfg)
    assert "3,000 clients of 20 records" in line and "width 32, depth 2" in line


def test_what_a_user_gives_wins_over_the_cross_device_defaults() -> None:
    cfg = resolve_config(None, {**README_RUN, "batch_size": 20}, ["width=128", "depth=3"])
    assert (cfg.width, cfg.depth, cfg.batch_size, cfg.lr_local) == (128, 3, 20, 0.1)
    line = cross_device_defaults(cfg.to_dict()).describe(cfg)  # type: ignore[union-attr]
    assert "width 128, depth 3; B 20" in line  # the line says this run's values


@pytest.mark.parametrize(("keys", "cross"), [
    (dict(clients=CROSS_DEVICE_MIN_CLIENTS), True),  # FashionMNIST: 60 records each
    (dict(clients=CROSS_DEVICE_MIN_CLIENTS - 1), False),  # too few clients
    # 1,000 clients of 100 records each (a dataset of 100,000 below): not "few records"
    (dict(clients=1000, dataset="mnist"), False),
    (dict(clients=1000, dataset="mnist", client_records=CROSS_DEVICE_MAX_RECORDS - 1), True),
    (dict(clients=3000, method="fedlap-dp"), False),  # FedLAP-DP keeps its ConvNet
    (dict(clients=3000, method="fedavg"), True),
])
def test_the_rule(keys: dict, cross: bool, monkeypatch) -> None:
    from fedlap_privacy.data.datasets import TRAIN_RECORDS

    monkeypatch.setitem(TRAIN_RECORDS, "mnist", 1000 * CROSS_DEVICE_MAX_RECORDS)
    values = {"method": "dp-fedavg-client", "dataset": "fashion-mnist", "split": "shards",
              **keys}
    cfg = resolve_config(None, values)
    assert (cross_device_defaults(cfg.to_dict()) is not None) == cross
    assert (cfg.width, cfg.depth) == ((32, 2) if cross else (None, None))


def test_the_model_keys_stay_away_from_a_users_model() -> None:
    cfg = resolve_config(None, {**README_RUN, "model": "torchvision.models:resnet18"})
    assert (cfg.width, cfg.depth, cfg.batch_size) == (None, None, 10)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_the_planned_epsilon_is_dp_accountings_for_the_schedule(accountant: str) -> None:
    """The dry run's plan of the README command (sigma planned for epsilon 2, 30 rounds
    Poisson at 1/30) against dp-accounting composing the same sampled Gaussian."""
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    from fedlap_privacy.accountant import DEFAULT_ORDERS
    from fedlap_privacy.fl.engine.dry_run import plan_run

    cfg = resolve_config(None, {**README_RUN, "accountant": accountant})
    plan = plan_run(cfg, [20] * 3000, None)
    sigma = plan.config.sigma
    assert plan.sigma_planned and plan.rounds_run == 30 and sigma is not None
    event = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(1 / 30, dpa.GaussianDpEvent(sigma)), 30)
    if accountant == "pld":
        theirs = PLDAccountant().compose(event).get_epsilon(cfg.delta)
        assert plan.privacy.epsilon == pytest.approx(float(theirs), rel=2e-3)
        assert 1.99 < plan.privacy.epsilon <= 2.0 + 1e-9  # the target, spent
    else:
        theirs = RdpAccountant(orders=list(DEFAULT_ORDERS)).compose(event).get_epsilon(
            cfg.delta)
        assert plan.privacy.epsilon == pytest.approx(float(theirs), rel=1e-3)


def test_train_says_the_cross_device_defaults(tmp_path) -> None:
    """The line train prints and the dry run's JSON (digits: 1,000 clients of 1 record)."""
    args = ["train", "--method", "dp-fedavg-client", "--split", "iid", "--clients", "1000",
            "--client-fraction", "1/100", "--rounds", "1", "--out", str(tmp_path / "r"),
            "--dry-run"]
    shown = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert shown.exit_code == 0, shown.output
    assert "Cross-device defaults: 1,000 clients of 1 records" in shown.output
    planned = CliRunner().invoke(app, [*args, "--json"])
    run = json.loads(planned.stdout)["run"]
    assert run["defaults"].startswith("Cross-device defaults")
    assert (run["config"]["batch_size"], run["config"]["lr_local"]) == (10, 0.1)
    assert run["config"]["client_fraction"] == 0.01  # a fraction as the README writes it
    bad = CliRunner().invoke(app, [*args[:-7], "--client-fraction", "1/zero", "--dry-run"],
                             env={"COLUMNS": "300"})
    assert bad.exit_code == 2 and "'1/zero' is not a number" in bad.output


# ------------------------------------------------------------------- the Python API (item 6)


def test_a_target_without_sigma_plans_sigma_in_python_as_in_the_cli() -> None:
    python = TrainConfig(method="dp-fedavg", target_eps=3, rounds=10)
    cli = resolve_config(None, {"method": "dp-fedavg", "target_eps": 3.0, "rounds": 10})
    assert python.sigma is None and cli.sigma is None  # planned by the driver, both ways
    assert TrainConfig(method="dp-fedavg", rounds=10).sigma == DEFAULT_SIGMA
    assert type(TrainConfig().sigma) is float  # the marker never stays in a configuration


def test_a_target_with_sigma_keeps_sigma_in_python_as_in_the_cli() -> None:
    """Both given: the target is a budget the run stops before exceeding (one rule)."""
    python = TrainConfig(method="dp-fedavg", target_eps=3, sigma=DEFAULT_SIGMA)
    cli = resolve_config(None, {"method": "dp-fedavg", "target_eps": 3.0, "sigma": 1.5})
    assert python.sigma == cli.sigma == DEFAULT_SIGMA
    ali = TrainConfig(method="ali-dpfl", target_eps=3)  # ALI-DPFL keeps a fixed sigma
    assert ali.sigma == resolve_config(None, {"method": "ali-dpfl", "target_eps": 3.0}).sigma
    assert ali.sigma == DEFAULT_SIGMA


def test_a_python_run_with_a_target_spends_it() -> None:
    from fedlap_privacy.fl.engine.simulation import train

    cfg = TrainConfig(method="dp-fedavg", target_eps=3, rounds=2, width=4, local_steps=1,
                      split_seed=0)
    result = train(cfg, None, "cpu")
    assert result.summary.sigma_planned and result.summary.rounds_run == 2
    assert 2.99 < result.summary.privacy.epsilon <= 3.0 + 1e-9
