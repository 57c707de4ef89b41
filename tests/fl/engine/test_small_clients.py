"""Clients holding fewer records than the batch size B (issue 45): the methods whose batches
no accountant prices (the non-private ones; client-level DP, whose local steps are not
private) train such a client on all its records each step, the batch of min(B, N_k)
records FedAvg's users expect; record-level DP-SGD keeps the rate B / N_k its accountant
composes and refuses such a client before round 1, in one line naming it."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny
from typer.testing import CliRunner

from fedlap_privacy.cli.main import app
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.engine.cohort import ClientBatches
from fedlap_privacy.fl.engine.simulation import train
from fedlap_privacy.fl.methods.dp import batch_rate, poisson_sample

#: records per client, fewer than TINY's batch size 32
SMALL = 6


@pytest.mark.parametrize(("method", "extra"), [
    ("fedavg", dict(cohort_training="loop")),
    ("fedavg", dict(cohort_training="packed")),
    ("scaffold", {}),
    ("fedlap", dict(sigma=None, max_loops=1, real_batches=1, server_epochs=1)),
    ("ldp-fl", dict(ldp_epsilon=1.0)),
])
def test_a_client_smaller_than_the_batch_trains_on_all_its_records(method, extra):
    """(FedSGD takes every record anyway; dp-fedavg-client and dp-normfedavg already took
    min(B, N_k): the local steps they share are the ones above.)"""
    cfg = tiny(method=method, client_records=SMALL, rounds=1, split_seed=0, width=8, **extra)
    assert cfg.batch_size > SMALL
    result = train(cfg, None, device="cpu")
    assert result.summary.rounds_run == 1
    assert result.history[-1].test_accuracy > 0.0


def test_the_batch_of_a_small_client_is_every_record_and_a_large_one_keeps_b_over_n():
    gen = torch.Generator().manual_seed(0)
    assert batch_rate(32, SMALL, accounted=False) == 1.0
    assert batch_rate(32, 320, accounted=False) == batch_rate(32, 320, accounted=True) == 0.1
    drawn = ClientBatches.draw(torch.arange(SMALL), 4, 32.0, gen)
    assert all(b.tolist() == list(range(SMALL)) for b in drawn.batches)
    sizes = [poisson_sample(320, batch_rate(32, 320, accounted=False), gen).numel()
             for _ in range(200)]
    assert 29 < sum(sizes) / len(sizes) < 35  # B on average: the rate is unchanged
    with pytest.raises(ConfigError, match="accounted rate B / N_k exceeds 1"):
        batch_rate(32, SMALL, accounted=True)
    with pytest.raises(ConfigError, match="no records"):
        batch_rate(32, 0, accounted=False)


@pytest.mark.parametrize("method", ["dp-fedavg", "dp-fedprox", "ali-dpfl", "fedlap-dp"])
def test_record_level_dp_refuses_the_client_in_one_line_naming_it(method):
    cfg = tiny(method=method, client_records=SMALL, rounds=1, split_seed=0, sigma=1.0,
               target_eps=50.0)  # ALI-DPFL's budget; the others stop before spending it
    with pytest.raises(ConfigError) as refused:
        train(cfg, None, device="cpu")
    message = str(refused.value)
    assert "\n" not in message
    assert f"(client 0, {SMALL} records)" in message and "batch size 32" in message
    assert "rate B / N_k" in message


def test_the_cli_refuses_it_with_exit_2_and_trains_fedavg(tmp_path):
    common = ["train", "--rounds", "1", "--clients", "5", "--batch-size", "32",
              "--set", f"client_records={SMALL}", "--set", "width=8", "--set", "split_seed=0"]
    refused = CliRunner().invoke(app, [*common, "--method", "dp-fedavg", "--sigma", "1",
                                       "--out", str(tmp_path / "dp")], env={"COLUMNS": "300"})
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert "(client 0, 6 records)" in refused.output
    trained = CliRunner().invoke(app, [*common, "--method", "fedavg", "--json",
                                       "--out", str(tmp_path / "fedavg")])
    assert trained.exit_code == 0, trained.output
