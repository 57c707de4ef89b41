"""A block of weights that no record's gradient reaches: where gradient canaries live.

Canaries placed on coordinates of a model's own weights are drowned by the records'
gradients there (measured on an Opacus run: an audit of them barely moves even with 10x too
little noise). :func:`add_canary_block` gives the model a dedicated ``Linear(m, 1)`` without
bias, fed zeros, whose output enters the model's output times 0: the outputs never change,
every record's per-sample gradient on the block is exactly 0, and a DP optimiser still
clips and noises the block like every other weight (Opacus's ``GradSampleModule`` computes
its per-sample gradients, hooks and ghost clipping alike). Canary ``j`` owns coordinate ``j``.

The block lives in a thin wrapper, :class:`CanaryBlockModel` (the model is its ``model``;
other attributes are looked up there too, so ``wrapped.fc1`` still works; state-dict keys
gain the prefix ``model.``): registering a submodule on the user's model itself would change
what an ``nn.Sequential`` computes. :func:`remove_canary_block` gives the model back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fedlap_privacy.errors import ConfigError

__all__ = ["BLOCK_NAME", "CanaryBlockModel", "add_canary_block", "canary_block",
           "remove_canary_block"]

#: name of the canary block's submodule on the wrapped model
BLOCK_NAME = "fedlap_canary_block"


def _is_dp_wrapped(model: nn.Module) -> bool:
    """True for a model already wrapped by Opacus (``GradSampleModule`` and its kin)."""
    return any(cls.__name__.startswith("GradSampleModule") for cls in type(model).__mro__)


class CanaryBlockModel(nn.Module):
    """``model`` with a canary block: ``forward`` returns ``model``'s output plus
    ``0 * block(zeros)`` (module docstring)."""

    def __init__(self, model: nn.Module, m: int) -> None:
        super().__init__()
        try:
            reference = next(model.parameters())
            device, dtype = reference.device, reference.dtype
        except StopIteration:
            device, dtype = torch.device("cpu"), torch.get_default_dtype()
        self.model = model
        setattr(self, BLOCK_NAME, nn.Linear(m, 1, bias=False, device=device, dtype=dtype))
        weight = getattr(self, BLOCK_NAME).weight
        nn.init.zeros_(weight)
        weight.fedlap_canary_block = True  # kept by Opacus's clone_module (ModuleValidator.fix)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        output = self.model(*args, **kwargs)
        if not isinstance(output, torch.Tensor) or output.dim() < 1:
            raise ConfigError("gradient canaries need a model whose output is one tensor "
                              f"with the batch first, got {type(output).__name__}")
        block = getattr(self, BLOCK_NAME)
        batch = output.shape[0]
        z = block(output.new_zeros(batch, block.in_features, dtype=block.weight.dtype))
        return output + 0.0 * z.reshape(batch, *([1] * (output.dim() - 1))).to(output.dtype)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("model"), name)


def canary_block(model: nn.Module) -> nn.Linear | None:
    """The canary block of ``model`` (or of the model an Opacus wrapper holds), if any."""
    inner = getattr(model, "_module", model) if _is_dp_wrapped(model) else model
    return getattr(inner, BLOCK_NAME) if isinstance(inner, CanaryBlockModel) else None


def add_canary_block(model: nn.Module, m: int) -> CanaryBlockModel:
    """``model`` with an ``m``-coordinate canary block (module docstring).

    Refuses a model Opacus has already wrapped (the block must exist before
    ``PrivacyEngine.make_private`` so that its optimiser and hooks see it) and a model that
    has one already.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"wrap takes a torch.nn.Module, got {type(model).__name__}")
    if _is_dp_wrapped(model):
        raise ConfigError("wrap the model before PrivacyEngine.make_private: this one is "
                          "already an Opacus GradSampleModule")
    if canary_block(model) is not None:
        raise ConfigError("this model already has a canary block (wrap it once)")
    return CanaryBlockModel(model, m)


def remove_canary_block(model: nn.Module) -> nn.Module:
    """The model inside a :class:`CanaryBlockModel` (or inside the Opacus wrapper of one),
    as it was before :func:`add_canary_block`."""
    inner = getattr(model, "_module", model) if _is_dp_wrapped(model) else model
    if not isinstance(inner, CanaryBlockModel):
        raise ConfigError("this model has no canary block to remove")
    return inner.model
