"""The ConvNet's weight gradient and the input gradient of a function of it, written out
layer by layer (docs/algorithms.md#written-out-matching-gradient).

Gradient matching (FedLAP-DP, Wang et al., PoPETs 2024, Eq. 9-10) moves the synthetic
images ``x`` along ``d/dx D(g(x))``, where ``g(x) = grad_w CE(model(x), y)`` is the
batch-mean weight gradient and ``D`` the matching distance. With ``U = dD/dg`` this is
the mixed second derivative ``d/dx <U, g(x)>`` (``U`` held fixed), which autograd computes
by differentiating its own backward graph (``create_graph=True``). For the package's
ConvNet on the CPU, :func:`weight_grad_input_vjp` computes the same three passes without
autograd:

1. forward and backward: every block's pre-activation ``z_l``, input ``a_{l-1}`` and
   incoming gradient ``ga_l``, and the weight gradient ``g``, as in :mod:`per_sample`'s
   fused path but summed over the batch;
2. ``U = adjoint(g)`` (the caller's ``dD/dg``);
3. the backward of the backward, block by block from the first: the adjoint of ``gz_l`` is
   ``conv(a_{l-1}, U_W_l) + conv(bar_ga_{l-1}, W_l)`` (one convolution of the two inputs
   stacked along the channels against the two kernels stacked along the input channels),
   the fused block's double backward gives the adjoints of ``z_l`` and ``ga_l``; then the
   classifier and the softmax; then back down the forward pass, where the two terms that
   reach each block input, ``conv_input_grad(bar_z_l, W_l) + conv_input_grad(gz_l,
   U_W_l)``, are again one call with stacked operands.

That is 4 convolutions per block where autograd's graph makes 6 (and computes a weight
gradient of the double backward that nobody asked for), and none of autograd's per-node
bookkeeping. The first block (at most 3 input channels: the images) runs torch's
convolutions, the images' gradient through torch's native kernel (oneDNN's is slower
there). Where a block's convolutions run through
Winograd's F(4x4, 3x3) (:mod:`fedlap_privacy.compute.kernels.winograd`), its input ``a_{l-1}``,
its kernels and ``gz_l`` are transformed once per step and shared by the block's four
convolutions, and each pair of stacked operands becomes two sets of products summed before
one inverse transform
(:func:`~fedlap_privacy.compute.kernels.winograd.forward_sum`,
:func:`~fedlap_privacy.compute.kernels.winograd.input_grad_sum`) instead of a concatenation.
:func:`weight_grad` is step 1 alone: the first-order gradient of the (optionally
record-weighted) mean cross-entropy, for the local and the server steps. The test suite
holds both to autograd's results (their oracle). This is the ``second_order`` fast path of
:mod:`fedlap_privacy.compute.fast_paths`: switched off there (or the kernels it runs on),
:func:`supported_blocks` answers None and the callers let autograd differentiate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.kernels import (
    block_backward,
    block_double_backward,
    block_forward,
    winograd,
)
from fedlap_privacy.compute.kernels.winograd import ConvTiles, KernelTiles, conv2d, conv2d_backward
from fedlap_privacy.models import ConvNet, has_hooks

__all__ = ["Blocks", "supported_blocks", "weight_grad", "weight_grad_input_vjp"]

#: the ConvNet's (convolution, normalisation) pairs, as :meth:`ConvNet.fused_blocks` gives them
Blocks = list[tuple[nn.Conv2d, nn.GroupNorm]]

#: from the weight gradient (one tensor per parameter, in ``model.parameters()`` order) to
#: dD/dg in the same order; None for a parameter D does not depend on
Adjoint = Callable[[list[Tensor]], Sequence[Tensor | None]]


def supported_blocks(model: nn.Module, x: Tensor) -> Blocks | None:
    """The ConvNet's blocks when :func:`weight_grad_input_vjp` computes what autograd would
    on ``x``: the ``second_order`` fast path is on (:mod:`fedlap_privacy.compute.fast_paths`), the
    fused blocks run (:meth:`ConvNet.fused_blocks`), every convolution has one group, the
    classifier is a plain ``Linear`` and nothing hooks the modules this path does not call.
    None otherwise."""
    if not isinstance(model, ConvNet) or not fast_paths.current().second_order:
        return None
    blocks = model.fused_blocks(x)
    if blocks is None or type(model.classifier) is not nn.Linear:
        return None
    modules = [model, model.features, model.classifier, *(conv for conv, _ in blocks)]
    if any(conv.groups != 1 for conv, _ in blocks) or any(has_hooks(m) for m in modules):
        return None
    return blocks


def _first_block_grads(conv: nn.Conv2d, gz: Tensor, a: Tensor) -> tuple[Tensor, Tensor | None]:
    """The weight gradient (and the bias's, None without one) of the first block's
    convolution, summed over the batch."""
    dw = conv2d_backward(conv, gz, a, conv.weight, (False, True))[1]
    assert dw is not None
    return dw, None if conv.bias is None else gz.sum((0, 2, 3))


def _input_grad(gz: Tensor, a: Tensor, weight: Tensor, conv: nn.Conv2d) -> Tensor:
    """The input gradient of a convolution. For at most 3 input channels (the first block) it
    runs torch's native kernel: oneDNN's is 3-7x slower there (measured at 8x8 and 32x32)."""
    if _few_channels(a) and tuple(conv.dilation) == (1, 1):
        return torch.ops.aten._slow_conv2d_backward.output_mask(
            gz, a, weight, list(weight.shape[2:]), list(conv.stride), list(conv.padding),
            [True, False, False])[0]
    dx, _ = conv2d_backward(conv, gz, a, weight, (True, False))
    assert dx is not None
    return dx


def _few_channels(a: Tensor) -> bool:
    """Whether a convolution input has at most 3 channels (the first block's images)."""
    return a.shape[1] <= 3


def _stacked(parts: list[Tensor | None], dim: int) -> Tensor | None:
    """The parts that exist, concatenated along ``dim`` (None when none does)."""
    present = [t for t in parts if t is not None]
    if len(present) > 1:
        return torch.cat(present, dim)
    return present[0] if present else None


@dataclass
class _Tape:
    """What the forward and backward pass keep per block ``l`` (lists indexed by block) and
    for the classifier: input ``a_{l-1}``, pre-activation ``z_l``, the block's statistics,
    its incoming gradient ``ga_l`` and the gradient ``gz_l``; the classifier's input ``f``,
    the softmax ``p``, each record's share of the loss ``share`` (``(N, 1)``) and
    ``go = share (p - onehot)``, the gradient of the loss with respect to the logits; the
    weight gradient by parameter id."""

    inputs: list[Tensor]
    pre: list[Tensor]
    stats: list[tuple[Tensor, Tensor]]
    incoming: list[Tensor]
    gz: list[Tensor]
    f: Tensor
    p: Tensor
    share: Tensor
    go: Tensor
    grads: dict[int, Tensor]
    transformed: list[ConvTiles | None]


def _forward_backward(model: ConvNet, blocks: Blocks, x: Tensor,
                      y: Tensor, weights: Tensor | None = None) -> _Tape:
    """Step 1: the forward pass and the backward pass of the cross-entropy, the batch mean or,
    with ``weights``, ``sum_i w_i CE_i / sum_i w_i``."""
    classifier = model.classifier
    inputs, pre, stats = [], [], []
    transformed: list[ConvTiles | None] = []
    a = x
    for conv, norm in blocks:
        tiles = None
        if winograd.applies(a, conv.weight, conv):
            tiles = ConvTiles(winograd.input_tiles(a), winograd.weight_tiles(conv.weight))
            z = winograd.forward(tiles.inputs, tiles.weight, conv.bias)
        else:
            z = conv2d(conv, a, conv.weight, conv.bias)
        transformed.append(tiles)
        out, mean, rstd = block_forward(z, norm.weight, norm.bias, norm.eps)
        inputs.append(a)
        pre.append(z)
        stats.append((mean, rstd))
        a = out
    f = a.flatten(1)
    logits = f @ classifier.weight.t()
    if classifier.bias is not None:
        logits += classifier.bias
    p = torch.softmax(logits, dim=1)
    if weights is None:
        share = p.new_full((x.shape[0], 1), 1.0 / x.shape[0])
    else:
        w = weights.to(p.dtype)
        share = (w / w.sum()).unsqueeze(1)
    go = p.clone()
    go[torch.arange(x.shape[0], device=x.device), y] -= 1
    go *= share
    grads = {id(classifier.weight): go.t() @ f}
    if classifier.bias is not None:
        grads[id(classifier.bias)] = go.sum(0)
    ga = (go @ classifier.weight).view_as(a)
    incoming, gzs = [], []  # filled from the last block down, reversed below
    for i in reversed(range(len(blocks))):
        conv, norm = blocks[i]
        gz, sgx, sgy = block_backward(pre[i], ga, norm.weight, norm.bias, *stats[i])
        incoming.append(ga)
        gzs.append(gz)
        grads[id(norm.weight)], grads[id(norm.bias)] = sgx.sum(0), sgy.sum(0)
        if i == 0 and _few_channels(inputs[0]):  # the images: no input gradient
            grads[id(conv.weight)], bias_grad = _first_block_grads(conv, gz, inputs[0])
            if bias_grad is not None:
                grads[id(conv.bias)] = bias_grad
            continue
        if conv.bias is not None:
            grads[id(conv.bias)] = gz.sum((0, 2, 3))
        tiles = transformed[i]
        if tiles is not None:
            tiles.grad = winograd.grad_tiles(gz)
            grads[id(conv.weight)] = winograd.weight_grad(tiles.grad, tiles.inputs)
            if i > 0:
                ga = winograd.input_grad(tiles.grad, tiles.weight)
            continue
        dx, dw = conv2d_backward(conv, gz, inputs[i], conv.weight, (i > 0, True))
        assert dw is not None
        grads[id(conv.weight)] = dw
        if dx is not None:
            ga = dx
    return _Tape(inputs, pre, stats, incoming[::-1], gzs[::-1], f, p, share, go,
                 grads, transformed)


def weight_grad(model: ConvNet, blocks: Blocks, x: Tensor,
                y: Tensor, weights: Tensor | None = None) -> list[Tensor]:
    """The gradient of the batch-mean cross-entropy (with ``weights``, of
    ``sum_i w_i CE_i / sum_i w_i``) with respect to ``model.parameters()``, in their order,
    from the written-out forward and backward pass (step 1 of the module docstring), without
    autograd. ``blocks`` is :func:`supported_blocks` of ``model`` and ``x`` (not None)."""
    with torch.no_grad():
        grads = _forward_backward(model, blocks, x, y, weights).grads
        return [grads[id(q)] for q in model.parameters()]


def weight_grad_input_vjp(
    model: ConvNet,
    blocks: Blocks,
    x: Tensor,
    y: Tensor,
    adjoint: Adjoint,
) -> Tensor:
    """``d/dx D(g(x))`` for ``g(x)`` the gradient of ``F.cross_entropy(model(x), y)`` (batch
    mean) with respect to ``model.parameters()`` and ``adjoint(g) = dD/dg`` (module
    docstring). ``blocks`` is :func:`supported_blocks` of ``model`` and ``x`` (not None);
    nothing on the model changes and no autograd graph is built."""
    with torch.no_grad():
        t = _forward_backward(model, blocks, x, y)
        params = list(model.parameters())
        u = dict(zip((id(q) for q in params), adjoint([t.grads[id(q)] for q in params]),
                     strict=True))
        # step 3: the backward of the backward, from the first block up
        second = []  # the second-order part of each z_l's adjoint
        u_hat: list[KernelTiles | None] = []  # U_W_l's kernel tiles, for step 4
        bar_ga: Tensor | None = None
        for i, (conv, norm) in enumerate(blocks):
            u_w = u[id(conv.weight)]
            tiles = t.transformed[i]
            u_hat.append(None if tiles is None or u_w is None else winograd.weight_tiles(u_w))
            if tiles is not None and (u_w is not None or bar_ga is not None):
                # the two convolutions summed in the transformed domain
                pairs = [] if u_hat[i] is None else [(tiles.inputs, u_hat[i])]
                if bar_ga is not None:
                    pairs.append((winograd.input_tiles(bar_ga), tiles.weight))
                bar_gz = winograd.forward_sum(pairs)
            else:
                stack_in = _stacked([None if u_w is None else t.inputs[i], bar_ga], 1)
                stack_w = _stacked([u_w, None if bar_ga is None else conv.weight], 1)
                if stack_in is None or stack_w is None:
                    bar_gz = torch.zeros_like(t.gz[i])
                else:
                    bar_gz = conv2d(conv, stack_in, stack_w)
            if conv.bias is not None and u[id(conv.bias)] is not None:
                bar_gz += u[id(conv.bias)].view(1, -1, 1, 1)
            u_g, u_b = u[id(norm.weight)], u[id(norm.bias)]
            bar_z, bar_ga, _ = block_double_backward(
                t.pre[i], t.incoming[i], norm.weight, norm.bias, *t.stats[i], bar_gz,
                torch.zeros_like(norm.weight) if u_g is None else u_g,
                torch.zeros_like(norm.bias) if u_b is None else u_b)
            second.append(bar_z)
        # the classifier and the softmax
        classifier = model.classifier
        u_cw = u[id(classifier.weight)]
        u_cb = u[id(classifier.bias)] if classifier.bias is not None else None
        assert bar_ga is not None
        bar_go = bar_ga.flatten(1) @ classifier.weight.t()
        if u_cw is not None:
            bar_go += t.f @ u_cw.t()
        if u_cb is not None:
            bar_go += u_cb
        bar_logits = t.p * (bar_go - (t.p * bar_go).sum(1, keepdim=True)) * t.share
        bar_f = bar_logits @ classifier.weight
        if u_cw is not None:
            bar_f += t.go @ u_cw
        # step 4: down the forward pass
        bar_a = bar_f.view_as(bar_ga)
        for i in reversed(range(len(blocks))):
            conv, norm = blocks[i]
            bar_z = block_backward(t.pre[i], bar_a, norm.weight, norm.bias, *t.stats[i])[0]
            bar_z += second[i]
            tiles, u_hat_i = t.transformed[i], u_hat[i]
            if tiles is not None:
                pairs = [(winograd.grad_tiles(bar_z), tiles.weight)]
                if u_hat_i is not None:
                    assert tiles.grad is not None  # set by the backward pass
                    pairs.append((tiles.grad, u_hat_i))
                bar_a = winograd.input_grad_sum(pairs)
                continue
            u_w = u[id(conv.weight)]
            gz = _stacked([bar_z, None if u_w is None else t.gz[i]], 1)
            weight = _stacked([conv.weight, u_w], 0)
            assert gz is not None and weight is not None
            bar_a = _input_grad(gz, t.inputs[i], weight, conv)
        return bar_a
