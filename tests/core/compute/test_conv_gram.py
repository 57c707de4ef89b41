"""Per-record weight-gradient norms from pixel Gram matrices
(fedlap_privacy.compute.conv_gram).

The oracle is the per-record gradient itself (torch's weight-gradient convolution, record
by record): the squared norms must equal its squared norms to 1e-12 in float64, on the
ConvNet's shapes and on odd ones (padding 0, 2 and 3, dilation, 1x1 and 5x5 kernels,
non-square maps).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedlap_privacy.compute import conv_gram
from fedlap_privacy.compute.conv_gram import PixelGeometry, conv_weight_grad_sq

# (records, input channels, output channels, height, width, kernel, padding, dilation)
SHAPES = [
    (6, 128, 128, 16, 16, 3, 1, 1),  # the ConvNet's second convolution
    (7, 128, 128, 8, 8, 3, 1, 1),  # and its third
    (4, 1, 16, 12, 12, 3, 3, 1),  # padding 3: the output is larger than the input
    (3, 5, 7, 6, 9, 5, 2, 1),  # 5x5, non-square
    (5, 6, 4, 7, 5, 3, 0, 1),  # no padding: the output is smaller
    (3, 4, 6, 9, 8, 3, 2, 2),  # dilation 2
    (4, 8, 3, 5, 6, 1, 0, 1),  # 1x1
]


def _direct_sq(conv: nn.Conv2d, x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """Each record's weight gradient through torch, squared and summed."""
    rows = []
    for xi, gi in zip(x, gy, strict=True):
        gw = torch.ops.aten.convolution_backward(
            gi[None], xi[None], conv.weight, None, list(conv.stride), list(conv.padding),
            list(conv.dilation), False, [0, 0], 1, [False, True, False])[1]
        rows.append(gw.square().sum())
    return torch.stack(rows)


def _case(shape, dtype):
    n, c_in, c_out, h, w, k, pad, dil = shape
    conv = nn.Conv2d(c_in, c_out, k, padding=pad, dilation=dil).to(dtype)
    x = torch.randn(n, c_in, h, w, dtype=dtype).relu()
    with torch.no_grad():
        gy = torch.randn_like(conv(x))
    geometry = PixelGeometry.of(conv, x, gy)
    assert geometry is not None
    return conv, x, gy, geometry


@pytest.mark.parametrize("shape", SHAPES)
def test_the_pixel_gram_norms_equal_the_gradients_norms(shape):
    torch.manual_seed(0)
    conv, x, gy, geometry = _case(shape, torch.float64)
    got = conv_weight_grad_sq(x, gy, geometry)
    want = _direct_sq(conv, x, gy)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-12)


def test_float32_and_record_blocks(monkeypatch):
    torch.manual_seed(1)
    conv, x, gy, geometry = _case(SHAPES[0], torch.float32)
    want = _direct_sq(conv.double(), x.double(), gy.double())
    whole = conv_weight_grad_sq(x, gy, geometry)
    torch.testing.assert_close(whole.double(), want, atol=0, rtol=1e-5)
    # two Gram matrices of 256 x 256 per record: blocks of 2 records, the last one short
    monkeypatch.setattr(conv_gram, "_BLOCK_SCALARS", 2 * 2 * 256 * 256)
    assert torch.equal(conv_weight_grad_sq(x, gy, geometry), whole)


def test_geometries_the_identity_does_not_cover_are_refused():
    x = torch.zeros(2, 4, 8, 8)
    for conv in (nn.Conv2d(4, 4, 3, stride=2), nn.Conv2d(4, 4, 3, groups=2),
                 nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"),
                 nn.Conv2d(4, 4, 3, padding="same")):
        with torch.no_grad():
            assert PixelGeometry.of(conv, x, conv(x)) is None
