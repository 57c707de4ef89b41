"""The ConvNet of docs/algorithms.md#convnet: parameter counts and output shapes."""

from __future__ import annotations

import pytest
import torch

from fedlap_privacy.models import ModelConfig, build_model, count_parameters


@pytest.mark.parametrize(
    ("channels", "size", "expected"),
    [(1, 28, 317_706), (3, 32, 320_010)],
)
def test_parameter_counts_match_the_paper(channels: int, size: int, expected: int) -> None:
    model = build_model(ModelConfig(in_channels=channels, image_size=size, num_classes=10))
    assert count_parameters(model) == expected


@pytest.mark.parametrize(("channels", "size"), [(1, 8), (1, 28), (3, 32)])
def test_forward_shapes(channels: int, size: int) -> None:
    config = ModelConfig(in_channels=channels, image_size=size, num_classes=10)
    model = build_model(config.to_dict())  # the dict form stored in checkpoints
    logits = model(torch.randn(4, channels, size, size))
    assert logits.shape == (4, 10)
    assert torch.isfinite(logits).all()


def test_single_record_forward() -> None:
    # GroupNorm normalises per record, so a batch of one works (needed for DP per-record grads).
    model = build_model(ModelConfig(in_channels=1, image_size=28, num_classes=10))
    assert model(torch.randn(1, 1, 28, 28)).shape == (1, 10)


def test_too_small_image_is_rejected() -> None:
    with pytest.raises(ValueError, match="too small"):
        build_model(ModelConfig(in_channels=1, image_size=4, num_classes=10))
