"""A block of weights that no record's gradient reaches: where gradient canaries live.

Canaries placed on coordinates of a model's own weights are drowned by the records'
gradients there (measured on an Opacus run: an audit of them barely moves even with 10x too
little noise). :func:`add_canary_block` gives the model a dedicated ``Linear(m, 1)`` without
bias whose output enters the model's output times 0: the outputs never change, every
record's per-sample gradient on the block is exactly 0, and a DP optimiser still clips and
noises the block like every other weight (Opacus's ``GradSampleModule`` computes its
per-sample gradients, hooks and ghost clipping alike). Canary ``j`` owns coordinate ``j``.

Canary records (:func:`canary_mark`, made by ``GradientCanaries.wrap_dataset``) are rows of
the batch whose input holds, in every entry, the mark of their canary. The wrapped model
routes each one to its coordinate: the model itself sees zeros in its place and the row's
output is multiplied by 0 (so no weight of the model gets a gradient from it), the block's
input on that row is 1 at the canary's coordinate, and the gradient that reaches the
block's output is a constant far above any clipping norm whatever the loss
(:class:`_Push`). Its per-sample gradient is then ``_PUSH`` on its coordinate and 0
elsewhere, which the optimiser's clipping turns into exactly ``C`` there. Real rows are
untouched: their outputs are multiplied by 1 and their block input is 0.

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

__all__ = ["BLOCK_NAME", "MARK_DTYPES", "CanaryBlockModel", "add_canary_block", "canary_block",
           "canary_mark", "remove_canary_block"]

#: name of the canary block's submodule on the wrapped model
BLOCK_NAME = "fedlap_canary_block"
#: input dtypes a canary record's mark is exact in
MARK_DTYPES = (torch.float32, torch.float64)
#: marks are -2^100 (1 + (j + 1) / 2^21): exact in float32, and no real input is all of one
_MARK_BASE = 2.0 ** 100
_MARK_STEPS = 2 ** 21
#: the gradient a canary row's block output receives (far above any clipping norm)
_PUSH = 1e8


def _is_dp_wrapped(model: nn.Module) -> bool:
    """True for a model already wrapped by Opacus (``GradSampleModule`` and its kin)."""
    return any(cls.__name__.startswith("GradSampleModule") for cls in type(model).__mro__)


def canary_mark(j: int) -> float:
    """The value every input entry of canary ``j``'s record holds (module docstring)."""
    return -_MARK_BASE * (1.0 + (j + 1) / _MARK_STEPS)


def _canary_rows(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Which rows of ``x`` are canary records (booleans) and, on those rows, their
    canaries' coordinates (0 on the others); None when no row's first entry is a mark
    (outside ``torch.func`` transforms, whose plain loop's ``vmap(grad(...))`` allows no
    data-dependent branch and so always takes the full path)."""
    flat = x.detach().reshape(x.shape[0], -1)
    if (not torch._C._functorch.is_functorch_wrapped_tensor(x)
            and not bool((flat[:, 0] < -_MARK_BASE).any())):
        return None
    code = (flat[:, 0].double() / -_MARK_BASE - 1.0) * _MARK_STEPS
    whole = torch.round(code)
    rows = (code == whole) & (whole >= 1) & (whole <= m) & (flat == flat[:, :1]).all(dim=1)
    coords = torch.where(rows, whole - 1.0, torch.zeros_like(whole)).long()
    return rows, coords


def _first_input(value: Any) -> torch.Tensor | None:
    """The first floating-point tensor in the model's arguments (one level into dicts,
    lists and tuples): where canary records carry their mark."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() and value.dim() >= 1 else None
    items = value.values() if isinstance(value, dict) else value \
        if isinstance(value, list | tuple) else ()
    for item in items:
        found = _first_input(item)
        if found is not None:
            return found
    return None


def _swap(value: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    """``value`` with the tensor ``old`` replaced by ``new`` (containers rebuilt)."""
    if value is old:
        return new
    if isinstance(value, dict):
        return type(value)({k: _swap(v, old, new) for k, v in value.items()})
    if isinstance(value, list | tuple) and not isinstance(value, torch.Tensor):
        items = [_swap(v, old, new) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


class _Push(torch.autograd.Function):
    """Forward: zeros (the block's output never changes the model's). Backward: the
    constant ``_PUSH`` on every row whatever the loss's gradient, so that a canary row's
    per-sample gradient on the block does not depend on the loss (a real row's block input
    is 0: its gradient there stays 0)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(value)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        return None

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, _PUSH)


class CanaryBlockModel(nn.Module):
    """``model`` with a canary block (module docstring): ``forward`` returns ``model``'s
    output, canary records' rows zeroed and routed to the block."""

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
        block = getattr(self, BLOCK_NAME)
        x = _first_input((args, kwargs))
        rows = coords = None
        if x is not None and x.dtype in MARK_DTYPES and x.shape[0] > 0 and x[0].numel() > 0:
            found = _canary_rows(x, block.in_features)
            if found is not None:
                rows, coords = found
                clean = x.masked_fill(rows.reshape(-1, *([1] * (x.dim() - 1))), 0.0)
                args, kwargs = _swap((args, kwargs), x, clean)
        output = self.model(*args, **kwargs)
        if not isinstance(output, torch.Tensor) or output.dim() < 1:
            raise ConfigError("gradient canaries need a model whose output is one tensor "
                              f"with the batch first, got {type(output).__name__}")
        batch = output.shape[0]
        z = output.new_zeros(batch, block.in_features, dtype=block.weight.dtype)
        shape = (batch, *([1] * (output.dim() - 1)))
        if rows is not None and rows.shape[0] != batch:
            if bool(rows.any()):  # a model whose input is not batch-first: nothing to route
                raise ConfigError(f"canary records need one output row per input row, got "
                                  f"{batch} outputs for {rows.shape[0]} inputs")
            rows = None
        if rows is not None and coords is not None:
            output = output * (~rows).reshape(shape).to(output.dtype)
            z = z.scatter(1, coords[:, None], rows[:, None].to(z.dtype))
        if rows is None:  # no canary record: the block's output times 0 (cheaper, same)
            return output + 0.0 * block(z).reshape(shape).to(output.dtype)
        pushed = _Push.apply(block(z))
        return output + pushed.reshape(shape).to(output.dtype)

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
