"""Matrix products of the Winograd tiles and the pixel Gram matrices, on the CPU, without
packing their operands (``tile_products.c``; the ``tile_products`` fast path of
:mod:`fedlap_privacy.fast_paths`).

torch's batched product (MKL's ``sgemm`` on the CPU) copies each operand into packed panels
before it multiplies, and zeroes the result before it adds into it. The transforms already
write each tile's channels contiguously, so the kernel here reads them as they lie: for
each block of 6 tiles it runs all 36 points of F(4x4, 3x3), 6 x 16 results in registers at
a time. On one core of the 2-core AMD EPYC (AVX2) machine of the measurements a DP chunk's
products (2,048 tiles a point, 128 channels) ran at 65 to 73 GFLOP/s on a quiet hour against
MKL's 44 to 55, and the round's shapes 1.00 to 1.37 times MKL's speed on a busy one; a DP
chunk's pixel Gram matrices 1.4 to 1.6 times faster, computing only the blocks that
:mod:`fedlap_privacy.kernels.conv_gram` reads of the symmetric matrix
(``benchmarks/tile_products.py``); the ghost norms form them one record at a time and read
them while they are in the second-level cache (``gram_norms``). The kernel matrices come
packed in panels of 16 columns (:func:`pack`, once per transform of a kernel), so that
the kernel, which reads them again for every 6 tiles, reads each panel as one contiguous
run: the products ran 10 to 16% faster alone, a real batch of five clients side by side
about 2% faster. The results equal a float64 product to float32 rounding
(``tests/core/test_tile_products.py``). Sums of two products stay with torch's
(:mod:`fedlap_privacy.kernels.winograd` says why).

It runs for float32 where the kernels were compiled for a processor with AVX2 and FMA
(:func:`native`); elsewhere, and with the path off, the callers take ``torch.bmm``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from fedlap_privacy import fast_paths
from fedlap_privacy.kernels.block import fusable, run_split
from fedlap_privacy.kernels.build import KernelLibrary, load_kernels

__all__ = ["PANEL", "gram_upper", "native", "pack", "products"]

#: the columns of a packed panel of kernel matrices (the kernel's 16-wide register block)
PANEL = 16


@functools.cache
def _native_in(library: KernelLibrary, dtype: torch.dtype) -> bool:
    suffix = {torch.float32: "_f32", torch.float64: "_f64"}[dtype]
    return library.function("tile_products_native", suffix)() == 1


def native(*tensors: Tensor) -> bool:
    """Whether the products of these tensors run here: the ``tile_products`` fast path is on,
    the kernels take them (:func:`~fedlap_privacy.kernels.block.fusable`) and were compiled
    with AVX2 and FMA for their type (float32 only)."""
    if not fast_paths.current().effective().tile_products or not fusable(*tensors):
        return False
    library = load_kernels()
    return library is not None and _native_in(library, tensors[0].dtype)


def pack(weights: Tensor) -> Tensor:
    """Kernel matrices ``(P, K, N)`` as :func:`products` takes them: ``(P, J, K, PANEL)``,
    panel ``j`` holding columns ``PANEL j`` to ``PANEL (j + 1) - 1`` (zeros past ``N``)."""
    points, k, n = weights.shape
    panels = -(-n // PANEL)
    padded = weights if n == panels * PANEL else torch.nn.functional.pad(
        weights, (0, panels * PANEL - n))
    return padded.contiguous().view(points, k, panels, PANEL).permute(0, 2, 1, 3).contiguous()


def products(tiles: Tensor, weights: Tensor, out: Tensor) -> None:
    """``out[i, p] = tiles[i, p] @ W[p]``: tiles ``(R, P, K)`` and ``out`` ``(R, P, N)``
    contiguous, ``weights`` the kernel matrices ``W`` ``(P, K, N)`` packed by :func:`pack`;
    callers check :func:`native` first."""
    tiles, weights = tiles.contiguous(), weights.contiguous()
    rows, points, n = out.shape
    k = tiles.shape[2]
    if (tuple(tiles.shape) != (rows, points, k)
            or tuple(weights.shape) != (points, -(-n // PANEL), k, PANEL)):
        raise ValueError("products: the tiles, weights and output do not fit together")
    run_split("tile_products", out.dtype, rows, out.numel(),
              (tiles.data_ptr(), weights.data_ptr(), points, k, n), (out.data_ptr(),))


def gram_upper(x: Tensor, width: int) -> Tensor:
    """``x[n]^T x[n]`` for ``x`` ``(N, C, T)`` (T positions of rows of ``width``), as
    ``(N, T, T)``, written only on and above the diagonal blocks of ``width`` x ``width``
    (image rows): the entries :mod:`fedlap_privacy.kernels.conv_gram` reads. Callers check
    :func:`native` first."""
    x = x.contiguous()
    n, c, t = x.shape
    q = x.new_empty(n, t, t)
    run_split("gram_upper", x.dtype, n, q.numel(), (x.data_ptr(), c, t, width),
              (q.data_ptr(),))
    return q
