"""The ConvNet of the FedLAP-DP paper (docs/algorithms.md#convnet).

Three blocks of [conv 3x3, ``width`` channels -> GroupNorm(width groups, affine) -> ReLU ->
AvgPool 2x2], then a linear classifier. GroupNorm (not BatchNorm) keeps per-record gradients
well defined, which DP-SGD needs. For 28x28 inputs the first convolution pads by 3, so the
feature maps are 32 -> 16 -> 8 -> 4 as for CIFAR-10 (317,706 parameters for 1x28x28,
320,010 for 3x32x32). 8x8 inputs (scikit-learn digits) end at 1x1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


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
        return self.classifier(self.features(x).flatten(1))


def build_model(config: ModelConfig | dict[str, int]) -> ConvNet:
    """Build a ConvNet from a :class:`ModelConfig` or its dict form (as stored in checkpoints)."""
    if isinstance(config, dict):
        config = ModelConfig(**config)
    return ConvNet(config)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
