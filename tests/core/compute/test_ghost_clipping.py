"""The clipped sum from gradient norms (fedlap_privacy.compute.ghost_clipping) equals the per-record
path's and Opacus' fast gradient clipping (ghost clipping), up to rounding.

Clip bounds sit at the median record norm, so that some records are clipped and some not:
a wrong norm moves the factors and the sum.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from torch import Tensor, nn

from fedlap_privacy.compute import fast_paths, ghost_clipping
from fedlap_privacy.compute.conv_gram import PixelGeometry
from fedlap_privacy.compute.per_sample import per_sample_grad_norms, per_sample_grads
from fedlap_privacy.fl.methods.dp import clip_factors, clipped_sum, dp_gradient
from fedlap_privacy.models import ModelConfig, TabularMLP, build_model


def _opacus_ghost_sum(model: nn.Module, x: Tensor, y: Tensor, clip: float) -> list[Tensor]:
    """Opacus' two-backward ghost clipping (DPTensorFastGradientClipping.backward)."""
    gsm = GradSampleModuleFastGradientClipping(copy.deepcopy(model), max_grad_norm=clip,
                                               use_ghost_clipping=True, loss_reduction="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus: full backward hook with an input w/o grad
        losses = F.cross_entropy(gsm(x), y, reduction="none")
        losses.sum().backward(retain_graph=True)
        coeff = gsm.get_clipping_coef()
        for p in gsm.parameters():
            p.grad = None
        gsm.disable_hooks()
        (coeff * losses).sum().backward()
        gsm.enable_hooks()
    return [p.grad for p in gsm.parameters()]


class _SequenceMLP(nn.Module):
    """A Linear on 4 positions of 8 features (ghost norm by Gram matrices), a Linear on 4 x
    256 -> 16 per position (formed per-record gradients), then a classifier on one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.wide = nn.Linear(32, 256)
        self.narrow = nn.Linear(256, 16)
        self.classifier = nn.Linear(4 * 16, 5)

    def forward(self, x: Tensor) -> Tensor:
        h = self.narrow(torch.relu(self.wide(torch.relu(self.embed(x)))))
        return self.classifier(torch.relu(h).flatten(1))


class _StridedCNN(nn.Module):
    """A convolution with stride 2 (ghost norm by the unfolded columns' Gram matrices: the
    pixel identity needs stride 1) and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 64, 3, stride=2, padding=1)
        self.classifier = nn.Linear(64 * 16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.relu(self.conv(x)).flatten(1))


def _ghost(model: nn.Module, x: Tensor, y: Tensor, clip: float) -> list[Tensor]:
    out = ghost_clipping.ghost_clipped_sum(model, x, y, lambda n: clip_factors(n, clip))
    assert out is not None
    return out


def _median_norm(model: nn.Module, x: Tensor, y: Tensor) -> float:
    return float(per_sample_grad_norms(model, x, y).median())


def _assert_close(got: list[Tensor], want: list[Tensor], rtol: float) -> None:
    scale = max(w.abs().max().item() for w in want)
    assert scale > 0
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert (g - w).abs().max().item() <= rtol * scale


CASES = {
    # 8x8 ConvNet: the second convolution (4x4 maps) takes the pixel Gram route
    "convnet-8x8": (lambda: build_model(ModelConfig(1, 8, 10, width=32, depth=2)),
                    (12, 1, 8, 8), 10),
    # the FedLAP-DP model at 28x28: the 16x16 and 8x8 convolutions take the pixel Gram route;
    # 8 records put the 16x16 convolution through Winograd's F(4x4, 3x3) on up to 2 threads
    "convnet-28x28": (lambda: build_model(ModelConfig(1, 28, 10)), (8, 1, 28, 28), 10),
    "strided-cnn": (_StridedCNN, (10, 4, 8, 8), 3),
    "tabular-mlp": (lambda: TabularMLP(20, 3), (16, 20), 3),
    "sequence-mlp": (_SequenceMLP, (10, 4, 8), 5),
}


# every case with the fast paths on (the fused ConvNet pass) and off (the hook path); the
# 8x8 ConvNet covers the hook path's convolutions, so the 28x28 one runs fused only (time)
RUNS = [pytest.param(name, fast, id=f"{name}-{'fast' if fast else 'all-off'}")
        for name in CASES for fast in (True, False) if fast or name != "convnet-28x28"]


