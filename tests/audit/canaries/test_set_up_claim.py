"""The claim a run was set up with, and the optimiser's real steps: a noise cut after
``attach`` is audited against the set-up claim (not Opacus's epsilon, which follows the cut),
the report says what changed and when, and manual accumulation / virtual steps are modelled
as Opacus accounts them. Synthetic data, an MLP 20-16-2, coins seeded (the verdicts are then
the same on every run)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from opacus_runs import DELTA, SIGMA, seeded_coins, synthetic, train_synthetic

from fedlap_privacy.audit import GradientCanaries
from fedlap_privacy.audit.canaries import gradient_canary_scores as gcs
from fedlap_privacy.audit.canaries.canary_steps import Change, StepRecord, changes, describe_change
from fedlap_privacy.errors import ConfigError


def rdp_epsilon(history: list[tuple[float, float, int]]) -> float:
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = list(history)
    return accountant.get_epsilon(DELTA)


def test_a_noise_cut_to_0_3x_after_attach_is_caught_with_the_default_claim(monkeypatch,
                                                                         tmp_path):
    seeded_coins(monkeypatch, 20)
    run = train_synthetic(20, cut=0.3)
    (sigma, q, steps), = run.history
    assert sigma == pytest.approx(0.3 * SIGMA) and steps == 120  # Opacus accounted the cut
    result = run.canaries.audit(delta=DELTA, out=tmp_path / "audit")
    assert result.claim_source == "set up" and result.mechanism_source == "set up"
    assert result.claimed_epsilon == pytest.approx(rdp_epsilon([(SIGMA, q, steps)]))
    assert result.opacus_epsilon == pytest.approx(run.engine.get_epsilon(DELTA))
    assert result.opacus_epsilon > 10 * result.claimed_epsilon  # what the old default tested
    assert (result.mechanism.noise_multiplier, result.mechanism.sample_rate,
            result.mechanism.steps) == (SIGMA, q, steps)
    assert result.violation and result.claim_curve_p_value < 0.01
    assert result.run.changes == (Change("noise multiplier", SIGMA, 0.3 * SIGMA, 1, 120, 120),)
    report = (tmp_path / "audit" / "report.md").read_text()
    assert "noise multiplier 0.3 instead of the set-up 1 at 120 of 120 steps" in report
    assert "Opacus's own epsilon after training" in report
    # passing the engine picks the accountant's kind; the claim stays the set-up one
    again = run.canaries.audit(delta=DELTA, accountant=run.engine)
    assert again.claimed_epsilon == pytest.approx(result.claimed_epsilon) and again.violation
    # another claim on the same coins is one more test at the full level: refused
    with pytest.raises(ConfigError, match="one claim per set of canaries"):
        run.canaries.audit(claimed_epsilon=result.opacus_epsilon, delta=DELTA)


def test_a_correct_run_is_consistent_and_says_nothing_changed(monkeypatch, tmp_path):
    seeded_coins(monkeypatch, 21)
    run = train_synthetic(21)
    result = run.canaries.audit(delta=DELTA, out=tmp_path)
    assert result.verdict == "consistent" and result.run.changes == ()
    assert result.claimed_epsilon == pytest.approx(result.opacus_epsilon)
    assert "Nothing changed during training" in (tmp_path / "report.md").read_text()


def test_a_noise_cut_mid_training_is_caught_scored_at_each_part_s_own_noise(monkeypatch):
    """40 steps at the set-up noise, then 80 at 0.3x: the measured noise of the block as a
    whole (a mixture) would drown the first part's steps; each group of steps the optimiser
    ran alike is scored at its own."""
    seeded_coins(monkeypatch, 27)
    run = train_synthetic(27, cut=0.3, cut_after=40)
    result = run.canaries.audit(delta=DELTA)
    assert result.run.changes[0].first_step == 41 and result.violation


def test_the_noise_is_measured_per_group_of_steps():
    rng = np.random.default_rng(0)
    releases = np.vstack([rng.normal(0, 1.0, (50, 2000)), rng.normal(0, 0.3, (50, 2000))])
    measured = gcs.measured_noise_by_step(releases, np.repeat([0, 1], 50))
    assert np.allclose(measured[:50], 1.0, atol=0.02) and np.allclose(measured[50:], 0.3,
                                                                       atol=0.01)
    both = gcs.poisson_scores(releases[:1], 0.5, measured[:1])
    assert np.allclose(both, gcs.poisson_scores(releases[:1], 0.5, float(measured[0])))


def test_a_change_mid_training_is_reported_with_its_steps():
    run = train_synthetic(22, m=100, cut=0.5, cut_after=30, epochs=3)
    assert run.canaries.run().changes == (Change("noise multiplier", SIGMA, 0.5, 31, 45, 15),)
    assert describe_change(run.canaries.run().changes[0], 45) == (
        "noise multiplier 0.5 instead of the set-up 1 at 15 of 45 steps (steps 31-45)")


def test_changes_of_every_quantity():
    set_up = StepRecord(1.0, 1.0, 0.05, 1, 64.0)
    steps = [set_up, StepRecord(1.0, 2.0, 0.1, 2, 64.0), StepRecord(1.0, 2.0, 0.05, 1, 128.0)]
    found = {(c.quantity, c.value, c.first_step, c.steps) for c in changes(set_up, steps)}
    assert found == {("clipping norm", 2.0, 2, 2), ("accounted sample rate", 0.1, 2, 1),
                     ("accumulated micro-batches", 2.0, 2, 1),
                     ("expected batch size", 128.0, 3, 1)}


@pytest.mark.parametrize("seed", [23, 24])
def test_manual_accumulation_of_4_micro_batches_is_modelled_as_opacus_accounts(monkeypatch,
                                                                              seed):
    """``poisson_sampling=False``, batches of 30, a step every 4: Opacus accounts q = 4/60
    per step over 15 steps an epoch; the claimed mechanism is exactly that, the correct run
    consistent and a 0.3x noise cut a violation."""
    seeded_coins(monkeypatch, seed)
    run = train_synthetic(seed, accumulate=4)
    (sigma, q, steps), = run.history
    assert q == pytest.approx(4 / 60) and steps == 120
    result = run.canaries.audit(delta=DELTA)
    mechanism = result.mechanism
    assert (mechanism.noise_multiplier, mechanism.sample_rate, mechanism.steps) == (sigma, q,
                                                                                   steps)
    assert result.claimed_epsilon == pytest.approx(run.engine.get_epsilon(DELTA))
    assert result.verdict == "consistent"
    cut = train_synthetic(seed, accumulate=4, cut=0.3)
    assert cut.canaries.audit(delta=DELTA).violation


def test_shuffled_epochs_follow_a_fixed_accumulation_and_refuse_any_other():
    """``attach(data_loader=...)`` of a shuffled loader of 60 batches, 4 a step: each canary
    enters exactly one of each epoch's 15 steps, at the rate Opacus accounts (4/60); 7 a
    step does not divide the epoch's 106 batches: refused in one line, not mis-modelled."""
    run = train_synthetic(25, m=200, accumulate=4, epochs=2, attach_loader=True)
    canaries = run.canaries
    (_, q, steps), = run.history
    assert steps == canaries.steps == 30 and canaries.run().steps_per_epoch == 15
    assert canaries.run().sample_rate == q
    assert np.all(canaries._sampled[canaries.included] == 2)
    assert canaries.audit(delta=DELTA).mechanism.sample_rate == q
    odd = train_synthetic(25, m=100, accumulate=7, epochs=1, attach_loader=True)
    with pytest.raises(ConfigError, match="cannot model this run: a step over"):
        odd.canaries.audit(delta=DELTA)


