"""Per-record gradients (fedlap_privacy.compute.per_sample) and the DP mechanism (fl.methods.dp),
docs/accounting.md#sampled-gaussian-mechanism."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlap_privacy.compute.per_sample import (
    hooks_supported,
    per_sample_grad_norms,
    per_sample_grads,
    per_sample_losses,
)
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.methods.dp import (
    add_gaussian_noise,
    clip_and_noise,
    dp_gradient,
    poisson_sample,
)
from fedlap_privacy.models import ModelConfig, build_model


def _data(n: int, channels: int, size: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, channels, size, size, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y


def _naive(model: nn.Module, x: Tensor, y: Tensor) -> list[Tensor]:
    """One backward per record: the definition of a per-record gradient."""
    params = list(model.parameters())
    rows: list[list[Tensor]] = [[] for _ in params]
    for i in range(x.shape[0]):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        for row, g in zip(rows, torch.autograd.grad(loss, params), strict=True):
            row.append(g)
    return [torch.stack(r) for r in rows]


def _assert_lists_close(a: list[Tensor], b: list[Tensor], atol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        assert u.shape == v.shape
        torch.testing.assert_close(u, v, atol=atol, rtol=1e-4)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models: one thread is faster and immune to OpenMP stalls on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def small() -> nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(1, 8, 10, width=16))


@pytest.mark.parametrize("method", ["auto", "hooks", "vmap"])
def test_per_sample_grads_match_naive_loop(small: nn.Module, method: str) -> None:
    x, y = _data(12, 1, 8)
    got = per_sample_grads(small, x, y, method=method)  # type: ignore[arg-type]
    _assert_lists_close(got, _naive(small, x, y))


def test_per_sample_grads_28x28_rgb_and_chunks() -> None:
    torch.manual_seed(1)
    model = build_model(ModelConfig(1, 28, 10, width=8))
    x, y = _data(6, 1, 28)
    assert hooks_supported(model)
    naive = _naive(model, x, y)
    _assert_lists_close(per_sample_grads(model, x, y), naive)
    _assert_lists_close(per_sample_grads(model, x, y, chunk_size=4), naive)
    rgb = build_model(ModelConfig(3, 32, 10, width=8))
    xr, yr = _data(3, 3, 32)
    _assert_lists_close(per_sample_grads(rgb, xr, yr), _naive(rgb, xr, yr))


def test_per_sample_grads_fallback_and_grouped_conv() -> None:
    torch.manual_seed(2)
    inplace = nn.Sequential(  # ReLU(inplace=True) modifies a recorded output: falls back
        nn.Conv2d(2, 4, 3, padding=1, groups=2),
        nn.GroupNorm(2, 4),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 10),
    )
    x, y = _data(5, 2, 5)
    _assert_lists_close(per_sample_grads(inplace, x, y), _naive(inplace, x, y))
    with pytest.raises(ConfigError):
        per_sample_grads(inplace, x, y, method="hooks")
    strided = nn.Sequential(
        nn.Conv2d(2, 6, 3, stride=2, groups=2), nn.Flatten(), nn.Linear(6 * 2 * 2, 10)
    )
    _assert_lists_close(per_sample_grads(strided, x, y, method="hooks"), _naive(strided, x, y))

    class Unused(nn.Module):  # a layer called but not used by the loss gets zero gradients
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(50, 10), nn.Linear(50, 3)

        def forward(self, x: Tensor) -> Tensor:
            self.unused(x.flatten(1))
            return self.used(x.flatten(1))

    unused = Unused()
    hooked = per_sample_grads(unused, x, y, method="hooks")
    _assert_lists_close(hooked, per_sample_grads(unused, x, y, method="vmap"))
    assert hooked[2].abs().sum() == 0
    batchnorm = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4))
    assert not hooks_supported(batchnorm)


def test_model_left_unchanged(small: nn.Module) -> None:
    before = {k: v.clone() for k, v in small.state_dict().items()}
    x, y = _data(4, 1, 8)
    per_sample_grads(small, x, y)
    dp_gradient(small, x, y, 1.0, 1.0, 4.0, torch.Generator().manual_seed(0))
    for module in small.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert not module._backward_hooks
    assert all(p.grad is None for p in small.parameters())
    assert all(p.requires_grad for p in small.parameters())
    for k, v in small.state_dict().items():
        assert torch.equal(v, before[k])


def test_norms_and_losses(small: nn.Module) -> None:
    x, y = _data(10, 1, 8)
    naive = _naive(small, x, y)
    expect = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in naive))
    torch.testing.assert_close(per_sample_grad_norms(small, x, y, batch_size=3), expect)
    losses = F.cross_entropy(small(x), y, reduction="none").detach()
    torch.testing.assert_close(per_sample_losses(small, x, y, batch_size=4), losses)
    assert per_sample_losses(small, x[:0], y[:0]).shape == (0,)


def test_clip_and_noise_without_noise_is_clipped_sum(small: nn.Module) -> None:
    x, y = _data(9, 1, 8)
    grads = _naive(small, x, y)
    clip, b = 4.0, 7.0
    out = clip_and_noise(grads, clip, 0.0, b, None)
    flat = torch.cat([g.flatten(1) for g in grads], dim=1)
    norms = flat.norm(dim=1)
    assert (norms > clip).any() and (norms < clip).any()  # both branches are exercised
    clipped = [flat[i] * min(1.0, clip / (norms[i].item() + 1e-6)) for i in range(9)]
    assert all(c.norm() <= clip + 1e-7 for c in clipped)
    expect = torch.stack(clipped).sum(0) / b
    torch.testing.assert_close(torch.cat([o.flatten() for o in out]), expect)
    # Clipping is by the norm over ALL parameters: a record's total contribution is <= C / B.
    for i in range(9):
        one = clip_and_noise([g[i : i + 1] for g in grads], clip, 0.0, 1.0, None)
        assert torch.cat([o.flatten() for o in one]).norm() <= clip + 1e-6


def test_noise_std_is_sigma_clip_over_b() -> None:
    n, clip, sigma, b = 200_000, 0.7, 1.3, 64.0
    zero = [torch.zeros(3, n // 2), torch.zeros(3, n // 2)]
    out = clip_and_noise(zero, clip, sigma, b, torch.Generator().manual_seed(3))
    z = torch.cat([o.flatten() for o in out]).double() / (sigma * clip / b)
    # sum z^2 ~ chi2(n): mean n, sd sqrt(2n); the mean of z ~ N(0, 1/n). 5-sigma bounds.
    assert abs(z.square().sum().item() - n) < 5 * math.sqrt(2 * n)
    assert abs(z.mean().item()) < 5 / math.sqrt(n)


def test_empty_batch_is_pure_noise(small: nn.Module) -> None:
    x, y = _data(0, 1, 8)
    sigma, clip, b = 2.0, 0.5, 10.0
    out = dp_gradient(small, x, y, clip, sigma, b, torch.Generator().manual_seed(4))
    shapes = [p.shape for p in small.parameters()]
    assert [o.shape for o in out] == shapes
    ref = torch.Generator().manual_seed(4)
    noise = [torch.randn(s, generator=ref) * sigma * clip / b for s in shapes]
    _assert_lists_close(out, noise, atol=1e-7)
    silent = dp_gradient(small, x, y, clip, 0.0, b, None)
    assert all(torch.count_nonzero(o) == 0 for o in silent)


def test_dp_gradient_reproducible_and_matches_naive(small: nn.Module) -> None:
    x, y = _data(8, 1, 8)
    first = dp_gradient(small, x, y, 0.1, 1.0, 8.0, torch.Generator().manual_seed(5))
    again = dp_gradient(small, x, y, 0.1, 1.0, 8.0, torch.Generator().manual_seed(5))
    other = dp_gradient(small, x, y, 0.1, 1.0, 8.0, torch.Generator().manual_seed(6))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    exact = dp_gradient(small, x, y, 0.1, 0.0, 8.0, None)
    _assert_lists_close(exact, clip_and_noise(_naive(small, x, y), 0.1, 0.0, 8.0, None))
    # chunks change the memory held and the order of the additions only: each record is
    # still clipped on its own (clip 0.1 clips every record here), the noise drawn once
    for chunk in (1, 3, None):
        chunked = dp_gradient(
            small, x, y, 0.1, 1.0, 8.0, torch.Generator().manual_seed(5), chunk_size=chunk
        )
        _assert_lists_close(chunked, first)


def test_invalid_arguments(small: nn.Module) -> None:
    x, y = _data(2, 1, 8)
    for clip, sigma, b in [(0.0, 1.0, 1.0), (1.0, -1.0, 1.0), (1.0, 1.0, 0.0)]:
        with pytest.raises(ConfigError):
            dp_gradient(small, x, y, clip, sigma, b, None)
    with pytest.raises(ConfigError):
        dp_gradient(small, x, y, 1.0, 1.0, 1.0, None, chunk_size=0)
    with pytest.raises(ConfigError):
        poisson_sample(10, 1.5, torch.Generator())
    with pytest.raises(ConfigError):
        per_sample_grads(small, x, y[:1])


def test_poisson_sample_size_and_independence() -> None:
    g = torch.Generator().manual_seed(7)
    n, q, trials = 40, 0.3, 4000
    hits = torch.zeros(trials, n)
    for t in range(trials):
        idx = poisson_sample(n, q, g)
        assert idx.dtype == torch.int64
        assert torch.equal(idx, idx.sort().values) and idx.unique().numel() == idx.numel()
        hits[t, idx] = 1.0
    # Batch size ~ Binomial(n, q): the mean over trials within 5 standard errors.
    sizes = hits.sum(1)
    assert abs(sizes.mean().item() - n * q) < 5 * math.sqrt(n * q * (1 - q) / trials)
    assert abs(sizes.var().item() - n * q * (1 - q)) < 0.15 * n * q * (1 - q)
    # Each record included w.p. q; pairs w.p. q^2 (independence), within 5 standard errors.
    marg = hits.mean(0)
    assert (marg - q).abs().max().item() < 5 * math.sqrt(q * (1 - q) / trials)
    pair = (hits.T @ hits) / trials
    off = pair[~torch.eye(n, dtype=torch.bool)]
    assert abs(off.mean().item() - q * q) < 0.01
    assert (off - q * q).abs().max().item() < 6 * math.sqrt(q * q * (1 - q * q) / trials)


def test_poisson_sample_edges() -> None:
    g = torch.Generator().manual_seed(8)
    assert poisson_sample(0, 0.5, g).numel() == 0
    assert poisson_sample(100, 0.0, g).numel() == 0
    assert torch.equal(poisson_sample(5, 1.0, g), torch.arange(5))
    a = poisson_sample(1000, 0.1, torch.Generator().manual_seed(9))
    b = poisson_sample(1000, 0.1, torch.Generator().manual_seed(9))
    assert torch.equal(a, b)


def test_add_gaussian_noise_is_the_one_draw_every_mechanism_makes():
    """The shared noise function: std 0 draws nothing, a bad std is refused, and the draw has
    the stated standard deviation (a halved or skipped noise would fail the band)."""
    t = torch.zeros(200_000, dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    assert add_gaussian_noise(t, 0.0, gen) is t
    assert gen.initial_seed() == 3 and torch.equal(
        gen.get_state(), torch.Generator().manual_seed(3).get_state())
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError):
            add_gaussian_noise(t, bad, gen)
    noisy = add_gaussian_noise(t + 5.0, 2.5, gen)
    assert abs(float(noisy.mean()) - 5.0) < 0.05
    assert abs(float(noisy.std()) - 2.5) < 0.02
