"""Winograd's F(4x4, 3x3) convolutions (fedlap_privacy.compute.kernels.winograd).

torch's convolution is the oracle: the forward, the input gradient and the weight gradient
must equal it to 1e-12 in float64 (exact arithmetic gives the same function) and to
F(4x4, 3x3)'s float32 rounding (about 1e-5 of the output's scale) in float32, on the shapes
the ConvNet makes and on odd ones (non-square maps, more input than output channels,
stacked operands, a bias). Where the transform does not hold or does not pay (stride,
padding, dilation, groups, maps not a multiple of 4, few channels or tiles, the path
switched off) :func:`applies` says no and :func:`conv2d` / :func:`conv2d_backward` give
torch's result exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.fast_paths import FAST_PATHS_ENV, FastPaths
from fedlap_privacy.compute.kernels import winograd
from fedlap_privacy.compute.per_sample import per_sample_grads
from fedlap_privacy.models import ModelConfig, build_model

# (records, input channels, output channels, height, width)
SHAPES = [(5, 128, 128, 16, 16), (11, 128, 160, 8, 12), (32, 136, 128, 4, 8),
          (64, 128, 128, 4, 4), (16, 256, 128, 8, 8)]


@pytest.fixture(autouse=True)
def _kernels_on() -> Iterator[None]:
    """The path on, and one torch thread (the tile threshold is per thread)."""
    if not fast_paths.current().kernels:
        pytest.skip("the kernels are switched off (FEDLAP_KERNELS, FEDLAP_FAST_PATHS)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with fast_paths.using(winograd=True, require_kernels=True):
            yield
    finally:
        torch.set_num_threads(threads)


def _torch_backward(gy, x, w):
    return torch.ops.aten.convolution_backward(gy, x, w, None, [1, 1], [1, 1], [1, 1], False,
                                               [0, 0], 1, [True, True, False])[:2]


def _close(a, b, dtype):
    scale = b.abs().max().item()
    tol = 1e-12 if dtype == torch.float64 else 3e-5
    torch.testing.assert_close(a, b, atol=tol * scale, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_pass_equals_torchs_convolution(shape, dtype):
    n, c_in, c_out, h, w = shape
    g = torch.Generator().manual_seed(sum(shape))
    module = nn.Conv2d(c_in, c_out, 3, padding=1).to(dtype)
    x = torch.randn(n, c_in, h, w, generator=g, dtype=dtype)
    gy = torch.randn(n, c_out, h, w, generator=g, dtype=dtype)
    weight, bias = module.weight.detach(), module.bias.detach()
    assert winograd.applies(x, weight, module)
    _close(winograd.conv2d(module, x, weight, bias), F.conv2d(x, weight, bias, padding=1), dtype)
    dx, dw = winograd.conv2d_backward(module, gy, x, weight, (True, True))
    dx_ref, dw_ref = _torch_backward(gy, x, weight)
    _close(dx, dx_ref, dtype)
    _close(dw, dw_ref, dtype)
    only_dx, none = winograd.conv2d_backward(module, gy, x, weight, (True, False))
    assert none is None and torch.equal(only_dx, dx)


def test_the_work_splits_over_threads_without_changing_a_bit():
    g = torch.Generator().manual_seed(7)
    x, gy = torch.randn(9, 64, 16, 16, generator=g), torch.randn(9, 64, 16, 16, generator=g)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append((winograd.input_tiles(x).data, winograd.grad_tiles(gy).data))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("change", [
    {"stride": 2}, {"padding": 0}, {"padding": 2, "dilation": 2}, {"groups": 2},
    {"kernel_size": 5, "padding": 2}, {"padding_mode": "reflect"}, {"in_channels": 64},
    {"out_channels": 96}, {},
])
def test_where_the_transform_does_not_hold_torch_runs(change):
    args = {"in_channels": 128, "out_channels": 128, "kernel_size": 3, "padding": 1} | change
    module = nn.Conv2d(**args).double()
    x = torch.randn(16, args["in_channels"], 8, 8, dtype=torch.float64)
    assert winograd.applies(x, module.weight, module) == (change == {})
    if change and module.padding_mode == "zeros":  # {} is the control: the transform runs
        expected = F.conv2d(x, module.weight, module.bias, module.stride, module.padding,
                            module.dilation, module.groups)
        assert torch.equal(winograd.conv2d(module, x, module.weight, module.bias), expected)


def test_small_maps_and_batches_and_a_switched_off_path_run_torch():
    module = nn.Conv2d(128, 128, 3, padding=1).double()
    for n, h, w in ((16, 6, 8), (16, 8, 10), (15, 8, 8)):  # sides not multiples of 4; 60 tiles
        x = torch.randn(n, 128, h, w, dtype=torch.float64)
        assert not winograd.applies(x, module.weight, module)
    torch.set_num_threads(2)  # 64 tiles a thread
    assert not winograd.applies(torch.randn(16, 128, 8, 8), module.weight.float(), module)
    torch.set_num_threads(1)
    x = torch.randn(16, 128, 8, 8, dtype=torch.float64)
    gy = torch.randn(16, 128, 8, 8, dtype=torch.float64)
    assert winograd.applies(x, module.weight, module)
    with fast_paths.disabled("winograd"):
        assert not winograd.applies(x, module.weight, module)
        dx, dw = winograd.conv2d_backward(module, gy, x, module.weight, (True, True))
        assert dx is not None and dw is not None
        ref = _torch_backward(gy, x, module.weight.detach())
        assert torch.equal(dx, ref[0]) and torch.equal(dw, ref[1])
    with fast_paths.disabled("kernels"):
        assert not winograd.applies(x, module.weight, module)
    assert not FastPaths.from_env({FAST_PATHS_ENV: "-winograd"}).winograd


def test_the_convnets_convolutions_run_here_at_the_sizes_of_a_fedlap_round():
    """The 28x28 ConvNet's 16x16 and 8x8 convolutions take the transform for a DP chunk of
    128 records and a synthetic set of 20 images (so test_second_order's 128-channel
    configuration holds it to autograd); its first convolution (one image channel) does not."""
    model = build_model(ModelConfig(1, 28, 10))
    convs = [m for m in model.features if isinstance(m, nn.Conv2d)]
    for n in (128, 20):
        maps = [torch.randn(n, 1, 28, 28), torch.randn(n, 128, 16, 16), torch.randn(n, 128, 8, 8)]
        assert [winograd.applies(x, c.weight, c) for x, c in zip(maps, convs, strict=True)] == [
            False, True, True]


def test_a_hooked_convolution_still_runs_its_hooks_in_the_fused_pass():
    """Winograd computes the convolution without calling the module; where something hooks
    the module, the fused per-record pass calls it, so that the hook still sees its call."""
    model = build_model(ModelConfig(1, 28, 10))
    conv = model.features[4]
    assert isinstance(conv, nn.Conv2d)
    calls = []
    handle = conv.register_forward_hook(lambda *_: calls.append(1))
    try:
        x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
        grads = per_sample_grads(model, x, y, method="fused")
    finally:
        handle.remove()
    assert calls == [1] and grads[0].shape[0] == 8


def test_a_forward_without_autograd_takes_the_transform_and_keeps_the_hooks(monkeypatch):
    """Evaluation and attack scores (no autograd): the 128-channel convolutions run here, with
    the model's output up to rounding; a hooked convolution is still called (its hook
    runs), and with autograd on the module is called as before."""
    model = build_model(ModelConfig(1, 28, 10)).double()
    x = torch.randn(40, 1, 28, 28, dtype=torch.float64)
    with fast_paths.using(winograd=False):
        reference = model(x).detach()
    used = []
    real = winograd.conv
    monkeypatch.setattr(winograd, "conv", lambda *a: used.append(1) or real(*a))
    with torch.no_grad():
        _close(model(x), reference, torch.float64)
    assert len(used) == 2  # the 16x16 and 8x8 convolutions
    used.clear()
    model(x)  # autograd on: the modules themselves
    assert used == []
    calls = []
    handle = model.features[4].register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    assert calls == [1] and used == [1]  # the hooked one is called, the other transformed


def test_kernel_tiles_are_shared_within_the_block_while_the_parameter_stands():
    conv = nn.Conv2d(128, 128, 3, padding=1)
    plain = conv.weight.detach().clone()
    assert winograd.weight_tiles(conv.weight) is not winograd.weight_tiles(conv.weight)
    with winograd.shared_kernel_tiles():
        first = winograd.weight_tiles(conv.weight)
        assert winograd.weight_tiles(conv.weight) is first
        assert winograd.weight_tiles(plain) is not winograd.weight_tiles(plain)  # no parameter
        with torch.no_grad():
            conv.weight.mul_(2)  # the version counter moves: transformed again
        moved = winograd.weight_tiles(conv.weight)
        assert moved is not first
        torch.testing.assert_close(moved.forward, 2 * first.forward)
    assert winograd.weight_tiles(conv.weight) is not moved
