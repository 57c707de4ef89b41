"""3x3 convolutions (stride 1, padding 1) through Winograd's minimal filtering (Lavin &
Gray, "Fast Algorithms for Convolutional Neural Networks", CVPR 2016).

F(4x4, 3x3) computes each 4x4 output tile with 36 multiplications per channel pair instead
of 144: each 6x6 input tile ``d`` (stride 4) becomes ``B^T d B`` and each kernel ``w``
becomes ``G w G^T`` (``winograd.c`` spells out ``B``, ``G`` and ``A``); the sum over input
channels is then one matrix product per tile point (36 of them), and
``A^T m A`` turns each product back into a 4x4 output tile. The backward passes are the
adjoints of the same bilinear map, so they share its transforms: the output gradient's
tiles become ``A g A^T`` once and serve both the input gradient (``B D B^T``,
overlap-added) and the weight gradient (``G^T M G`` of the products summed over the tiles).
Per-record weight gradients (DP's) are left to the direct route: per record and point the
product sums over a record's few tiles (16 at 16x16), too few for a matrix product to run
fast; through F(2x2, 3x3), 64 tiles, it was still no faster than torch's grouped
convolution on this CPU.

The transforms are C kernels (:mod:`fedlap_privacy.compute.kernels.library`) on (N, C, H, W) maps;
the products are torch's batched matrix multiplication. Exact arithmetic gives the direct
convolution's result; in floating point the rounding differs: in float64 it agrees with
torch's convolution to about 1e-14 relative, in float32 to about 1e-5 (F(4x4, 3x3)'s
interpolation points 2 and -2 round more than a direct sum;
``tests/core/compute/test_winograd.py``).
It is the ``winograd`` fast path of :mod:`fedlap_privacy.compute.fast_paths`; :func:`applies` says
where it runs, and :func:`conv2d` and :func:`conv2d_backward` fall back to torch's
convolution elsewhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.kernels.block import fusable, run_split

__all__ = [
    "ConvTiles",
    "KernelTiles",
    "Tiles",
    "applies",
    "conv",
    "conv2d",
    "conv2d_backward",
    "conv_backward",
    "forward",
    "forward_sum",
    "grad_tiles",
    "input_grad",
    "input_grad_sum",
    "input_tiles",
    "shared_kernel_tiles",
    "weight_grad",
    "weight_tiles",
]


#: the output tile's side, and the points of a transformed (6x6) tile
TILE = 4
POINTS = (TILE + 2) ** 2
#: the fewest input and output channels, and tiles per torch thread, where the transforms
#: and products beat oneDNN's direct convolution on a CPU (``benchmarks/speed/winograd.py``; with
#: 32 to 128 channels and 4x4 to 16x16 maps: at 64 channels, or 20 tiles on one thread, or
#: 80 tiles on two, it was about as fast or slower; at 128 channels and 80 tiles a thread or
#: more, 1.1 to 2.3 times faster)
MIN_CHANNELS = 128
MIN_TILES = 64


@dataclass(frozen=True)
class Tiles:
    """A map's transformed tiles, ``(N, T, 36, C)`` (T tiles per record, each tile's 36
    points together), and the map's ``(N, C, H, W)``."""

    data: Tensor
    shape: torch.Size

    def rows(self) -> Tensor:
        """The tiles as ``(36, N T, C)`` for the matrix products (a strided view)."""
        n, t, p, c = self.data.shape
        return self.data.view(n * t, p, c).transpose(0, 1)


