"""A run on a user's records and model: ``--data`` and ``--model`` (docs/own-data.md),
shared by the in-process driver, ``compare`` and the Flower engine.

Order of the checks (each refusal is one line, before anything is written): the
configuration, then the data's layout (:func:`fedlap_privacy.data.user_data.probe`: array headers
and labels), then the model built for that shape (:mod:`fedlap_privacy.model_factory`: a
factory that fails, returns no module, or holds a layer that mixes records is refused), and
only then are the features read and checked (:func:`fedlap_privacy.data.user_data.load_user_data`).

The model of a run (:func:`run_model`): the ConvNet (docs/algorithms.md#convnet) for images
when no ``model`` is configured, exactly as for the built-in datasets (its fused kernels and
written-out passes are the fast path); otherwise the factory's module, the default for
feature rows being :data:`fedlap_privacy.model_factory.DEFAULT_TABULAR`. DP methods take
per-record gradients of any module (:func:`fedlap_privacy.compute.per_sample.per_sample_grads`:
hooks for Linear/Conv2d/GroupNorm-only models, ``torch.func.vmap`` otherwise).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from fedlap_privacy.data.datasets import CUSTOM, Dataset
from fedlap_privacy.data.user_data import load_user_data, probe
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.model_factory import DEFAULT_TABULAR, FactorySpec, build_model
from fedlap_privacy.models import ModelConfig
from fedlap_privacy.models import build_model as build_convnet

__all__ = ["RunModel", "check_user_run", "convnet_config", "prepare_data", "run_model", "with_data"]


@dataclass(frozen=True)
class RunModel:
    """A run's model and how ``ckpt.pt`` records it: the ConvNet's ``model_config``, or the
    factory's spec (``factory``; then ``model_config`` is empty)."""

    model: nn.Module
    model_config: dict[str, int]
    factory: FactorySpec | None


def convnet_config(cfg: TrainConfig, input_shape: tuple[int, ...], num_classes: int
                   ) -> ModelConfig:
    """The ConvNet for images of ``input_shape`` (docs/algorithms.md#convnet); 8x8 inputs
    default to 32 channels and 2 blocks (see TrainConfig). Square images only."""
    channels, height, width = input_shape
    if height != width:
        raise ConfigError(f"the default ConvNet takes square images, not {height}x{width}: "
                          "pass --model FILE.py:FUNC with a model for them")
    small = height <= 8
    return ModelConfig(channels, height, num_classes, cfg.width or (32 if small else 128),
                       cfg.depth or (2 if small else 3))


def factory_spec(cfg: TrainConfig, input_shape: tuple[int, ...], num_classes: int
                 ) -> FactorySpec | None:
    """The factory building the run's model, None for the ConvNet (module docstring)."""
    if cfg.model is None and len(input_shape) == 3:
        return None
    return FactorySpec(cfg.model or DEFAULT_TABULAR, tuple(input_shape), num_classes)


def run_model(cfg: TrainConfig, input_shape: tuple[int, ...], num_classes: int) -> RunModel:
    """The run's model, freshly initialised from the global torch seed (module docstring)."""
    spec = factory_spec(cfg, input_shape, num_classes)
    if spec is None:
        config = convnet_config(cfg, input_shape, num_classes)
        try:
            return RunModel(build_convnet(config), config.to_dict(), None)
        except ValueError as exc:
            raise ConfigError(f"the default ConvNet: {exc}") from None
    return RunModel(build_model(spec), {}, spec)


def with_data(cfg: TrainConfig, data: str | Path) -> TrainConfig:
    """``cfg`` on a user's records at ``data`` (the Python API's ``train(cfg, out, data=PATH)``),
    keeping which keys were given (:attr:`TrainConfig.given`): the others are left to the
    resolution, which sizes the run by those records."""
    return TrainConfig.from_dict({**cfg.given_values(), "data": str(data),
                                  "dataset": CUSTOM}).validate()


def check_user_run(cfg: TrainConfig) -> None:
    """The checks of the module docstring that read no features: the data's layout and the
    model built for it (a run refused here is refused before its folder is created)."""
    if cfg.data is not None:
        layout = probe(cfg.data)
        run_model(cfg, layout.input_shape, layout.num_classes)


def prepare_data(cfg: TrainConfig, split_seed: int) -> tuple[TrainConfig, Dataset]:
    """A user's records for a run of ``cfg`` (``cfg.data`` set), checked in the order of the
    module docstring; with a natural partition, ``clients`` becomes its number of clients."""
    if cfg.data is None:
        raise ConfigError("no user data configured (data=PATH)")
    check_user_run(cfg)  # refuse the layout or the model before reading x
    data = load_user_data(cfg.data, split_seed)
    if data.partition is not None and cfg.clients != len(data.partition):
        cfg = dataclasses.replace(cfg, clients=len(data.partition)).validate()
    return cfg, data


def describe_data(data: Dataset) -> dict[str, Any]:
    """What a summary says about a user's data (shapes and sizes, never values)."""
    return {"input_shape": list(data.input_shape), "num_classes": data.num_classes,
            "natural_partition": data.partition is not None, "held_out_test": data.held_out}
