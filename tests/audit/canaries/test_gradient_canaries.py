"""Gradient canaries in real Opacus DP-SGD runs (digits, a small MLP): where they enter, what
is recorded, the sampling rules, and the refusals. The audits' verdicts are in
test_gradient_canary_audit.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from opacus_runs import CLIP, SIGMA, digits, mlp, seeded_coins, train

from fedlap_privacy.audit import GradientCanaries
from fedlap_privacy.audit.canaries import gradient_canary_scores as gcs
from fedlap_privacy.audit.canaries.canary_block import remove_canary_block
from fedlap_privacy.errors import ConfigError


def test_wrap_leaves_the_outputs_unchanged_whatever_the_block_holds():
    torch.manual_seed(0)
    model = mlp()
    x = digits().tensors[0][:50]
    before = model(x)
    model.classes = 10
    wrapped = GradientCanaries(m=100).wrap(model)
    with torch.no_grad():
        wrapped.fedlap_canary_block.weight.normal_(0.0, 100.0)
    assert torch.equal(wrapped(x), before)
    assert wrapped.classes == 10 and wrapped.model is model  # its attributes still answer
    assert remove_canary_block(wrapped) is model and GradientCanaries.unwrap(wrapped) is model


def test_the_canaries_enter_the_clipped_sum_before_the_noise(monkeypatch):
    """Opacus draws each parameter's noise with ``reference=p.summed_grad``: on the canary
    block that sum must already hold C per canary added at the step (a canary added after
    the noise would leave it at 0)."""
    from opacus.optimizers import optimizer as dp_optimizer

    seen: list[torch.Tensor] = []
    draw = dp_optimizer._generate_noise

    def spy(std, reference, generator=None, secure_mode=False):
        if reference.shape == (1, 200):
            seen.append(reference.detach().clone())
        return draw(std, reference, generator, secure_mode)

    monkeypatch.setattr(dp_optimizer, "_generate_noise", spy)
    run = train(0, epochs=2, m=200)
    c = run.canaries
    assert len(seen) == c.steps == 30
    sums = torch.stack(seen).reshape(c.steps, 200)
    assert set(torch.unique(sums).tolist()) <= {0.0, CLIP}  # each canary is C or absent
    entered = (sums > 0).sum(0).numpy()
    assert np.array_equal(entered, c._sampled)  # as drawn, each step
    assert entered[~c.included].sum() == 0 and entered[c.included].sum() > 0


def test_the_release_is_recorded_after_the_noise_and_the_scaling(monkeypatch):
    """On an excluded canary's coordinate the record is pure noise of spread sigma (in
    units of C, after undoing Opacus's division by the expected batch size); on an included
    one it adds 1 per step the canary entered."""
    seeded_coins(monkeypatch, 3)
    run = train(3, epochs=6, m=1000)
    c = run.canaries
    releases = c.releases()
    assert releases.shape == (c.steps, 1000)
    out = releases[:, ~c.included]
    assert abs(out.std() - SIGMA) < 0.02 and abs(out.mean()) < 0.01
    assert abs(gcs.measured_noise_multiplier(releases) - SIGMA) < 0.02
    excess = releases[:, c.included].sum(0) - c._sampled[c.included]
    assert abs(excess.mean()) < 4 * SIGMA * np.sqrt(c.steps / c.included.sum())
    # what the optimiser hands to SGD: p.grad of the block, times the expected batch size
    block = run.model._module.fedlap_canary_block.weight
    expected = run.optimizer.expected_batch_size
    assert np.allclose(block.grad.reshape(-1).numpy() * expected / CLIP, releases[-1],
                       atol=1e-5)


def test_poisson_sampling_false_puts_each_included_canary_in_one_step_per_epoch():
    shuffled = train(1, epochs=3, m=300, poisson=False, attach_loader=True)
    s = shuffled.canaries
    assert s.run().sampling == "shuffle" and s.run().steps_per_epoch == 15
    assert np.all(s._sampled[s.included] == 3) and np.all(s._sampled[~s.included] == 0)


def test_ghost_clipping_clips_and_noises_the_block_as_every_weight():
    run = train(2, epochs=4, m=300, mode="ghost")
    c = run.canaries
    assert c.steps == 60
    assert abs(c.run().measured_noise_multiplier - SIGMA) < 0.05


def test_the_block_joins_an_optimiser_built_after_wrap_too():
    run = train(4, epochs=1, m=100, optimizer_first=False)
    assert run.canaries.steps == 15
    assert sum(p is run.canaries._block.weight for p in run.optimizer.params) == 1


def test_a_plain_torch_dp_sgd_loop_through_the_documented_hooks():
    """The hooks without Opacus: a block that no record reaches, its clipped sum, noise."""
    gen = torch.Generator().manual_seed(5)
    canaries = GradientCanaries(m=400)
    block = torch.zeros(400)
    for _ in range(200):
        block_sum = torch.zeros_like(block)  # every record's gradient there is 0
        canaries.add_to_clipped_sum(block_sum, max_grad_norm=2.0, sample_rate=0.05)
        noisy = block_sum + 0.8 * 2.0 * torch.randn(block.shape, generator=gen)
        canaries.record_release(noisy, noise_multiplier=0.8, max_grad_norm=2.0)
    run = canaries.run()
    assert (run.steps, run.sample_rate, run.noise_multiplier) == (200, 0.05, 0.8)
    assert abs(run.measured_noise_multiplier - 0.8) < 0.03
    scores = canaries.scores(0.8)["likelihood ratio (claimed noise)"]
    inc = canaries.included
    assert scores[inc].mean() > scores[~inc].mean() + 1.0


def test_refusals_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="lie in 10"):
        GradientCanaries(m=5)
    with pytest.raises(ConfigError, match="lie in 10"):
        GradientCanaries(m=(1 << 20) + 1)
    canaries = GradientCanaries(m=50)
    with pytest.raises(ConfigError, match="wrap the model first"):
        canaries.attach(object())
    model = canaries.wrap(mlp())
    with pytest.raises(ConfigError, match="already wrapped"):
        canaries.wrap(mlp())
    with pytest.raises(ConfigError, match="DPOptimizer"):
        canaries.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match=r"no step was recorded: call canaries\.attach"):
        canaries.run()
    with pytest.raises(ConfigError, match="at least 50 entries"):
        canaries.add_to_clipped_sum(torch.zeros(49), max_grad_norm=1.0, sample_rate=0.1)
    with pytest.raises(ConfigError, match="record_release needs"):
        canaries.record_release(torch.zeros(50), noise_multiplier=1.0, max_grad_norm=1.0)


def test_opacus_refusals(monkeypatch):
    from opacus import PrivacyEngine

    run = train(6, epochs=1, m=50)
    with pytest.raises(ConfigError, match="already attached"):
        run.canaries.attach(run.optimizer)
    with pytest.raises(ConfigError, match="before PrivacyEngine"):
        GradientCanaries(m=50).wrap(run.model)
    late = GradientCanaries(m=50)
    model = mlp()
    engine = PrivacyEngine()
    loader = torch.utils.data.DataLoader(digits(), batch_size=100)
    model, optimizer, loader = engine.make_private(
        module=late.wrap(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
    optimizer.step_hook = None  # a hand-made DPOptimizer without an accountant
    with pytest.raises(ConfigError, match="sample_rate="):
        late.attach(optimizer)


def test_scores_of_known_releases():
    """The likelihood ratio by hand on two steps; the shuffled one on an unfinished epoch."""
    u = np.array([[1.0, 0.0], [0.0, 2.0]])
    lr = gcs.poisson_scores(u, 0.1, 1.0)
    assert np.allclose(lr, [np.log(0.9 + 0.1 * np.exp(0.5)) + np.log(0.9 + 0.1 * np.exp(-0.5)),
                            np.log(0.9 + 0.1 * np.exp(-0.5)) + np.log(0.9 + 0.1 * np.exp(1.5))])
    sh = gcs.shuffle_scores(u, 3, 1.0)  # 2 of 3 steps seen: one slot released nothing
    assert np.allclose(sh, np.log((np.exp([0.5, -0.5]) + np.exp([-0.5, 1.5]) + 1.0) / 3.0))
    assert np.allclose(gcs.summed_scores(u), [1.0, 2.0])
    with pytest.raises(ConfigError, match="NaN or infinite"):
        gcs.summed_scores(np.array([[np.nan, 0.0]]))


def test_the_recorded_scores_are_not_fooled_by_a_larger_block():
    """A block longer than m (a plain loop's whole weight): only the first m entries."""
    canaries = GradientCanaries(m=20)
    block = torch.zeros(3, 10)
    canaries.add_to_clipped_sum(block, max_grad_norm=1.0, steps_per_epoch=1)
    assert block.reshape(-1)[20:].abs().sum() == 0
    assert torch.equal(block.reshape(-1)[:20] > 0, torch.from_numpy(canaries.included))
    canaries.record_release(block, noise_multiplier=0.0, max_grad_norm=1.0)
    assert np.array_equal(canaries.releases()[0], canaries.included.astype(float))


def test_a_model_fixed_by_opacus_after_wrap_keeps_its_canaries():
    """``ModuleValidator.fix`` clones the wrapped model: the optimiser then holds the copy's
    block, and the canaries enter that one."""
    from opacus import PrivacyEngine
    from opacus.validators import ModuleValidator

    torch.manual_seed(7)
    canaries = GradientCanaries(m=200)
    model = ModuleValidator.fix(canaries.wrap(mlp()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(digits(), batch_size=120)
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=1.0)
    canaries.attach(optimizer)
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert canaries.steps == 15 and canaries._sampled.sum() > 0
    assert abs(canaries.run().measured_noise_multiplier - 1.0) < 0.1
    block = model._module.fedlap_canary_block.weight
    assert block.grad is not None and block is not canaries._block.weight