def test_virtual_steps_of_batch_memory_manager_are_one_step_each():
    """Physical batches of at most 20 records: the skipped steps release nothing; the
    canaries follow the logical steps Opacus accounts."""
    from opacus import PrivacyEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    torch.manual_seed(26)
    canaries = GradientCanaries(m=200)
    model = canaries.wrap(torch.nn.Sequential(torch.nn.Linear(20, 2)))
    engine = PrivacyEngine(accountant="rdp")
    loader = torch.utils.data.DataLoader(synthetic(600), batch_size=60)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
    canaries.attach(optimizer)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=20,
                            optimizer=optimizer) as physical:
        for x, y in physical:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    (_, q, steps), = engine.accountant.history
    assert canaries.steps == steps and steps >= 8
    assert {s.sample_rate for s in canaries.step_records()} == {q}


@pytest.mark.parametrize("kind", ["rdp", "prv"])
def test_make_private_with_epsilon_claims_its_target(kind):
    """The noise Opacus chose for a target epsilon is the set-up noise: trained for the
    planned epochs, the set-up claim is the target (Opacus's tolerance 0.01), whatever the
    noise was changed to afterwards; accounted by the kind of accountant the engine used."""
    from opacus import PrivacyEngine

    torch.manual_seed(28)
    canaries = GradientCanaries(m=100)
    model = canaries.wrap(torch.nn.Linear(20, 2))
    loader = torch.utils.data.DataLoader(synthetic(900), batch_size=100)
    engine = PrivacyEngine(accountant=kind)
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader, target_epsilon=2.0, target_delta=DELTA, epochs=3,
        max_grad_norm=1.0)
    canaries.attach(optimizer)
    set_up = optimizer.noise_multiplier
    optimizer.noise_multiplier = 0.3 * set_up
    for _ in range(3):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    result = canaries.audit(delta=DELTA)
    assert result.claimed_epsilon == pytest.approx(2.0, abs=0.02)
    assert result.mechanism.noise_multiplier == set_up
    assert result.opacus_epsilon > 5 * result.claimed_epsilon