def applies(x: Tensor, weight: Tensor, module: nn.Conv2d) -> bool:
    """Whether this module's convolution of ``x`` runs here: the ``winograd`` fast path is
    on, the kernels take the tensors, the kernel is 3x3 with stride 1, padding 1 (zeros),
    no dilation and one group, the map's height and width are multiples of 4, both channel
    counts are at least :data:`MIN_CHANNELS` and the batch has at least :data:`MIN_TILES`
    tiles per torch thread."""
    if not fast_paths.current().effective().winograd or x.dim() != 4 or weight.dim() != 4:
        return False
    geometry = (tuple(module.kernel_size), tuple(module.stride), module.padding,
                tuple(module.dilation), module.groups, module.padding_mode)
    if geometry != ((3, 3), (1, 1), (1, 1), (1, 1), 1, "zeros"):
        return False
    n, c_in, h, w = x.shape
    if h % TILE or w % TILE or tuple(weight.shape[1:]) != (c_in, 3, 3):
        return False
    if min(c_in, weight.shape[0]) < MIN_CHANNELS:
        return False
    if n * (h // TILE) * (w // TILE) < MIN_TILES * torch.get_num_threads():
        return False
    return fusable(x, weight)


def _tiles_of(like: Tensor, shape: torch.Size) -> Tiles:
    """Empty tiles for a map of ``shape`` (N, C, H, W)."""
    n, c, h, w = shape
    return Tiles(like.new_empty(n, (h // TILE) * (w // TILE), POINTS, c), shape)


def input_tiles(x: Tensor) -> Tiles:
    """``B^T d B`` of every 6x6 input tile of ``x`` (N, C, H, W), zero-padded by 1."""
    n, c, h, w = x.shape
    src = x.detach().contiguous()
    out = _tiles_of(src, x.shape)
    zeros = src.new_zeros(c)
    run_split("wino_input", src.dtype, n, out.data.numel(),
              (src.data_ptr(), n, c, h, w, zeros.data_ptr()), (out.data.data_ptr(),))
    return out


def grad_tiles(gy: Tensor) -> Tiles:
    """``A g A^T`` of every 4x4 tile of an output gradient ``gy`` (N, C, H, W)."""
    n, c, h, w = gy.shape
    src = gy.detach().contiguous()
    out = _tiles_of(src, gy.shape)
    run_split("wino_grad_output", src.dtype, n, out.data.numel(),
              (src.data_ptr(), n, c, h, w), (out.data.data_ptr(),))
    return out


@dataclass(frozen=True)
class KernelTiles:
    """``G w G^T`` of every (output, input) kernel in the two layouts the products take:
    ``forward`` ``(36, C_in, C_out)`` and ``adjoint`` ``(36, C_out, C_in)`` (the input
    gradient's), both contiguous."""

    forward: Tensor
    adjoint: Tensor


@dataclass
class ConvTiles:
    """One convolution's operands in the transformed domain, each transformed once and
    shared by the products that need them: the input's tiles, the kernel's and, once the
    backward pass has formed it, the output gradient's (``grad``)."""

    inputs: Tiles
    weight: KernelTiles
    grad: Tiles | None = None


#: within :func:`shared_kernel_tiles`: by a parameter's id, the parameter (held, so that the
#: id stays its own), its version counter when it was transformed, and its tiles
_SHARED: ContextVar[dict[int, tuple[Tensor, int, KernelTiles]] | None] = ContextVar(
    "shared_kernel_tiles", default=None)


@contextlib.contextmanager
def shared_kernel_tiles() -> Iterator[None]:
    """Within this block :func:`weight_tiles` transforms each parameter (``nn.Parameter``)
    once and hands the same tiles out again while the parameter's version counter stands
    (an in-place change through torch's operations moves it; a write through ``.data``
    does not, so the block must hold none). FedLAP-DP's client wraps one real batch in it:
    the DP gradient's chunks and the R_s matching steps against it, during which the model
    does not change."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def weight_tiles(weight: Tensor) -> KernelTiles:
    """``G w G^T`` of every kernel of ``weight`` (C_out, C_in, 3, 3), in both layouts (shared
    within :func:`shared_kernel_tiles` where ``weight`` is a parameter)."""
    shared = _SHARED.get() if isinstance(weight, nn.Parameter) else None
    if shared is not None:
        held = shared.get(id(weight))
        if held is not None and held[0] is weight and held[1] == weight._version:
            return held[2]
    c_out, c_in = weight.shape[:2]
    src = weight.detach().contiguous()
    adjoint = src.new_empty(POINTS, c_out, c_in)
    forward = src.new_empty(POINTS, c_in, c_out)
    run_split("wino_weight", src.dtype, c_out, adjoint.numel(),
              (src.data_ptr(), c_out, c_in), (adjoint.data_ptr(), forward.data_ptr()))
    tiles = KernelTiles(forward, adjoint)
    if shared is not None:
        shared[id(weight)] = (weight, weight._version, tiles)
    return tiles


def _products(pairs: Sequence[tuple[Tiles, Tensor]], channels: int) -> Tiles:
    """``sum_k rows(t_k) @ w_k`` per point (``w_k`` (36, K, channels) contiguous), as the
    tiles of a map of ``channels`` channels, through torch's batched product."""
    first, weights = pairs[0]
    out = _tiles_of(weights, torch.Size([*first.shape[:1], channels, *first.shape[2:]]))
    rows = out.rows()
    for k, (tiles, w) in enumerate(pairs):
        if k == 0:
            torch.bmm(tiles.rows(), w, out=rows)
        else:
            rows.baddbmm_(tiles.rows(), w)
    return out


def forward_sum(pairs: Sequence[tuple[Tiles, KernelTiles]],
                bias: Tensor | None = None) -> Tensor:
    """``sum_k conv(x_k, w_k) + bias`` for maps behind the tiles ``x_k`` (one shape) and
    kernels behind ``w_k`` (:func:`weight_tiles`, one number of output channels): one
    output transform for the sum, (N, C_out, H, W)."""
    n, _, h, w = pairs[0][0].shape
    c_out = pairs[0][1].forward.shape[2]
    m = _products([(x, w_hat.forward) for x, w_hat in pairs], c_out)
    y = m.data.new_empty(n, c_out, h, w)
    b = y.new_zeros(c_out) if bias is None else bias.detach().contiguous()
    run_split("wino_output", y.dtype, n, m.data.numel(),
              (m.data.data_ptr(), b.data_ptr(), n, c_out, h, w), (y.data_ptr(),))
    return y


def forward(x: Tiles, w_hat: KernelTiles, bias: Tensor | None = None) -> Tensor:
    """The convolution of the map behind ``x`` with the kernels behind ``w_hat``
    (:func:`weight_tiles`), plus ``bias``: (N, C_out, H, W)."""
    return forward_sum([(x, w_hat)], bias)


def input_grad_sum(pairs: Sequence[tuple[Tiles, KernelTiles]]) -> Tensor:
    """``sum_k`` of the input gradients of the convolutions with the kernels behind ``w_k``
    for the output gradients behind the tiles ``g_k`` (:func:`grad_tiles`; one shape, one
    number of input channels): one transform for the sum, (N, C_in, H, W)."""
    n, _, h, w = pairs[0][0].shape
    c_in = pairs[0][1].adjoint.shape[2]
    d = _products([(g, w_hat.adjoint) for g, w_hat in pairs], c_in)
    dx = d.data.new_empty(n, c_in, h, w)
    run_split("wino_grad_input", dx.dtype, n, d.data.numel(),
              (d.data.data_ptr(), n, c_in, h, w), (dx.data_ptr(),))
    return dx


def input_grad(gy: Tiles, w_hat: KernelTiles) -> Tensor:
    """The input gradient of the convolution with the kernels behind ``w_hat`` from the
    output gradient's tiles ``gy`` (:func:`grad_tiles`): (N, C_in, H, W)."""
    return input_grad_sum([(gy, w_hat)])


def _weight_untile(m: Tensor) -> Tensor:
    """``G^T M G`` of the products ``m`` (R, C_out, 36, C_in): (R, C_out, C_in, 3, 3)."""
    rows, c_out, _, c_in = m.shape
    dw = m.new_empty(rows, c_out, c_in, 3, 3)
    run_split("wino_weight_grad", m.dtype, rows, m.numel(),
              (m.data_ptr(), rows, c_out, c_in), (dw.data_ptr(),))
    return dw


def weight_grad(gy: Tiles, x: Tiles) -> Tensor:
    """The weight gradient summed over the batch, ``(C_out, C_in, 3, 3)``, from the output
    gradient's and the input's tiles."""
    c_out, c_in = gy.shape[1], x.shape[1]
    m = x.data.new_empty(1, c_out, POINTS, c_in)
    torch.bmm(gy.rows().transpose(1, 2), x.rows(), out=m[0].transpose(0, 1))
    return _weight_untile(m)[0]


def conv(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The convolution of ``x`` with ``weight`` (3x3, stride 1, padding 1), plus ``bias``."""
    return forward(input_tiles(x), weight_tiles(weight), bias)


def conv_backward(gy: Tensor, x: Tensor, weight: Tensor,
                  mask: tuple[bool, bool]) -> tuple[Tensor | None, Tensor | None]:
    """(input gradient, weight gradient) of the convolution of ``x`` with ``weight`` for the
    output gradient ``gy``, each where ``mask`` asks for it (None elsewhere)."""
    g = grad_tiles(gy)
    dx = input_grad(g, weight_tiles(weight)) if mask[0] else None
    dw = weight_grad(g, input_tiles(x)) if mask[1] else None
    return dx, dw


def conv2d(module: nn.Conv2d, x: Tensor, weight: Tensor,
           bias: Tensor | None = None) -> Tensor:
    """``module``'s convolution of ``x`` with ``weight`` and ``bias`` (which may differ from
    the module's own, e.g. stacked along the input channels): here where :func:`applies`,
    else torch's."""
    if applies(x, weight, module):
        return conv(x, weight, bias)
    return torch.ops.aten.convolution(x, weight, bias, list(module.stride),
                                      list(module.padding), list(module.dilation), False,
                                      [0, 0], module.groups)


def conv2d_backward(module: nn.Conv2d, gy: Tensor, x: Tensor, weight: Tensor,
                    mask: tuple[bool, bool]) -> tuple[Tensor | None, Tensor | None]:
    """(input gradient, weight gradient) of :func:`conv2d` for the output gradient ``gy``,
    each where ``mask`` asks for it (None elsewhere): here where :func:`applies`, else
    torch's."""
    if applies(x, weight, module):
        return conv_backward(gy, x, weight, mask)
    dx, dw, _ = torch.ops.aten.convolution_backward(
        gy, x, weight, None, list(module.stride), list(module.padding),
        list(module.dilation), False, [0, 0], module.groups, [*mask, False])
    return (dx if mask[0] else None), (dw if mask[1] else None)
