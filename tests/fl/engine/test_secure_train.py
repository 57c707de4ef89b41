"""train --secure-aggregation in process (fl/secure_sum/training.py): the configuration's
refusals, the mechanism the accountant is given, what the server object holds, a client that
skips its noise share, dropouts, the ledger across a resume, canary clients and accuracy."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fedlap_privacy.accountant.distributed import (
    DistributedNoise,
    central_gaussian_sigma,
    counted_shares,
    distributed_epsilon,
    plan_distributed,
    round_rdp,
    secure_bits,
    share_mechanism,
)
from fedlap_privacy.cli.main import app
from fedlap_privacy.errors import CheckpointError, ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine import training_run
from fedlap_privacy.fl.engine.simulation import PENDING, resume, train
from fedlap_privacy.fl.engine.training_run import local_clients
from fedlap_privacy.fl.secure_sum import encoding
from fedlap_privacy.fl.secure_sum import training as secure_training
from fedlap_privacy.fl.secure_sum.encoding import encode
from fedlap_privacy.fl.secure_sum.training import SecurePlan, secure_sum_round
from fedlap_privacy.state.checkpoint import CHECKPOINT, load_checkpoint
from fedlap_privacy.state.ledger import PrivacyLedger
from fedlap_privacy.state.secure_rounds import NOISE_MISSING, REFUSED

runner = CliRunner()


def _cfg(**kw) -> TrainConfig:
    base = dict(method="dp-fedavg-client", clients=5, rounds=2, sigma=1.0, split="iid",
                local_steps=2, lr_local=0.1, width=8, secure_aggregation="skellam")
    return TrainConfig(**{**base, **kw})


def _updates(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0.0, 0.02, size) + 0.005 * (i + 1) for i in range(n)]


@pytest.mark.parametrize(("kw", "message"), [
    (dict(method="dp-normfedavg"), "client-level DP-FedAvg's"),
    (dict(clip_quantile=0.5), "adaptive clipping's noisy count"),
    (dict(reproducible_noise=True), "--reproducible-noise does not apply"),
    (dict(colluding=5), r"colluding \(5\) < min_survivors"),
    (dict(min_survivors=6), r"min_survivors \(6\) <= the uploads a round sums \(5\)"),
    (dict(secure_aggregation=None, secure_bits=18), "go with secure_aggregation"),
    (dict(secure_aggregation="gaussian"), "secure_aggregation"),
])
def test_refusals_are_one_line(kw, message) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        _cfg(**kw).validate()
    assert "\n" not in str(err.value)


def test_cli_refuses_in_one_line_and_a_bits_that_cannot_hold_the_sum(tmp_path: Path) -> None:
    result = runner.invoke(app, ["train", "--method", "dp-fedavg-client", "--secure-aggregation",
                                 "skellam", "--colluding", "5", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "colluding (5) < min_survivors" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(ConfigError, match="2 bits cannot hold the rounding of 5 clients"):
        SecurePlan.of(_cfg(secure_bits=2).validate(), 1000)
    result = runner.invoke(app, ["train", "--method", "dp-fedavg-client", "--secure-aggregation",
                                 "skellam", "--bits", "3", "--out", str(tmp_path / "b")])
    assert result.exit_code == 2 and "3 bits cannot hold the rounding" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "b").exists()


def test_the_printed_guarantee_says_what_the_server_sees_and_which_figure_is_proven(
        tmp_path: Path) -> None:
    result = runner.invoke(app, ["train", "--method", "dp-fedavg-client", "--secure-aggregation",
                                 "skellam", "--clients", "6", "--split", "iid", "--rounds", "1",
                                 "--sigma", "2", "--local-steps", "1", "--set", "width=8",
                                 "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "against the server (it sees whom it selected and only the sum of the uploads)" in text
    assert "trusted-server: an approximation" in text and "the bound proven is the server's" in text


def test_default_bits_follow_the_model_size_within_two_percent() -> None:
    # the plan of docs/accounting.md: 100 clients, noise multiplier 44.83
    common = dict(sigma=44.83, clip=1.0, capacity=100, honest=100)
    assert secure_bits("skellam", model_size=65_536, **common) == 18
    assert secure_bits("skellam", model_size=1_048_576, **common) == 20
    mech = share_mechanism("skellam", model_size=65_536, bits=18, **common)
    q = mech.quantisation
    assert q.l2 * q.gamma <= 1.02 and share_mechanism(
        "skellam", model_size=65_536, bits=17, **common).quantisation.l2 * share_mechanism(
        "skellam", model_size=65_536, bits=17, **common).quantisation.gamma > 1.02


def test_the_noise_accounted_is_the_share_each_client_adds() -> None:
    """One function (share_mechanism) sets the share; min_survivors - colluding honest
    shares add sigma clip; encode draws exactly that share (its variance, measured)."""
    cfg = _cfg(clients=8, min_survivors=6, colluding=2, clip=0.5).validate()
    plan = SecurePlan.of(cfg, 5000)
    q, s = plan.mechanism.quantisation, plan.mechanism.local_std
    assert math.sqrt(4) * s * q.gamma == pytest.approx(cfg.sigma * cfg.clip, rel=1e-12)
    assert plan.capacity == 8 and plan.bits == secure_bits(
        "skellam", sigma=1.0, clip=0.5, model_size=5000, capacity=8, honest=4)
    spec = secure_training.SecureSumSpec(plan.mechanism, plan.bits, 5000, bytes(32))
    zero = np.zeros(5000)
    diffs = [(encode(zero, spec).astype(np.int64) + spec.modulus // 2) % spec.modulus
             - spec.modulus // 2 for _ in range(3)]
    assert np.var(np.concatenate(diffs)) == pytest.approx(s**2, rel=0.03)
    record = plan.record(8, 7, released=True)
    assert np.array_equal(record.rdp, round_rdp(plan.mechanism, 7, 2))
    assert counted_shares(7, 2) == 5


def test_the_server_holds_only_masked_uploads_and_their_sum(monkeypatch) -> None:
    cfg = _cfg().validate()
    plan = SecurePlan.of(cfg, 3000)
    shares, servers = [], []
    real_encode, real_server = secure_training.encode, secure_training.SecureSumServer

    def spy_encode(update, spec, **kw):
        shares.append(real_encode(update, spec, **kw))
        return shares[-1]

    def spy_server(*args):
        servers.append(real_server(*args))
        return servers[-1]

    monkeypatch.setattr(secure_training, "encode", spy_encode)
    monkeypatch.setattr(secure_training, "SecureSumServer", spy_server)
    updates = _updates(5, 3000)
    outcome = secure_sum_round(plan, updates, 5)
    server = servers[0]
    assert len(server.uploads) == 5 and len(shares) == 5
    for upload in server.uploads.values():
        for share in shares:  # a masked upload agrees with a share only by chance (2^-b)
            assert np.mean(upload == share) < 0.01
    total = np.zeros_like(shares[0])
    for share in shares:
        total = (total + share) % np.uint64(1 << plan.bits)
    masked_sum = np.zeros_like(total)
    for upload in server.uploads.values():
        masked_sum = (masked_sum + upload) % np.uint64(1 << plan.bits)
    assert np.mean(masked_sum == total) < 0.01  # the masks hide even the sum until unmasked
    # the server object holds nothing else: the masked uploads and its public parameters
    assert {f.name for f in dataclasses.fields(server)} == {"bits", "size", "min_survivors",
                                                            "uploads"}
    assert outcome.total is not None  # the decoded sum: the updates' sum plus sigma c noise
    err = outcome.total - np.sum(updates, axis=0)
    assert np.std(err) == pytest.approx(cfg.sigma * cfg.clip, rel=0.06)


def test_a_client_skipping_its_noise_share_is_caught_by_the_server(monkeypatch) -> None:
    """Not by the canary audit at test sizes (fl/secure_sum/training.py says why); the server's
    noise check on the sum keeps it from the model. The server has unmasked that sum, so the
    round is charged at the shares its noise shows (at most the 4 present), not at none."""
    cfg = _cfg().validate()
    plan = SecurePlan.of(cfg, 16_000)
    for _ in range(3):  # an honest round passes the check
        assert secure_sum_round(plan, _updates(5, 16_000), 5).total is not None
    honest = train(_cfg(width=32), None, device="cpu")
    real_encode = secure_training.encode
    calls = []

    def faulty(update, spec, **kw):  # the first client of every round skips its share
        calls.append(1)
        return real_encode(update, spec, add_noise=len(calls) % 5 != 1)

    monkeypatch.setattr(secure_training, "encode", faulty)
    outcome = secure_sum_round(plan, _updates(5, 16_000), 5)
    assert outcome.total is None and "skipped its noise share" in outcome.refused
    assert outcome.record.released and 1 <= outcome.record.received <= 4
    assert all(a >= b for a, b in zip(outcome.record.rdp, round_rdp(plan.mechanism, 4),
                                      strict=True))

    calls.clear()  # d = 16,384 at width 32: one share of five is caught (not at width 8)
    result = train(_cfg(width=32), None, device="cpu")
    assert [e.status for e in result.ledger.entries] == [NOISE_MISSING, NOISE_MISSING]
    assert result.ledger.server_epsilon() > honest.ledger.server_epsilon() > 0.0
    assert result.summary.privacy.epsilon == pytest.approx(result.ledger.server_epsilon())


def _dropping(monkeypatch, keep: int) -> None:
    """Only the first ``keep`` clients of every round upload; the others drop out after the
    round was set up (their masks are recovered from the survivors)."""
    real = secure_training.secure_sum_round
    monkeypatch.setattr(training_run, "secure_sum_round",
                        lambda plan, updates, planned: real(plan, updates[:keep], planned))


def test_dropouts_below_min_survivors_refuse_the_round_and_spend_nothing(tmp_path,
                                                                          monkeypatch) -> None:
    cfg = _cfg(min_survivors=4)
    _dropping(monkeypatch, 3)
    refused = train(cfg, tmp_path / "refused", device="cpu")
    assert [e.status for e in refused.ledger.entries] == [REFUSED, REFUSED]
    assert all(e.secure.received == 3 and not e.secure.released
               for e in refused.ledger.entries)
    assert refused.ledger.server_epsilon() == 0.0
    assert refused.history[-1].extras["secure_refused"].startswith("3 uploads arrived")

    _dropping(monkeypatch, 4)
    dropped = train(cfg, None, device="cpu")
    monkeypatch.undo()
    full = train(cfg, None, device="cpu")
    plan = SecurePlan.of(cfg.validate(), _size(full))
    planned = plan.planned_epsilon(cfg.rounds, cfg.delta)
    eps_dropped, eps_full = dropped.ledger.server_epsilon(), full.ledger.server_epsilon()
    assert [e.secure.received for e in dropped.ledger.entries] == [4, 4]
    assert eps_full < eps_dropped <= planned * (1 + 1e-12)  # dropouts cost, within the plan
    assert eps_dropped == pytest.approx(distributed_epsilon(
        plan.mechanism, [4, 4], cfg.delta).epsilon, rel=1e-9)


def _size(result) -> int:
    return sum(p.numel() for p in result.model.parameters())


def test_resume_replays_the_secure_ledger_and_a_crash_is_counted_once(tmp_path) -> None:
    straight = train(_cfg(rounds=3), None, device="cpu")
    run = tmp_path / "run"
    train(_cfg(rounds=1), run, device="cpu")
    resumed = resume(run, rounds=3, device="cpu")
    assert resumed.ledger.server_epsilon() == pytest.approx(
        straight.ledger.server_epsilon(), rel=1e-12)
    assert resumed.ledger.epsilon == pytest.approx(straight.ledger.epsilon, rel=1e-12)
    assert resumed.summary.privacy.epsilon == pytest.approx(
        straight.summary.privacy.epsilon, rel=1e-12)
    entry = resumed.ledger.entries[-1].secure
    for key in ("mechanism", "bits", "modulus", "gamma", "clip", "dim", "beta", "local_std",
                "planned", "received", "l2", "l1", "rdp"):
        assert getattr(entry, key) is not None
    assert entry.modulus == 1 << entry.bits and entry.planned == entry.received == 5

    # a crash after round 4's clients touched their data: counted once, at min_survivors
    (run / PENDING).write_text(json.dumps({"round": 4, "local_steps": 1,
                                           "participants": [0, 1, 2, 3, 4]}))
    again = resume(run, rounds=4, device="cpu")
    statuses = [e.status for e in again.ledger.entries]
    assert statuses == ["completed"] * 3 + ["interrupted", "completed"]  # then rerun
    assert again.ledger.entries[3].secure.received == 5  # min_survivors of a fixed cohort

    ckpt = load_checkpoint(run / CHECKPOINT)
    edited = [dict(e) for e in ckpt["ledger"]]
    edited[-1]["secure"] = {**edited[-1]["secure"], "local_std": 2 * edited[-1]["secure"][
        "local_std"]}
    with pytest.raises(CheckpointError, match="secure-aggregation record"):
        PrivacyLedger.replay(edited)
    refused = [dict(e) for e in ckpt["ledger"]]  # a spent round passed off as refused
    refused[0]["status"] = REFUSED
    with pytest.raises(CheckpointError, match="only a refused secure round spends nothing"):
        PrivacyLedger.replay(refused)


def test_canary_clients_run_and_are_audited_on_a_secure_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = _cfg(clients=10, client_fraction=0.5, rounds=2, canaries=50, sigma=0.5)
    result = train(cfg, run, device="cpu")
    assert all(e.secure.planned >= e.secure.received > 0 for e in result.ledger.entries)
    assert any(e.secure.received > len(e.participants) for e in result.ledger.entries
               if e.participants is not None)  # canary clients' shares reached the sum
    out = runner.invoke(app, ["audit", "--model", str(run / CHECKPOINT), "--json",
                              "--max-per-half", "60", "--attacks", "loss"])
    report = json.loads(out.stdout)
    one_run = report["one_run"]
    assert one_run["kind"] == "clients"
    assert one_run["epsilon_lower_bound"] <= report["privacy"]["epsilon"]
    claim = report["privacy"]  # the outsiders' promise is tested; the stored one is the server's
    assert claim["epsilon"] == pytest.approx(result.ledger.epsilon, rel=1e-6)
    assert claim["stored_epsilon"] == pytest.approx(result.summary.privacy.epsilon, rel=1e-9)
    assert claim["stored_matches"] is True


@pytest.mark.parametrize("noise", [n.value for n in DistributedNoise])
def test_a_small_secure_run_learns_like_the_central_run_at_the_same_noise(
        noise, monkeypatch) -> None:
    """Both runs' noise from seeds here (central: --reproducible-noise; secure: each
    share's generator), so the comparison is the same on every run."""
    seeds = iter(range(10_000))
    monkeypatch.setattr(encoding, "os_generator", lambda: np.random.default_rng(next(seeds)))
    common = dict(clients=10, rounds=8, sigma=0.3, local_steps=5, lr_local=0.3)
    torch.manual_seed(0)
    central = train(_cfg(secure_aggregation=None, reproducible_noise=True, **common), None,
                    device="cpu")
    secure = train(_cfg(secure_aggregation=noise, **common), None, device="cpu")
    assert secure.summary.test_accuracy > 0.5  # chance is 0.1
    assert abs(secure.summary.test_accuracy - central.summary.test_accuracy) < 0.15
    privacy = secure.summary.privacy
    assert privacy.threat_model == "server" and privacy.secure_aggregation.startswith(noise)
    assert set(privacy.epsilon_by_threat_model) == {"server", "trusted-server"}


