"""dp-fedavg-client on Flower: the driver equals the simulator bit for bit with adaptive
clipping and fixed-size cohorts (seeded noise); the node's policy on its sigma and clip is
tested in test_flower_policy.py."""

from __future__ import annotations

from functools import partial

import pytest
import torch

flwr = pytest.importorskip("flwr")

import helpers  # noqa: E402
from flower_grid import FakeGrid, task_identity  # noqa: E402, F401

from fedlap_privacy.fl.engine.flower_app import FlowerClients, expected_partitions  # noqa: E402
from fedlap_privacy.fl.engine.simulation import CHECKPOINT, train  # noqa: E402
from fedlap_privacy.state.checkpoint import PRIVATE, PRIVATE_FORMAT, load_checkpoint  # noqa: E402

tiny = partial(helpers.tiny, method="dp-fedavg-client", reproducible_noise=True)


def test_adaptive_fixed_cohort_run_on_flower_equals_the_simulator(tmp_path):
    cfg = tiny(clients=3, clients_per_round=2, clip_quantile=0.5, clip=0.1, sigma=1.0,
               rounds=3, split="iid", split_seed=0)
    grid = FakeGrid(3, partitions=[2, 0, 1])
    driver = FlowerClients(grid, node_wait=5.0, log=lambda line: None)  # type: ignore[arg-type]
    driver.discover(cfg, expected_partitions(cfg))
    flower = train(cfg, tmp_path / "flower", "cpu", ask_clients=driver)
    local = train(tiny(clients=3, clients_per_round=2, clip_quantile=0.5, clip=0.1, sigma=1.0,
                       rounds=3, split="iid", split_seed=0), tmp_path / "local", "cpu")
    a = load_checkpoint(tmp_path / "flower" / CHECKPOINT)
    b = load_checkpoint(tmp_path / "local" / CHECKPOINT)
    assert a["ledger"] == b["ledger"] and len(a["ledger"]) == 3
    # trusted-server: the release withholds the selection, the private state keeps it
    assert all(e["participants"] is None and e["accesses"] is None for e in a["ledger"])
    assert all("replies" not in h and "clients" not in h for h in a["history"])
    private = load_checkpoint(tmp_path / "flower" / PRIVATE, PRIVATE_FORMAT)
    assert [len(e["participants"]) for e in private["ledger"]] == [2] * 3
    assert all(torch.equal(a["model_state"][k], b["model_state"][k]) for k in a["model_state"])
    clips = [h.extras["clip"] for h in flower.history]
    assert clips == [h.extras["clip"] for h in local.history] and len(set(clips)) == 3  # it adapts
    assert [h.replies for h in flower.history] == [2, 2, 2]
