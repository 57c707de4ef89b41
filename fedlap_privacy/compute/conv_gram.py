"""Per-record squared norms of a convolution's weight gradients from pixel Gram matrices
(ghost norms for convolutions, :mod:`fedlap_privacy.compute.ghost_clipping`).

Record ``n``'s weight gradient of a convolution with stride 1 and one group is ``A^T G``,
``A`` its unfolded input columns (a row per output position ``t``) and ``G`` its output
gradient, so that ``||A^T G||^2 = <A A^T, G G^T>`` (Li et al. 2022, sec. 4). The column Gram
matrix ``A A^T`` costs ``C kh kw`` multiply-adds per entry; it is also the pixel Gram matrix
``Q = X^T X`` of the input (``C`` per entry) summed over the kernel's offsets,
``A A^T[t, t'] = sum_(u,v) Q[t + o_uv, t' + o_uv]`` (zero where a shifted position falls in
the padding), so that

    ||A^T G||^2 = sum_(u,v) sum_(t,t') Q[t + o_uv, t' + o_uv] (G G^T)[t, t'].

:func:`conv_weight_grad_sq` forms ``Q`` and ``G G^T`` as batched matrix products (a block of
records at a time) and the shifted sum with torch's operations: the offsets' copies of
``G G^T`` added into the padded input's coordinates, then one inner product with ``Q``. On
the ConvNet's 128-channel 16x16 convolution this is ``H W (C_in + C_out) + kh kw H W``
multiply-adds per position pair against ``C_out C_in kh kw`` per position for the gradient
itself: about half the arithmetic, as larger matrix products. (A C pass reading only the
pairs of image rows on and above the diagonal made a DP gradient 1.15x faster and the
``paper-dp`` client round 1.15x, below the 1.3x a hand-written kernel must buy; removed.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["PixelGeometry", "conv_weight_grad_sq", "pixel_gram_cost"]

#: records whose two Gram matrices are formed at once: at most this many scalars of them
_BLOCK_SCALARS = 1 << 23


@dataclass(frozen=True)
class PixelGeometry:
    """A stride-1, one-group convolution's input and output map sizes and its kernel."""

    in_hw: tuple[int, int]
    out_hw: tuple[int, int]
    kernel: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]

    @classmethod
    def of(cls, module: nn.Conv2d, inp: Tensor, gy: Tensor) -> PixelGeometry | None:
        """The geometry of ``module`` on these maps, or None where the identity does not
        hold (a stride, groups, or a padding mode other than zeros)."""
        if (tuple(module.stride) != (1, 1) or module.groups != 1
                or module.padding_mode != "zeros" or isinstance(module.padding, str)):
            return None
        return cls((inp.shape[2], inp.shape[3]), (gy.shape[2], gy.shape[3]),
                   (module.kernel_size[0], module.kernel_size[1]),
                   (module.padding[0], module.padding[1]),
                   (module.dilation[0], module.dilation[1]))


def pixel_gram_cost(geometry: PixelGeometry, c_in: int, c_out: int) -> int:
    """Multiply-adds per record of :func:`conv_weight_grad_sq`."""
    pixels = geometry.in_hw[0] * geometry.in_hw[1]
    positions = geometry.out_hw[0] * geometry.out_hw[1]
    offsets = geometry.kernel[0] * geometry.kernel[1]
    return pixels * pixels * c_in + positions * positions * (c_out + offsets)


def _shifted_dot(q: Tensor, gg: Tensor, g: PixelGeometry) -> Tensor:
    """The shifted sum of the module docstring: the offsets' copies of ``G G^T`` added into
    the padded input's coordinates, then the inner product with ``Q``."""
    (h, w), (ho, wo) = g.in_hw, g.out_hw
    (ph, pw), (dh, dw) = g.padding, g.dilation
    n = q.shape[0]
    gg = gg.view(n, ho, wo, ho, wo)
    acc = gg.new_zeros(n, h + 2 * ph, w + 2 * pw, h + 2 * ph, w + 2 * pw)
    for u in range(g.kernel[0]):
        for v in range(g.kernel[1]):
            acc[:, u * dh:u * dh + ho, v * dw:v * dw + wo,
                u * dh:u * dh + ho, v * dw:v * dw + wo] += gg
    inner = acc[:, ph:ph + h, pw:pw + w, ph:ph + h, pw:pw + w]
    return (q.view(n, h, w, h, w) * inner).sum(dim=(1, 2, 3, 4))


def conv_weight_grad_sq(inp: Tensor, gy: Tensor, geometry: PixelGeometry) -> Tensor:
    """``||grad_n||^2`` per record ``n`` of the weight gradient of a convolution with this
    geometry, input ``inp`` (N, C_in, H, W) and output gradient ``gy`` (N, C_out, Ho, Wo)."""
    n, c_in = inp.shape[:2]
    (h, w), (ho, wo) = geometry.in_hw, geometry.out_hw
    x = inp.reshape(n, c_in, h * w).contiguous()
    g = gy.reshape(n, gy.shape[1], ho * wo).contiguous()
    out = inp.new_empty(n)
    block = max(1, _BLOCK_SCALARS // ((h * w) ** 2 + (ho * wo) ** 2))
    for start in range(0, n, block):
        xs, gs = x[start:start + block], g[start:start + block]
        q = torch.bmm(xs.transpose(1, 2), xs)
        gg = torch.bmm(gs.transpose(1, 2), gs)
        out[start:start + block] = _shifted_dot(q, gg, geometry)
    return out
