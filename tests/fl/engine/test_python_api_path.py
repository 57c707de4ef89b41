"""The Python API takes the CLI's path (issue 45, item 6): ``train(TrainConfig(...))`` decides
the keys a configuration was not given as ``fedlap-privacy train`` decides the flags a user
did not type (FedLAP-DP's schedule, the cross-device defaults, a planned sigma), through the
one resolution (``resolve_given`` -> ``resolve_config``'s layers); the keys given win, a
resolved or recorded configuration passes unchanged, and a resumed run keeps its record."""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from fedlap_privacy.cli.main import app
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl import TrainConfig, resolve_given
from fedlap_privacy.fl.config_resolve import (
    cross_device_defaults,
    fedlap_schedule,
    resolve_config,
)
from fedlap_privacy.fl.methods.schedule import CROSS_DEVICE

#: the README's cross-device command (issue 45), as flags and as configuration keys
CROSS_FLAGS = ["--method", "dp-fedavg-client", "--dataset", "fashion-mnist", "--clients", "3000",
               "--split", "dirichlet", "--client-fraction", "1/30", "--target-eps", "2",
               "--rounds", "30"]
CROSS_KEYS = dict(method="dp-fedavg-client", dataset="fashion-mnist", clients=3000,
                  split="dirichlet", client_fraction=1 / 30, target_eps=2.0, rounds=30)


class _Started(Exception):
    """Raised by the stand-in run: the configuration a run would have started with."""

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__("started")
        self.cfg = cfg


@pytest.fixture
def started(monkeypatch):
    """The configuration the driver receives, through the CLI or the Python API: the run
    is stopped where it would read data (nothing is trained, no dataset is needed)."""
    from fedlap_privacy.fl.engine import simulation

    def stand_in(cfg: TrainConfig, *args, **kwargs):
        raise _Started(cfg)

    monkeypatch.setattr(simulation, "TrainingRun", stand_in)

    def cli(flags: list[str], out) -> tuple[TrainConfig, str]:
        shown = CliRunner().invoke(app, ["train", *flags, "--out", str(out)],
                                   env={"COLUMNS": "300"})
        assert isinstance(shown.exception, _Started), shown.output
        return shown.exception.cfg, shown.output

    def python(cfg: TrainConfig, **kwargs) -> TrainConfig:
        with pytest.raises(_Started) as caught:
            simulation.train(cfg, None, "cpu", **kwargs)
        return caught.value.cfg

    return cli, python


@pytest.mark.parametrize(("flags", "keys", "kind"), [
    (CROSS_FLAGS, CROSS_KEYS, "cross-device"),
    # FedLAP-DP's auto schedule: 12,000 records per client pick the large one
    (["--dataset", "fashion-mnist", "--rounds", "3"], dict(dataset="fashion-mnist", rounds=3),
     "schedule"),
    (["--method", "dp-fedavg", "--target-eps", "3", "--rounds", "10"],
     dict(method="dp-fedavg", target_eps=3, rounds=10), "plain"),
])
def test_the_cli_and_the_python_api_start_the_same_run(started, tmp_path, flags, keys, kind):
    cli, python = started
    from_cli, output = cli(flags, tmp_path / "cli")
    from_python = python(TrainConfig(**keys))
    assert from_python.to_dict() == from_cli.to_dict()
    if kind == "cross-device":  # the small CNN and the cross-device schedule, said
        assert {k: getattr(from_python, k) for k in CROSS_DEVICE} == CROSS_DEVICE
        assert (from_python.width, from_python.depth, from_python.batch_size) == (32, 2, 10)
        line = cross_device_defaults(from_python.to_dict()).describe(from_python)  # type: ignore[union-attr]
        assert line in output  # the CLI's schedule line is the Python run's
    elif kind == "schedule":
        chosen = fedlap_schedule("auto", from_python.to_dict())
        assert chosen is not None and chosen.name == "large"
        assert (from_python.batch_size, from_python.lr_schedule) == (256, "cosine-open")
        line = chosen.describe(from_python.batch_size, str(from_python.accesses_per_round))
        assert line in output
    else:  # nothing by scale: the defaults, and sigma left to the plan for the target
        assert from_python.sigma is None and from_python.batch_size == 64
        assert from_python.width is None
    assert from_python.to_dict() == resolve_config(None, keys).to_dict()


