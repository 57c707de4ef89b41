"""The ConvNet of the FedLAP-DP paper (docs/algorithms.md#convnet).

Three blocks of [conv 3x3, ``width`` channels -> GroupNorm(width groups, affine) -> ReLU ->
AvgPool 2x2], then a linear classifier. GroupNorm (not BatchNorm) keeps per-record gradients
well defined, which DP-SGD needs. For 28x28 inputs the first convolution pads by 3, so the
feature maps are 32 -> 16 -> 8 -> 4 as for CIFAR-10 (317,706 parameters for 1x28x28,
320,010 for 3x32x32). 8x8 inputs (scikit-learn digits) end at 1x1.

On the CPU the GroupNorm -> ReLU -> AvgPool of every block runs as one fused kernel
(:func:`fedlap_privacy.compute.kernels.gn_relu_pool`, the same function up to floating-point
rounding), unless something must see those modules run: a hook on them (Opacus'
``GradSampleModule``, the hook path of :mod:`fedlap_privacy.compute.per_sample`), a global module
hook, TorchScript, tracing or export, or the ``kernels`` fast path switched off
(:mod:`fedlap_privacy.compute.fast_paths`). Then the modules run one by one, as they are written.
Without autograd (evaluation, attack scores) the 128-channel convolutions of the fused
forward run through Winograd's F(4x4, 3x3) (the ``winograd`` fast path).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

from fedlap_privacy.compute.kernels import fusable, gn_relu_pool, winograd


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to rebuild the network from a checkpoint."""

    in_channels: int
    image_size: int
    num_classes: int
    width: int = 128
    depth: int = 3

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class ConvNet(nn.Module):
    """ConvNet-GN of docs/algorithms.md#convnet (the dataset-condensation ConvNet with
    GroupNorm)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        channels, size = config.in_channels, config.image_size
        size += 4 if config.image_size == 28 else 0  # first conv pads by 3, not 1
        for block in range(config.depth):
            padding = 3 if (block == 0 and config.image_size == 28) else 1
            layers += [
                nn.Conv2d(channels, config.width, kernel_size=3, padding=padding),
                nn.GroupNorm(config.width, config.width, affine=True),
                nn.ReLU(inplace=False),
                nn.AvgPool2d(kernel_size=2, stride=2),
            ]
            channels, size = config.width, size // 2
        if size < 1:
            raise ValueError(
                f"image_size {config.image_size} is too small for depth {config.depth}"
            )
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels * size * size, config.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.jit.is_scripting():
            blocks = self.fused_blocks(x)
            if blocks is not None:
                for conv, norm in blocks:
                    x = gn_relu_pool(_convolve(conv, x), norm.weight, norm.bias, norm.eps)
                return self.classifier(x.flatten(1))
        return self.classifier(self.features(x).flatten(1))

    def fused_blocks(self, x: Tensor) -> list[tuple[nn.Conv2d, nn.GroupNorm]] | None:
        """Each block's (conv, norm) when the forward may fuse norm, ReLU and pooling (module
        docstring): the blocks are still [Conv2d, GroupNorm with one channel per group,
        ReLU, AvgPool2d(2)], nothing hooks the modules the fused forward skips, and the
        kernels take ``x``. None otherwise."""
        if x.device.type != "cpu" or _global_hooks():
            return None
        layers = list(self.features)
        if len(layers) % 4 or has_hooks(self.features):
            return None
        blocks = []
        for conv, norm, relu, pool in zip(*[iter(layers)] * 4, strict=True):
            if not (type(conv) is nn.Conv2d and type(norm) is nn.GroupNorm
                    and type(relu) is nn.ReLU and type(pool) is nn.AvgPool2d
                    and norm.num_groups == norm.num_channels
                    and _pool_2x2(pool)) or any(has_hooks(m) for m in (norm, relu, pool)):
                return None
            blocks.append((conv, norm))
        params = [p for _, norm in blocks for p in (norm.weight, norm.bias)]
        return blocks if blocks and fusable(x, *params) else None


def _convolve(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """``conv(x)``; without autograd (evaluation, attack scores) through Winograd's
    F(4x4, 3x3) where it applies (:func:`fedlap_privacy.compute.kernels.winograd.applies`: 128
    channels and more) and nothing hooks the module: a quarter of the direct convolution's
    multiplications, the same result up to floating-point rounding."""
    if torch.is_grad_enabled() or has_hooks(conv):
        return conv(x)
    return winograd.conv2d(conv, x, conv.weight, conv.bias)


def has_hooks(m: nn.Module) -> bool:
    """Whether a forward or backward hook is registered on ``m`` itself."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks)


def _global_hooks() -> bool:
    """Hooks registered for every module (``torch.nn.modules.module.register_module_*``)."""
    return any(getattr(_module, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks"))


def _pool_2x2(pool: nn.AvgPool2d) -> bool:
    return (pool.kernel_size in (2, (2, 2)) and pool.stride in (2, (2, 2))
            and pool.padding in (0, (0, 0)) and not pool.ceil_mode
            and pool.divisor_override is None)


def build_model(config: ModelConfig | dict[str, int]) -> ConvNet:
    """Build a ConvNet from a :class:`ModelConfig` or its dict form (as stored in checkpoints)."""
    if isinstance(config, dict):
        config = ModelConfig(**config)
    return ConvNet(config)


class TabularMLP(nn.Module):
    """The default model of tabular data (``--data`` with feature rows, ``--model`` unset):
    ``depth`` hidden layers of [Linear -> ReLU] of ``width`` units, then a linear
    classifier. Per-record gradients take the hook path of :mod:`fedlap_privacy.compute.per_sample`
    (Linear layers only); nothing mixes records."""

    def __init__(self, features: int, num_classes: int, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        size = features
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.ReLU()]
            size = width
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x.flatten(1)))


def tabular_mlp(input_shape: tuple[int, ...], num_classes: int) -> TabularMLP:
    """The model factory of :class:`TabularMLP` (``fedlap_privacy.models:tabular_mlp``)."""
    features = 1
    for d in input_shape:
        features *= int(d)
    return TabularMLP(features, num_classes)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
