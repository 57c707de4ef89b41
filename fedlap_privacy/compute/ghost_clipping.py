"""The sum of clipped per-record gradients without forming every per-record gradient
(ghost norms and book-keeping; docs/accounting.md#sampled-gaussian-mechanism).

DP-SGD's clipped sum ``sum_i c_i grad_i`` with ``c_i = min(1, C / ||grad_i||)`` needs each
record's gradient NORM and then one weighted sum, not the records' gradients one by one.
One forward and one backward to the layer outputs (the same capture as the per-record
paths of :mod:`fedlap_privacy.compute.per_sample`: the fused ConvNet pass, else forward hooks) give
every parametrised layer's input ``a`` and output gradient ``g``, per record. Then, layer
by layer:

* **Ghost norms** (Li, Tramer, Liang, Hashimoto 2022, sec. 4; Goodfellow 2015): a Linear
  weight gradient ``g_i^T a_i`` (one position) has squared norm ``||a_i||^2 ||g_i||^2``; over
  ``T`` positions (a sequence, or a convolution's unfolded input columns) it is
  ``<a_i a_i^T, g_i g_i^T>`` (two ``T x T`` Gram matrices). For a convolution with stride 1
  the columns' Gram matrix is the input's pixel Gram matrix summed over the kernel's
  offsets (:mod:`fedlap_privacy.compute.conv_gram`), ``C_in`` instead of ``C_in kh kw``
  multiply-adds per entry. Each layer takes the cheapest of these and the per-record
  gradient itself, counted in multiply-adds (the 28x28 ConvNet: the first convolution's
  gradient is formed, the 16x16 and 8x8 ones go through pixel Gram matrices), as do the
  small biases and GroupNorm parameters.
* **Book-keeping** (Bu, Wang, Zha, Karypis 2023, "Differentially private optimization on
  large model at small cost", Algorithm 1): with the factors ``c_i`` known, the clipped sum
  of a layer whose gradients were not formed is the batch's weight gradient of the
  reweighted output gradients, ``sum_i c_i g_i^T a_i = (c . g)^T a`` (for a convolution:
  torch's weight-gradient convolution of ``c . g``, or, where it ran through Winograd's
  F(4x4, 3x3), the products of the capture's input tiles with its output-gradient tiles
  scaled record by record), from the stored ``a`` and ``g`` without a second backward; a
  formed gradient is summed as ``c @ grads``.

The result equals :func:`fedlap_privacy.compute.per_sample.per_sample_grads` followed by clipping
and summing, up to floating-point rounding (tests/core/compute/test_ghost_clipping.py, with Opacus'
fast gradient clipping as the oracle). It is the ``ghost_clipping`` fast path of
:mod:`fedlap_privacy.compute.fast_paths`; :func:`ghost_clipped_sum` returns None where it does not
apply (a model :func:`~fedlap_privacy.compute.per_sample.hooks_supported` rejects, a layer called
twice in one forward, a layer input or output modified in place), and the caller takes the
per-record path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.conv_gram import (
    PixelGeometry,
    conv_weight_grad_sq,
    pixel_gram_cost,
)
from fedlap_privacy.compute.kernels import winograd
from fedlap_privacy.compute.kernels.winograd import conv2d_backward
from fedlap_privacy.compute.per_sample import (
    TransformedInputs,
    _conv_weight_grads,
    _fused_capture,
    _hook_capture,
    _InPlaceModified,
    _layer_grads,
    hooks_supported,
)
from fedlap_privacy.models import ConvNet

__all__ = ["ghost_clipped_sum"]


def _gram_cheaper(positions: int, p: int, d: int) -> bool:
    """Whether two ``T x T`` Gram matrices cost less than a ``d x p`` gradient per record."""
    return positions * (p + d) < p * d


def _row_sq(g: Tensor) -> Tensor:
    """Per-record squared L2 norm of ``g`` (records along dim 0): one reduction pass, without
    the squared copy that ``square().sum()`` writes (10x faster on the ConvNet's per-record
    weight gradients, 75 MB a chunk of 128 records; the same up to float rounding)."""
    return torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1).square()


def _conv_norm_route(module: nn.Conv2d, inp: Tensor, gy: Tensor
                     ) -> PixelGeometry | Literal["columns", "gradient"]:
    """The cheapest way to a Conv2d layer's per-record weight-gradient norms, in
    multiply-adds per record: the pixel Gram matrices (stride 1, one group:
    :mod:`fedlap_privacy.compute.conv_gram`), the Gram matrices of the unfolded columns, or
    the gradient itself."""
    positions = gy.shape[2] * gy.shape[3]
    p = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
    d = module.out_channels // module.groups
    costs: dict[PixelGeometry | Literal["columns", "gradient"], int] = {
        "gradient": positions * p * d, "columns": positions * positions * (p + d)}
    geometry = PixelGeometry.of(module, inp, gy)
    if geometry is not None:
        costs[geometry] = pixel_gram_cost(geometry, module.in_channels, module.out_channels)
    return min(costs, key=costs.__getitem__)


def _conv_gram_sq(module: nn.Conv2d, inp: Tensor, gy: Tensor) -> Tensor:
    """Per-record squared norm of a Conv2d weight gradient from the Gram matrices of the
    unfolded input columns and of the output gradient, per group."""
    batch, groups = inp.shape[0], module.groups
    positions = gy.shape[2] * gy.shape[3]
    cols = F.unfold(inp, module.kernel_size, module.dilation, module.padding, module.stride)
    cols = cols.view(batch, groups, -1, positions)  # (B, g, p, T)
    g = gy.reshape(batch, groups, module.out_channels // groups, positions)  # (B, g, d, T)
    aa = torch.matmul(cols.transpose(2, 3), cols)
    gg = torch.matmul(g.transpose(2, 3), g)
    return (aa * gg).sum(dim=(1, 2, 3))


def _layer_norms(module: nn.Module, inp: Tensor, gy: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """A layer's per-record squared gradient norm over its own parameters, and the per-record
    gradients it formed on the way (by parameter name; the others are left to
    :func:`_layer_sum`)."""
    batch = inp.shape[0]
    sq = inp.new_zeros(batch)
    formed: dict[str, Tensor] = {}
    if isinstance(module, nn.Conv2d):
        route = _conv_norm_route(module, inp, gy)
        if isinstance(route, PixelGeometry):
            sq = conv_weight_grad_sq(inp, gy, route)
        elif route == "columns":
            sq = _conv_gram_sq(module, inp, gy)
        else:
            formed["weight"] = _conv_weight_grads(module, inp, gy)
        if module.bias is not None and "bias" not in formed:
            formed["bias"] = gy.sum(dim=(2, 3))
    elif isinstance(module, nn.Linear):
        x2 = inp.reshape(batch, -1, module.in_features)
        g2 = gy.reshape(batch, -1, module.out_features)
        positions = x2.shape[1]
        if positions == 1:
            sq = x2.square().sum(dim=(1, 2)) * g2.square().sum(dim=(1, 2))
        elif _gram_cheaper(positions, module.in_features, module.out_features):
            sq = (torch.bmm(x2, x2.transpose(1, 2)) * torch.bmm(g2, g2.transpose(1, 2))).sum(
                dim=(1, 2))
        else:
            formed["weight"] = torch.bmm(g2.transpose(1, 2), x2)
        if module.bias is not None:
            formed["bias"] = g2.sum(dim=1)
    else:  # GroupNorm: per-channel gradients, small
        formed = _layer_grads(module, inp, gy)
    for g in formed.values():
        sq = sq + _row_sq(g)
    return sq, formed


def _layer_sum(module: nn.Module, inp: Tensor, gy: Tensor, factors: Tensor,
               formed: dict[str, Tensor], transformed: TransformedInputs) -> dict[str, Tensor]:
    """A layer's clipped sum ``sum_i c_i grad_i`` per parameter: ``c @ grads`` where the
    gradients were formed, else the batch's weight gradient of ``c . g`` (book-keeping;
    from the capture's tiles where the convolution ran through Winograd's F(4x4, 3x3))."""
    out = {name: (factors @ g.reshape(g.shape[0], -1)).view(g.shape[1:])
           for name, g in formed.items()}
    if "weight" in out or getattr(module, "weight", None) is None:
        return out
    if isinstance(module, nn.Conv2d):
        if module in transformed:
            # the capture's output-gradient tiles, each record's scaled by its factor in
            # place (the transform is linear; they have no other use after the capture)
            tiles = transformed[module]
            grad = tiles.grad if tiles.grad is not None else winograd.grad_tiles(gy)
            grad.data.mul_(factors.view(-1, 1, 1, 1))
            out["weight"] = winograd.weight_grad(grad, tiles.inputs)
        else:
            scaled = gy * factors.view(-1, 1, 1, 1)
            out["weight"] = conv2d_backward(module, scaled, inp, module.weight,
                                            (False, True))[1]
    else:  # Linear
        g2 = (gy.reshape(gy.shape[0], -1, module.out_features) * factors.view(-1, 1, 1))
        out["weight"] = g2.reshape(-1, module.out_features).T @ inp.reshape(
            -1, module.in_features)
    return out


def ghost_clipped_sum(
    model: nn.Module, x: Tensor, y: Tensor, factors_of: Callable[[Tensor], Tensor]
) -> list[Tensor] | None:
    """``sum_i c_i grad_i`` over the records of ``(x, y)``, one tensor per parameter in
    ``model.parameters()`` order, where ``grad_i`` is record i's cross-entropy gradient and
    ``c_i = factors_of(||grad_i||)`` (the clip factors of
    :func:`fedlap_privacy.fl.methods.dp.clip_factors`). None where the path does not apply
    (module docstring); the model is left unchanged."""
    named = list(model.named_parameters())
    if not named:
        return []
    if x.shape[0] == 0:
        return [p.detach().new_zeros(p.shape) for _, p in named]
    names = {module: name for name, module in model.named_modules()}
    blocks = (model.fused_blocks(x)
              if fast_paths.current().per_sample and isinstance(model, ConvNet) else None)
    if blocks is not None:
        layers, formed_all, transformed = _fused_capture(model, blocks, x, y)
    elif hooks_supported(model):
        try:
            layers = _hook_capture(model, x, y)
        except _InPlaceModified:
            return None
        formed_all, transformed = {}, {}
        if len({id(m) for m, _, _ in layers}) != len(layers):  # a layer called twice
            return None
    else:
        return None
    with torch.no_grad():
        sq = sum((_row_sq(g) for g in formed_all.values()),
                 start=x.new_zeros(x.shape[0], dtype=named[0][1].dtype))
        per_layer = []
        for module, inp, gy in layers:
            layer_sq, formed = _layer_norms(module, inp, gy)
            sq = sq + layer_sq
            per_layer.append(formed)
        factors = factors_of(sq.sqrt()).to(sq.dtype)
        sums = {name: (factors @ g.reshape(g.shape[0], -1)).view(g.shape[1:])
                for name, g in formed_all.items()}
        for (module, inp, gy), formed in zip(layers, per_layer, strict=True):
            prefix = names[module]
            for pname, total in _layer_sum(module, inp, gy, factors, formed,
                                           transformed).items():
                sums[f"{prefix}.{pname}" if prefix else pname] = total
    return [sums[name] if name in sums else p.detach().new_zeros(p.shape) for name, p in named]