def test_a_target_epsilon_plans_the_shares_and_the_bits_against_the_server(tmp_path) -> None:
    """--target-eps over secure aggregation: the run's sigma and bits are plan
    --secure-aggregation's for its model, its epsilon against the server reaches the target
    and never exceeds it, and a dry run plans the same."""
    cfg = _cfg(sigma=None, target_eps=30.0, rounds=2, min_survivors=4, colluding=1).validate()
    size = _size(train(cfg, tmp_path / "r", device="cpu"))
    release = load_checkpoint(tmp_path / "r" / CHECKPOINT)
    run = TrainConfig.from_dict(release["config"])
    expected = plan_distributed("skellam", epsilon=30.0, delta=cfg.delta, model_size=size,
                                clients=5, rounds=2, min_survivors=4, colluding=1,
                                bits=run.secure_bits)
    assert run.sigma == pytest.approx(expected.noise_multiplier, rel=1e-12)
    assert run.secure_bits == secure_bits(
        "skellam", sigma=central_gaussian_sigma(30.0, cfg.delta, 2), clip=cfg.clip,
        model_size=size, capacity=5, honest=3)
    server = PrivacyLedger.replay(release["ledger"]).server_epsilon()
    assert 0.9 * 30.0 < server <= 30.0  # every share arrived: below the plan at 4 survivors
    assert SecurePlan.of(run, size).planned_epsilon(2, cfg.delta) == pytest.approx(
        expected.epsilon, rel=1e-9) and expected.epsilon <= 30.0
    dry = runner.invoke(app, ["train", "--method", "dp-fedavg-client", "--secure-aggregation",
                              "skellam", "--clients", "5", "--rounds", "2", "--split", "iid",
                              "--min-survivors", "4", "--colluding", "1", "--target-eps", "30",
                              "--local-steps", "2", "--set", "lr_local=0.1", "--set", "width=8",
                              "--dry-run", "--json", "--out", str(tmp_path / "d")])
    assert dry.exit_code == 0, dry.output
    planned = json.loads(dry.stdout)["run"]
    assert planned["config"]["sigma"] == pytest.approx(run.sigma, rel=1e-12)
    assert planned["privacy"]["epsilon"] == pytest.approx(expected.epsilon, rel=1e-9)


