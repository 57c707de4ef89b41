"""The package's matrix products on the Winograd tiles and pixel Gram matrices
(fedlap_privacy.kernels.tile_products).

The oracle is the same product in float64 through torch: float32 results must agree to
float32 rounding on the shapes of a round and on odd ones (rows not a multiple of the
kernel's 6, columns not a multiple of its 16), on one thread and on two, and a Winograd
convolution must give what it gives through torch's product.
"""

from __future__ import annotations

import pytest
import torch

from fedlap_privacy import fast_paths
from fedlap_privacy.kernels import tile_products, winograd

pytestmark = pytest.mark.skipif(
    not tile_products.native(torch.zeros(1)),
    reason="the tile products need float32 kernels compiled with AVX2 and FMA")


@pytest.mark.parametrize(("rows", "points", "k", "n"), [
    (320, 36, 128, 128),  # a matching step's 16x16 convolution
    (2048, 36, 128, 128),  # a DP chunk's
    (13, 36, 128, 128),  # rows not a multiple of 6
    (7, 4, 5, 20),  # columns not a multiple of 16
    (1, 2, 3, 8),  # fewer columns than a register
])
def test_products_equal_the_exact_product(rows, points, k, n):
    torch.manual_seed(rows)
    tiles, weights = torch.randn(rows, points, k), torch.randn(points, k, n)
    out = torch.full((rows, points, n), float("nan"))
    tile_products.products(tiles, tile_products.pack(weights), out)
    want = torch.einsum("rpk,pkn->rpn", tiles.double(), weights.double())
    torch.testing.assert_close(out.double(), want, atol=1e-5 * want.abs().max().item(),
                               rtol=1e-5)


def test_packed_panels_hold_sixteen_columns_each_zero_padded():
    weights = torch.arange(2 * 3 * 20, dtype=torch.float32).view(2, 3, 20)
    packed = tile_products.pack(weights)
    assert packed.shape == (2, 2, 3, 16) and packed.is_contiguous()
    assert torch.equal(packed[1, 0, 2], weights[1, 2, :16])
    assert torch.equal(packed[1, 1, 2, :4], weights[1, 2, 16:])
    assert not packed[:, 1, :, 4:].any()


def test_operands_that_do_not_fit_are_refused():
    tiles, out = torch.randn(6, 36, 8), torch.empty(6, 36, 16)
    with pytest.raises(ValueError, match="do not fit"):
        tile_products.products(tiles, torch.randn(36, 8, 16), out)  # not packed


def test_two_threads_compute_what_one_does():
    torch.manual_seed(1)
    tiles, weights = torch.randn(640, 36, 128), torch.randn(36, 128, 128)
    x = torch.randn(64, 128, 256)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            out = torch.empty(640, 36, 128)
            tile_products.products(tiles, tile_products.pack(weights), out)
            results.append((out, tile_products.gram_upper(x, 16)))
    finally:
        torch.set_num_threads(threads)
    rows = torch.arange(256) // 16
    upper = rows[:, None] <= rows[None, :]
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1][:, upper], results[1][1][:, upper])


@pytest.mark.parametrize(("records", "channels", "height", "width"), [
    (9, 128, 16, 16),  # the ConvNet's 16x16 maps
    (5, 128, 8, 8),  # its 8x8 maps
    (3, 7, 7, 7),  # 49 positions: the last column block is masked
    (2, 3, 5, 12),  # rows of 12: image rows straddle the blocks of 16
])
def test_the_gram_blocks_on_and_above_the_diagonal_are_exact(records, channels, height,
                                                              width):
    torch.manual_seed(records)
    x = torch.randn(records, channels, height * width)
    q = tile_products.gram_upper(x, width)
    want = torch.bmm(x.double().transpose(1, 2), x.double())
    rows = torch.arange(height * width) // width
    upper = rows[:, None] <= rows[None, :]
    torch.testing.assert_close(q[:, upper].double(), want[:, upper],
                               atol=1e-5 * want.abs().max().item(), rtol=1e-5)


def test_a_winograd_convolution_takes_the_kernel_and_gives_torchs_result(monkeypatch):
    torch.manual_seed(2)
    x, weight = torch.randn(20, 128, 16, 16), torch.randn(128, 128, 3, 3) / 30
    gy = torch.randn(20, 128, 16, 16)
    calls = []
    real = tile_products.products
    monkeypatch.setattr(tile_products, "products", lambda *a: calls.append(1) or real(*a))
    with fast_paths.using(winograd=True, tile_products=True):
        y = winograd.conv(x, weight)
        dx, _ = winograd.conv_backward(gy, x, weight, (True, False))
    assert len(calls) == 2
    with fast_paths.using(winograd=True, tile_products=False):
        y_torch = winograd.conv(x, weight)
        dx_torch, _ = winograd.conv_backward(gy, x, weight, (True, False))
    assert len(calls) == 2  # switched off: torch's product
    torch.testing.assert_close(y, y_torch, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, dx_torch, atol=1e-5, rtol=1e-5)


def test_double_precision_and_the_switch_take_torchs_product():
    assert not tile_products.native(torch.zeros(1, dtype=torch.float64))
    with fast_paths.using(tile_products=False):
        assert not tile_products.native(torch.zeros(1))
    with fast_paths.using(kernels=False):
        assert not tile_products.native(torch.zeros(1))
