"""Gradient canaries as records of the user's dataset (``wrap_dataset``): the user's loader
and sampler draw them, the wrapped model routes each to its own coordinate of the canary
block (exactly C there after Opacus's clipping, 0 elsewhere) and leaves real records alone;
a loader of 3x the accounted batch and a weighted sampler far from the accounted rate are
caught, a correct Poisson run is consistent. Synthetic data, coins seeded."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from opacus_runs import CLIP, DELTA, seeded_coins, synthetic, train_synthetic
from torch import nn

from fedlap_privacy.audit import GradientCanaries
from fedlap_privacy.audit.canaries.canary_block import canary_mark
from fedlap_privacy.audit.canaries.gradient_canary_audit import SamplingTest
from fedlap_privacy.errors import ConfigError


def test_real_records_are_untouched_and_canary_records_reach_only_their_coordinate():
    from opacus import GradSampleModule

    torch.manual_seed(30)
    canaries = GradientCanaries(m=40)
    inner = nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 3))
    model = canaries.wrap(inner)
    data = canaries.wrap_dataset(synthetic(30))
    included = np.flatnonzero(canaries.included)
    assert len(data) == 30 + len(included)
    x, y = (torch.stack(t) for t in zip(*[data[i] for i in (0, 1, 30, 2, 31)], strict=True))
    assert torch.all(x[2] == canary_mark(int(included[0])))
    assert torch.equal(y[2], data[0][1])  # the other fields are the first record's
    out = model(x)
    real = [0, 1, 3]
    assert torch.equal(out[real], inner(x[real])) and torch.all(out[[2, 4]] == 0)
    gsm = GradSampleModule(model, loss_reduction="sum")
    nn.functional.cross_entropy(gsm(x), y, reduction="sum").backward()
    grads = {n: p.grad_sample.clone() for n, p in gsm.named_parameters()}
    for name, g in grads.items():
        if "fedlap_canary_block" in name:
            g = g.reshape(5, -1)
            assert torch.all(g[real] == 0)
            for row, j in ((2, included[0]), (4, included[1])):
                assert g[row, j] > 1e6 and torch.count_nonzero(g[row]) == 1
        else:
            assert torch.all(g[[2, 4]] == 0)  # no weight of the model learns from a canary
    # Opacus's flat clipping (DPOptimizer.clip_and_accumulate) turns a canary row into C
    norms = torch.stack([g.reshape(5, -1).norm(dim=1) for g in grads.values()]).norm(dim=0)
    factor = (CLIP / (norms + 1e-6)).clamp(max=1.0)
    block = grads["_module.fedlap_canary_block.weight"].reshape(5, -1) * factor[:, None]
    assert torch.allclose(block[2, included[0]], torch.tensor(CLIP), rtol=1e-6)
    names = [n for n, _ in inner.named_parameters()]
    for row in real:  # each real record's own gradient, by plain autograd on the inner model
        loss = nn.functional.cross_entropy(inner(x[row:row + 1]), y[row:row + 1],
                                           reduction="sum")
        own = torch.autograd.grad(loss, list(inner.parameters()))
        for name, g in zip(names, own, strict=True):
            assert torch.allclose(grads["_module.model." + name][row], g, atol=1e-6)


@pytest.mark.parametrize("seed", [31])
def test_a_correct_poisson_run_is_consistent(monkeypatch, seed, tmp_path):
    seeded_coins(monkeypatch, seed)
    run = train_synthetic(seed, records=True)
    result = run.canaries.audit(delta=DELTA, out=tmp_path)
    assert result.run.route == "data pipeline" and result.verdict == "consistent"
    (_, q, steps), = run.history
    assert (result.mechanism.sample_rate, result.mechanism.steps) == (q, steps)
    draws, due = result.run.canary_draws, result.run.accounted_draws
    assert abs(draws / due - 1.0) < 0.05 and not result.sampling.rejected
    assert "Canary records in the training set" in (tmp_path / "report.md").read_text()


def test_a_loader_of_3x_the_accounted_batch_is_caught_at_a_claim_near_1(monkeypatch):
    """Opacus accounts the batch make_private saw (q = 1/24 per step) while the script
    trains on a shuffled loader of 3x that batch: each canary record enters once an epoch,
    3x the accounted rate."""
    seeded_coins(monkeypatch, 32)
    run = train_synthetic(32, records=True, loader="3x", sigma=2.0)
    result = run.canaries.audit(delta=DELTA)
    assert 0.5 < result.claimed_epsilon < 1.2
    assert result.violation and result.sampling.rejected and result.sampling.p_value < 1e-100
    assert result.sampling.ratio == pytest.approx(3.0, rel=0.05)


def test_a_weighted_sampler_far_from_the_accounted_rate_is_caught(monkeypatch):
    """A WeightedRandomSampler drawing the canary records 10x as often as the others (as a
    class-balancing sampler does to a rare class) while Opacus accounts 1 / len(loader)."""
    seeded_coins(monkeypatch, 33)
    run = train_synthetic(33, records=True, loader="weighted", n=5000, m=1000, sigma=1.5,
                          epochs=3, batch=200)
    result = run.canaries.audit(delta=DELTA)
    assert result.claimed_epsilon < 1.5 and result.violation
    assert result.sampling.rejected and result.sampling.ratio > 4
    assert result.audit.violation  # the canaries' releases alone show it too


def test_the_sampling_test_of_canary_records():
    """The Chernoff bound by hand; as many draws as accounted (a shuffled loader) is never
    evidence; the test's level is its share of the audit's."""
    test = SamplingTest(draws=150, accounted=100.0, level=0.005)
    assert test.p_value == pytest.approx(math.exp(-100 * (1.5 * math.log(1.5) - 0.5)))
    assert test.rejected and test.ratio == 1.5
    assert SamplingTest(100, 100.0, 0.005).p_value == 1.0
    assert not SamplingTest(110, 100.0, 0.005).rejected  # p 0.61: within the noise


def test_tuple_list_and_dict_records():
    canaries = GradientCanaries(m=20)
    canaries.wrap(nn.Linear(4, 2))
    x = torch.randn(5, 4)
    listed = canaries.wrap_dataset([[x[i], i] for i in range(5)])
    assert isinstance(listed[5], list) and listed[5][1] == 0
    assert torch.all(listed[-1][0] == listed[-1][0][0]) and listed[-1][0].shape == (4,)
    with pytest.raises(IndexError):
        listed[len(listed)]
    keyed = GradientCanaries(m=20)
    keyed.wrap(nn.Linear(4, 2))
    records = [{"image": x[i], "mask": torch.ones(4), "label": i} for i in range(5)]
    with pytest.raises(ConfigError, match="input_key"):
        keyed.wrap_dataset(records)
    data = keyed.wrap_dataset(records, input_key="image")
    canary = data[5]
    assert torch.all(canary["image"] < -1e30) and torch.equal(canary["mask"], torch.ones(4))
    np_records = GradientCanaries(m=20)
    np_records.wrap(nn.Linear(4, 2))
    arrays = np_records.wrap_dataset([(np.zeros(4, dtype=np.float32), 1)] * 3)
    assert arrays[3][0].dtype == np.float32 and arrays[3][0][0] < -1e30


def test_the_dict_batch_a_model_takes_is_routed_too():
    class Keyed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.fc(batch["image"] * batch["mask"])

    canaries = GradientCanaries(m=20)
    model = canaries.wrap(Keyed())
    records = [{"image": torch.randn(4), "mask": torch.ones(4)} for _ in range(3)]
    data = canaries.wrap_dataset(records, input_key="image")
    batch = torch.utils.data.default_collate([data[0], data[3], data[1]])
    out = model(batch)
    assert torch.all(out[1] == 0) and torch.all(torch.isfinite(out))
    assert torch.equal(out[[0, 2]], model.model({k: v[[0, 2]] for k, v in batch.items()}))


def test_record_refusals():
    canaries = GradientCanaries(m=20)
    with pytest.raises(ConfigError, match="wrap the model first"):
        canaries.wrap_dataset(synthetic(10))
    canaries.wrap(nn.Linear(20, 2))
    for bad, match in (([(torch.arange(4), 1)], "not supported"), ([("text", 1)], "not "
                       "supported"), ([], "at least one record"),
                       (iter([]), "map-style")):
        with pytest.raises(ConfigError, match=match):
            canaries.wrap_dataset(bad)
    canaries.wrap_dataset(synthetic(10))
    with pytest.raises(ConfigError, match="already records"):
        canaries.wrap_dataset(synthetic(10))


def test_opacus_refusals_with_records():
    from opacus import PrivacyEngine

    def made(mode: str) -> tuple[GradientCanaries, object, object]:
        canaries = GradientCanaries(m=50)
        model = canaries.wrap(nn.Linear(20, 2))
        data = canaries.wrap_dataset(synthetic(200))
        loader = torch.utils.data.DataLoader(data, batch_size=20)
        result = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=CLIP,
            grad_sample_mode=mode, **({"criterion": nn.CrossEntropyLoss()}
                                      if mode == "ghost" else {}))
        return canaries, result[1], result[-1]

    canaries, optimizer, loader = made("hooks")
    with pytest.raises(ConfigError, match="without data_loader"):
        canaries.attach(optimizer, data_loader=loader)
    ghost, optimizer, _ = made("ghost")
    with pytest.raises(ConfigError, match="ghost clipping"):
        ghost.attach(optimizer)


def test_a_sampler_that_never_draws_a_canary_record_is_refused():
    """A sampler built for the user's own records (indices 0..n-1) never reaches the
    canaries appended after them: the audit refuses instead of reading noise."""
    from opacus import PrivacyEngine

    torch.manual_seed(34)
    canaries = GradientCanaries(m=200)
    model = canaries.wrap(nn.Linear(20, 2))
    data = canaries.wrap_dataset(synthetic(400))
    loader = torch.utils.data.DataLoader(data, batch_size=40)
    model, optimizer, _ = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader, noise_multiplier=1.0, max_grad_norm=CLIP)
    canaries.attach(optimizer)
    own = torch.utils.data.DataLoader(data, batch_size=40,
                                      sampler=torch.utils.data.RandomSampler(range(400)))
    for x, y in own:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    with pytest.raises(ConfigError, match="no canary record reached the model"):
        canaries.audit(delta=DELTA)


def test_a_model_whose_input_is_not_batch_first_still_wraps():
    """Sequence-first input, batch-first output: no canary record to route, no refusal;
    a canary record in such an input is refused in one line."""
    class SequenceFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (seq, batch, 4)
            return self.fc(x.mean(dim=0))

    canaries = GradientCanaries(m=20)
    model = canaries.wrap(SequenceFirst())
    x = torch.randn(7, 3, 4)
    assert torch.equal(model(x), model.model(x))
    x[2] = canary_mark(0)
    with pytest.raises(ConfigError, match="one output row per input row"):
        model(x)