@pytest.mark.parametrize(("name", "fast"), RUNS)
def test_the_ghost_sum_equals_per_record_clipping_and_opacus(name, fast):
    build, shape, classes = CASES[name]
    torch.manual_seed(0)
    model = build().double()
    x = torch.randn(shape, dtype=torch.float64)
    y = torch.randint(0, classes, (shape[0],))
    paths = fast_paths.FastPaths() if fast else fast_paths.FastPaths.all_off()
    with fast_paths.using(paths, ghost_clipping=True):
        clip = _median_norm(model, x, y)
        ghost = _ghost(model, x, y, clip)
        per_record = clipped_sum(per_sample_grads(model, x, y), clip)
    _assert_close(ghost, per_record, 1e-10)
    _assert_close(ghost, _opacus_ghost_sum(model, x, y, clip), 1e-10)
    # no record clipped: the plain batch gradient
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction="sum").backward()
    with fast_paths.using(paths):
        unclipped = _ghost(model, x, y, 1e6)
    _assert_close(unclipped, [p.grad for p in model.parameters()], 1e-10)


def test_each_convolution_takes_its_cheapest_norm_route(monkeypatch):
    seen: dict[int, object] = {}
    route = ghost_clipping._conv_norm_route

    def spy(module, inp, gy):
        seen[gy.shape[-1]] = chosen = route(module, inp, gy)
        return chosen

    monkeypatch.setattr(ghost_clipping, "_conv_norm_route", spy)
    _ghost(build_model(ModelConfig(1, 28, 10)), torch.randn(2, 1, 28, 28),
           torch.tensor([0, 1]), 1.0)
    # 32x32 maps of one input channel: the gradient (1,024 * 9 * 128 multiply-adds) is
    # cheapest; 16x16 and 8x8 maps of 128 channels: the pixel Gram matrices
    assert seen[32] == "gradient"
    assert isinstance(seen[16], PixelGeometry) and isinstance(seen[8], PixelGeometry)
    seen.clear()
    _ghost(_StridedCNN(), torch.randn(2, 4, 8, 8), torch.tensor([0, 1]), 1.0)
    assert seen == {4: "columns"}  # stride 2: 16 * 16 * (36 + 64) < 16 * 36 * 64


def test_dp_gradient_takes_the_ghost_path_and_equals_the_per_record_path(monkeypatch):
    torch.manual_seed(1)
    model = build_model(ModelConfig(1, 8, 10, width=32, depth=2))
    x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 10, (40,))
    clip = _median_norm(model, x, y)
    calls = []
    real = ghost_clipping.ghost_clipped_sum
    monkeypatch.setattr("fedlap_privacy.fl.methods.dp.ghost_clipped_sum",
                        lambda *a: calls.append(1) or real(*a))
    ghost = dp_gradient(model, x, y, clip, 0.0, 40.0, None, chunk_size=16)
    assert len(calls) == 3  # one per chunk
    with fast_paths.disabled("ghost-clipping"):
        per_record = dp_gradient(model, x, y, clip, 0.0, 40.0, None, chunk_size=16)
    assert len(calls) == 3
    _assert_close(ghost, per_record, 1e-5)
    # the noise is the same draw on either path
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    noisy = dp_gradient(model, x, y, clip, 1.0, 40.0, gen_a)
    with fast_paths.disabled("ghost-clipping"):
        noisy_ref = dp_gradient(model, x, y, clip, 1.0, 40.0, gen_b)
    _assert_close(noisy, noisy_ref, 1e-5)


def test_models_the_ghost_path_does_not_take_fall_back_to_per_record_gradients():
    class Shared(nn.Module):  # one Linear called twice: per-record norms are not additive
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)
            self.out = nn.Linear(6, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.out(self.lin(torch.relu(self.lin(x))))

    inplace = nn.Sequential(nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 3))
    embedding = nn.Sequential(nn.Flatten(), nn.Linear(6, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    for model in (Shared(), inplace, embedding):
        assert ghost_clipping.ghost_clipped_sum(model, x, y, lambda n: n) is None
        with fast_paths.using(ghost_clipping=True):
            got = dp_gradient(model, x, y, 0.5, 0.0, 5.0, None)
        want = [t / 5.0 for t in clipped_sum(per_sample_grads(model, x, y), 0.5)]
        _assert_close(got, want, 1e-6)


def test_an_empty_batch_sums_to_zero():
    model = TabularMLP(4, 2)
    out = ghost_clipping.ghost_clipped_sum(model, torch.zeros(0, 4),
                                           torch.zeros(0, dtype=torch.int64), lambda n: n)
    assert out is not None and all(not t.any() for t in out)
    assert [t.shape for t in out] == [p.shape for p in model.parameters()]