def test_the_training_run_builds_its_plan_from_the_model(monkeypatch) -> None:
    seen = []
    real = training_run.SecurePlan.of

    def spy(cfg, size):
        seen.append(size)
        return real(cfg, size)

    monkeypatch.setattr(training_run.SecurePlan, "of", spy)
    result = train(_cfg(rounds=1), None, device="cpu")
    assert seen == [_size(result)]
    # each client uploads its masked vector: 8 bytes a coordinate of the padded dimension
    dim = result.ledger.entries[0].secure.dim
    assert result.history[0].upload_bytes == 8 * dim >= 8 * _size(result)


def test_dry_run_plans_the_epsilon_against_the_server_and_remote_canaries_are_refused(
        tmp_path) -> None:
    result = runner.invoke(app, ["train", "--method", "dp-fedavg-client", "--secure-aggregation",
                                 "discrete-gaussian", "--clients", "5", "--rounds", "3",
                                 "--min-survivors", "4", "--sigma", "1", "--set", "width=8",
                                 "--dry-run", "--json", "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    privacy = json.loads(result.stdout)["run"]["privacy"]
    assert privacy["threat_model"] == "server" and privacy["accountant"] == "rdp"
    cfg = _cfg(rounds=3, min_survivors=4, secure_aggregation="discrete-gaussian").validate()
    built = train(cfg, None, device="cpu")
    plan = SecurePlan.of(cfg, _size(built))
    assert privacy["epsilon"] == pytest.approx(plan.planned_epsilon(3, cfg.delta), rel=1e-9)
    def remote(run, m, chosen, info, callback):  # another driver (Flower's) answers
        return local_clients(run, m, chosen, info, callback)

    with pytest.raises(ConfigError, match="canaries are inserted by the in-process driver"):
        train(dataclasses.replace(cfg, canaries=2).validate(), None, device="cpu",
              ask_clients=remote)