def test_a_named_schedule_takes_the_same_path(started, tmp_path):
    cli, python = started
    from_cli, _ = cli(["--dataset", "fashion-mnist", "--rounds", "3", "--schedule", "small"],
                      tmp_path / "cli")
    from_python = python(TrainConfig(dataset="fashion-mnist", rounds=3), schedule="small")
    assert from_python == from_cli and from_python.batch_size == 64
    with pytest.raises(ConfigError, match="schedules are FedLAP-DP's"):
        python(TrainConfig(method="fedavg"), schedule="large")


def test_keys_the_user_gave_win_even_at_their_default_value():
    """width=128 stays on a cross-device run; so does batch_size=64, the default's value
    (a comparison with the defaults could not tell it was given); and a key assigned after
    construction counts as given."""
    cfg = resolve_given(TrainConfig(**CROSS_KEYS, width=128, batch_size=64))
    assert (cfg.width, cfg.depth, cfg.batch_size, cfg.local_steps) == (128, 2, 64, 10)
    assigned = TrainConfig(**CROSS_KEYS)
    assigned.local_steps = 10  # the default's value, set by hand
    assigned.lr_local = 0.5
    cfg = resolve_given(assigned)
    assert (cfg.batch_size, cfg.local_steps, cfg.lr_local) == (10, 10, 0.5)
    # the FedLAP-DP schedule fills only the keys not given
    large = resolve_given(TrainConfig(dataset="fashion-mnist", rounds=3, batch_size=64))
    assert (large.batch_size, large.real_batches, large.lr_net) == (64, 10, 0.002)
    # an explicit sigma with a target: a budget, as --sigma with --target-eps
    assert resolve_given(TrainConfig(method="dp-fedavg", target_eps=3, sigma=1.5)).sigma == 1.5


def test_the_resolution_is_idempotent_and_leaves_resolved_configurations_alone():
    once = resolve_given(TrainConfig(**CROSS_KEYS))
    assert once.given == frozenset(f.name for f in dataclasses.fields(TrainConfig))
    assert resolve_given(once) is once  # every key decided: nothing left to decide
    cli = resolve_config(None, CROSS_KEYS)
    assert resolve_given(cli) is cli and cli == once
    # a recorded configuration (every key given) is taken as recorded, even one the rules
    # would now size otherwise: a cross-device run recorded with B 64
    recorded = TrainConfig.from_recorded({**once.to_dict(), "batch_size": 64})
    assert resolve_given(recorded).batch_size == 64
    # dataclasses.replace passes every key: a copy so made is fully given
    assert dataclasses.replace(TrainConfig(**CROSS_KEYS)).given == once.given


def test_what_was_given_survives_copies_and_a_users_data(tmp_path):
    import copy
    import pickle

    import numpy as np

    from fedlap_privacy.fl.run.user_runs import with_data

    cfg = TrainConfig(method="fedavg", clients=3, width=8)
    for twin in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert twin == cfg and twin.given == {"method", "clients", "width"}
    rng = np.random.default_rng(0)
    path = tmp_path / "mine.npz"
    np.savez(path, x=rng.normal(size=(60, 5)).astype(np.float32),
             y=np.arange(60) % 3)
    mine = with_data(cfg, path)
    assert mine.given == {"method", "clients", "width", "data", "dataset"}


def test_a_python_run_and_its_resume_keep_the_resolved_then_the_recorded_config(tmp_path):
    """A cross-device run started from Python (digits: 1,000 clients of one record) trains
    with the small CNN and B 10, records them, and its resume continues with the record."""
    from fedlap_privacy.fl.engine.simulation import resume, train
    from fedlap_privacy.fl.run.run_files import load_run_config

    cfg = TrainConfig(method="dp-fedavg-client", split="iid", clients=1000,
                      client_fraction=0.01, rounds=1, sigma=1.0, split_seed=0)
    out = tmp_path / "run"
    result = train(cfg, out, "cpu")
    recorded = load_run_config(out)
    assert (recorded.width, recorded.depth, recorded.batch_size, recorded.lr_local) == (
        32, 2, 10, 0.1)
    assert recorded == resolve_config(None, {**cfg.given_values()})
    assert result.summary.rounds_run == 1
    again = resume(out, rounds=2, device="cpu")
    assert again.summary.rounds_run == 2
    assert load_run_config(out) == dataclasses.replace(recorded, rounds=2)
