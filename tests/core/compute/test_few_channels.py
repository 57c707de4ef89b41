"""The first convolution of images through the C kernels
(fedlap_privacy.compute.kernels.few_channels).

The oracle is torch's convolution, its input gradient and each record's weight gradient
(one record at a time through torch's weight-gradient convolution): in float64 the kernels must give
their results to 1e-12 of the output's scale, on the ConvNet's shapes (28x28 grey images
with padding 3, 32x32 colour images with padding 1) and on odd ones (no padding, maps
narrower and wider than a vector block, non-square), and the package's convolution and
matching step must take them exactly where they apply.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedlap_privacy.compute import fast_paths, second_order
from fedlap_privacy.compute.kernels import few_channels, winograd
from fedlap_privacy.models import ModelConfig, build_model

# (records, channels, height, width, padding)
SHAPES = [(3, 1, 28, 28, 3), (2, 3, 32, 32, 1), (2, 2, 7, 5, 0), (1, 1, 9, 40, 2)]


@pytest.fixture(autouse=True)
def _kernels():
    if not fast_paths.current().kernels:
        pytest.skip("the kernels are switched off (FEDLAP_KERNELS, FEDLAP_FAST_PATHS)")


def _torch(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.convolution(x, conv.weight, conv.bias, [1, 1], list(conv.padding),
                                      [1, 1], False, [0, 0], 1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_gives_torchs_convolution(shape, dtype):
    n, c, h, w, pad = shape
    torch.manual_seed(n * h + w)
    conv = nn.Conv2d(c, 16, 3, padding=pad).to(dtype).requires_grad_(False)
    x = torch.randn(n, c, h, w, dtype=dtype)
    assert few_channels.applies(x, conv.weight, conv)
    got = few_channels.conv(x, conv.weight, conv.bias, (pad, pad))
    want = _torch(conv, x)
    scale = want.abs().max().item()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, atol=tol * scale, rtol=0)


def test_the_package_convolution_takes_it_where_it_applies(monkeypatch):
    calls = []
    real = few_channels.conv
    monkeypatch.setattr(few_channels, "conv", lambda *a: calls.append(1) or real(*a))
    grey = nn.Conv2d(1, 8, 3, padding=3).requires_grad_(False)
    x = torch.randn(2, 1, 28, 28)
    y = winograd.conv2d(grey, x, grey.weight, grey.bias)
    assert len(calls) == 1 and y.shape == (2, 8, 32, 32)
    for other in (nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(1, 8, 5, padding=2),
                  nn.Conv2d(1, 8, 3, stride=2),
                  nn.Conv2d(1, 8, 3, padding=1, padding_mode="reflect")):
        other.requires_grad_(False)
        inputs = torch.randn(2, other.in_channels, 12, 12)
        winograd.conv2d(other, inputs, other.weight, other.bias)
    assert len(calls) == 1
    with fast_paths.using(kernels=False):
        winograd.conv2d(grey, x, grey.weight, grey.bias)
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_input_gradient_sums_torchs_of_each_pair(shape, dtype):
    n, c, h, w, pad = shape
    torch.manual_seed(n * h + w)
    ho, wo = h + 2 * pad - 2, w + 2 * pad - 2
    pairs = [(torch.randn(n, c_out, ho, wo, dtype=dtype), torch.randn(c_out, c, 3, 3, dtype=dtype))
             for c_out in (16, 5)]
    got = few_channels.input_grad_sum(pairs, (pad, pad), (h, w))
    want = sum(torch.nn.grad.conv2d_input((n, c, h, w), weight, gy, padding=pad)
               for gy, weight in pairs)
    scale = want.abs().max().item()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, atol=tol * scale, rtol=0)
    one = few_channels.input_grad_sum(pairs[:1], (pad, pad), (h, w))
    want_one = torch.nn.grad.conv2d_input((n, c, h, w), pairs[0][1], pairs[0][0], padding=pad)
    torch.testing.assert_close(one, want_one, atol=tol * scale, rtol=0)


def test_the_matching_step_takes_the_input_gradient_kernel(monkeypatch):
    calls = []
    real = few_channels.input_grad_sum
    monkeypatch.setattr(few_channels, "input_grad_sum",
                        lambda *a: calls.append(len(a[0])) or real(*a))
    model = build_model(ModelConfig(1, 28, 10)).double()
    x, y = torch.randn(4, 1, 28, 28, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    blocks = second_order.supported_blocks(model, x)
    assert blocks is not None
    got = second_order.weight_grad_input_vjp(model, blocks, x, y, lambda g: g)
    assert calls == [2]  # the image gradient: the block's two convolutions, summed
    leaf = x.clone().requires_grad_(True)
    params = list(model.parameters())
    with torch.enable_grad():
        grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(leaf), y), params,
                                    create_graph=True)
        want = torch.autograd.grad(sum((g * g.detach()).sum() for g in grads), [leaf])[0]
    torch.testing.assert_close(got, want, atol=1e-10 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_per_record_gradients_are_torchs_one_record_at_a_time(shape, dtype):
    n, c, h, w, pad = shape
    torch.manual_seed(n + h * w)
    weight = torch.randn(16, c, 3, 3, dtype=dtype)
    x = torch.randn(n, c, h, w, dtype=dtype)
    gy = torch.randn(n, 16, h + 2 * pad - 2, w + 2 * pad - 2, dtype=dtype)
    dw, db = few_channels.per_record_grads(x, gy, (pad, pad))
    want_w = torch.stack([torch.ops.aten.convolution_backward(
        gy[i:i + 1], x[i:i + 1], weight, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], 1,
        [False, True, False])[1] for i in range(n)])
    want_b = gy.sum(dim=(2, 3))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(dw, want_w, atol=tol * want_w.abs().max().item(), rtol=0)
    torch.testing.assert_close(db, want_b, atol=tol * want_b.abs().max().item(), rtol=0)
