"""A cohort of ConvNets packed into one wide network: one forward and one backward for G
clients' local SGD step.

Client g of a group holds its own weights of the ConvNet (docs/algorithms.md#convnet). The
group's batches, padded to a common size B and masked as in :mod:`~fedlap_privacy.fl.engine.cohort`,
are laid side by side on the channel axis: the input is (B, G * C_in, H, W), client g's
records in channels [g C_in, (g + 1) C_in). Then

* each convolution is ONE grouped convolution (``groups = G``) whose weight stacks the G
  clients' kernels, (G * C_out, C_in, kh, kw): group g sees only client g's channels;
* each GroupNorm with one channel per group, its ReLU and its 2x2 average pooling are the
  same fused kernel as the one-by-one forward (:func:`fedlap_privacy.compute.kernels.gn_relu_pool`)
  over G * C_out channels, the clients' norm weights and biases concatenated: every
  (record, channel) plane is normalised on its own, so packing changes nothing in it;
* the classifier is one batched matrix product over the client axis.

The loss is the sum over the clients of each client's mean cross-entropy over its real
records (the padded ones masked out). The clients' parameters are disjoint, so one plain
backward of that sum gives every client the gradient of its own loss: the loop's gradient,
up to floating-point rounding. On the CPU this keeps the loop's fused kernels, which the
``vmap`` of :func:`~fedlap_privacy.fl.engine.cohort.cohort_local_sgd` cannot use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlap_privacy.compute.kernels import gn_relu_pool

__all__ = ["PackedConvNet", "pack_refusal"]


@dataclass(frozen=True)
class _Block:
    """One [conv -> GroupNorm -> ReLU -> AvgPool 2x2] block: its parameters' names and the
    convolution's geometry."""

    conv_weight: str
    conv_bias: str | None
    norm_weight: str
    norm_bias: str
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    eps: float


def _blocks(model: nn.Module) -> list[_Block] | str:
    """The blocks of a ConvNet that packs, or why it does not."""
    from fedlap_privacy.models import ConvNet

    if type(model) is not ConvNet:
        return f"the model ({type(model).__name__}) is not the ConvNet"
    layers = list(model.features)
    if not layers or len(layers) % 4:
        return "the ConvNet's features are not [conv, norm, relu, pool] blocks"
    blocks = []
    for i in range(0, len(layers), 4):
        conv, norm, relu, pool = layers[i:i + 4]
        if not (type(conv) is nn.Conv2d and conv.groups == 1 and conv.padding_mode == "zeros"
                and isinstance(conv.padding, tuple) and type(norm) is nn.GroupNorm
                and norm.affine and norm.num_groups == norm.num_channels
                and type(relu) is nn.ReLU and type(pool) is nn.AvgPool2d
                and pool.kernel_size in (2, (2, 2)) and pool.stride in (2, (2, 2))
                and pool.padding in (0, (0, 0)) and not pool.ceil_mode
                and pool.divisor_override is None):
            return f"block {i // 4} of the ConvNet is not [Conv2d, GroupNorm(C, C), ReLU, " \
                   "AvgPool2d(2)]"
        blocks.append(_Block(
            f"features.{i}.weight", None if conv.bias is None else f"features.{i}.bias",
            f"features.{i + 1}.weight", f"features.{i + 1}.bias",
            tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation), float(norm.eps)))
    return blocks


def pack_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s clients cannot be packed into one network (None: they can)."""
    from fedlap_privacy.models import has_hooks

    blocks = _blocks(model)
    if isinstance(blocks, str):
        return blocks
    for name, module in model.named_modules():
        if has_hooks(module):
            return f"module {name or 'model'} has hooks"
    return None


class PackedConvNet:
    """The loss of G clients' ConvNets packed into one network (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        blocks = _blocks(model)
        if isinstance(blocks, str):
            raise ValueError(f"cannot pack the cohort: {blocks}")
        self.blocks = blocks

    def loss(self, params: dict[str, Tensor], xb: Tensor, yb: Tensor, mask: Tensor,
             count: Tensor) -> Tensor:
        """sum_g (sum_i mask[g, i] CE(f(w_g; xb[i, g]), yb[g, i])) / max(count[g], 1).

        ``params``: each parameter with a leading client axis of G; ``xb``: (B, G, C, H, W),
        record i of client g at [i, g]; ``yb``, ``mask``: (G, B); ``count``: (G,), the real
        records of each client."""
        batch, groups = xb.shape[:2]
        h = xb.reshape(batch, groups * xb.shape[2], *xb.shape[3:])
        for block in self.blocks:
            weight = params[block.conv_weight]
            bias = None if block.conv_bias is None else params[block.conv_bias].reshape(-1)
            h = F.conv2d(h, weight.reshape(-1, *weight.shape[2:]), bias, block.stride,
                         block.padding, block.dilation, groups)
            h = gn_relu_pool(h, params[block.norm_weight].reshape(-1),
                             params[block.norm_bias].reshape(-1), block.eps)
        features = h.reshape(batch, groups, -1).transpose(0, 1)  # (G, B, F)
        weight, bias = params["classifier.weight"], params["classifier.bias"]
        logits = torch.baddbmm(bias.unsqueeze(1), features, weight.transpose(1, 2))
        per_record = F.cross_entropy(logits.reshape(groups * batch, -1), yb.reshape(-1),
                                     reduction="none").reshape(groups, batch)
        return ((per_record * mask).sum(1) / count.clamp(min=1)).sum()
