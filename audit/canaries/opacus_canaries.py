"""Gradient canaries inside an Opacus ``DPOptimizer``: where they enter, what is recorded.

Opacus's ``DPOptimizer.pre_step`` (opacus/optimizers/optimizer.py) runs, at each logical
step: ``clip_and_accumulate`` (each record's per-sample gradient clipped to
``max_grad_norm`` and summed into ``p.summed_grad``; the ghost-clipping optimiser's
``accumulate`` instead copies the clipped sum from ``p.grad``), then ``add_noise``
(``p.grad = p.summed_grad + N(0, (noise_multiplier max_grad_norm)^2)``), then
``scale_grad`` (divides by ``expected_batch_size * accumulated_iterations`` when
``loss_reduction="mean"``) and the accountant's ``step_hook``; ``step`` then hands ``p.grad``
to the wrapped optimiser. A skipped step (virtual batches) returns before ``add_noise``.

:func:`hook_dp_optimizer` wraps two methods of that one optimiser instance:

* ``add_noise``: first adds the canaries sampled at this step to the canary block's
  ``summed_grad`` (``C`` on each one's coordinate), exactly where a record's clipped gradient
  has entered, then runs Opacus's own ``add_noise`` (canary records drawn by the data loader,
  ``GradientCanaries.wrap_dataset``, are already in that sum, ``C`` each: nothing is added,
  and the sum over the block, over ``C``, counts the canary records the step drew);
* ``pre_step``: after Opacus's own (noise, scaling, accounting), records the block's ``p.grad``,
  the value the optimiser releases to its update, times the scaling ``scale_grad`` applied,
  in units of ``C``, with the step's noise multiplier, clipping norm, accumulated
  micro-batches and expected batch size (:class:`~.canary_steps.StepRecord`).

Only released steps count: a step skipped by ``signal_skip_step`` (``BatchMemoryManager``'s
virtual batches) returns before ``add_noise``, and a step over micro-batches accumulated by
hand (``poisson_sampling=False``, several ``backward`` before one ``step``) is one step,
accounted by Opacus at ``sample_rate * accumulated_iterations``: the canaries are sampled at
that rate for that step. Nothing else of the optimiser changes: records, clipping, noise and
accounting are Opacus's.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn

from fedlap_privacy.audit.canaries.canary_steps import OptimizerSetup
from fedlap_privacy.errors import ConfigError

__all__ = ["accountant_of", "attach_to_parameter", "check_dp_optimizer", "hook_dp_optimizer",
           "loader_sampling", "optimizer_sample_rate", "optimizer_setup"]

_REQUIRED = ("add_noise", "pre_step", "original_optimizer", "noise_multiplier", "max_grad_norm",
             "loss_reduction", "expected_batch_size", "accumulated_iterations")


def _hook_closure(optimizer: Any) -> dict[str, Any]:
    hook = getattr(optimizer, "step_hook", None)
    if hook is None or not callable(hook):
        return {}
    try:
        return dict(inspect.getclosurevars(hook).nonlocals)
    except (TypeError, ValueError):
        return {}


def optimizer_sample_rate(optimizer: Any) -> float | None:
    """The sample rate PrivacyEngine gave the accountant hook of ``optimizer``
    (``make_private``: ``1 / len(data_loader)``), or None when it has no such hook."""
    rate = _hook_closure(optimizer).get("sample_rate")
    return float(rate) if isinstance(rate, int | float) else None


def accountant_of(optimizer: Any) -> Any | None:
    """The Opacus accountant whose hook ``make_private`` attached to ``optimizer``, if any."""
    owner = _hook_closure(optimizer).get("self")
    return owner if callable(getattr(owner, "get_epsilon", None)) else None


def optimizer_setup(optimizer: Any) -> OptimizerSetup:
    """What ``optimizer`` (a checked ``DPOptimizer``) is set up with now: read at ``attach``."""
    accountant = accountant_of(optimizer)
    mechanism = getattr(accountant, "mechanism", None)
    expected = optimizer.expected_batch_size
    return OptimizerSetup(float(optimizer.noise_multiplier), float(optimizer.max_grad_norm),
                          optimizer_sample_rate(optimizer),
                          None if expected is None else float(expected),
                          str(optimizer.loss_reduction),
                          str(mechanism()) if callable(mechanism) else None)


def _accumulated(optimizer: Any) -> int:
    """Micro-batches accumulated into the open step (Opacus's ``accumulated_iterations``)."""
    try:
        return max(1, int(optimizer.accumulated_iterations))
    except (ValueError, TypeError, AttributeError):
        return 1


def loader_sampling(data_loader: Any) -> tuple[float, int | None]:
    """``(sample_rate, steps_per_epoch)`` of a data loader: Opacus's ``DPDataLoader`` samples
    each record with its ``sample_rate`` at each step (Poisson: ``None`` steps per epoch);
    any other loader (``poisson_sampling=False``) shuffles and puts each record in exactly
    one of its ``len(loader)`` batches per epoch."""
    rate = getattr(data_loader, "sample_rate", None)
    if type(data_loader).__name__ == "DPDataLoader" and isinstance(rate, int | float):
        return float(rate), None
    try:
        k = len(data_loader)
    except TypeError:
        raise ConfigError("the data loader has no length: pass sample_rate= instead") from None
    if k < 1:
        raise ConfigError("the data loader is empty")
    return 1.0 / k, k


def check_dp_optimizer(optimizer: Any) -> None:
    """Refuse (one line) an optimiser these canaries cannot enter: not an Opacus
    ``DPOptimizer``, a distributed or per-layer one, or one without a noise multiplier."""
    missing = [name for name in _REQUIRED if not hasattr(type(optimizer), name)
               and not hasattr(optimizer, name)]
    if missing:
        raise ConfigError(f"attach needs an Opacus DPOptimizer (from PrivacyEngine."
                          f"make_private), got {type(optimizer).__name__} without "
                          f"{', '.join(missing)}")
    names = [cls.__name__ for cls in type(optimizer).__mro__]
    if any("Distributed" in n or "PerLayer" in n or "FSDP" in n for n in names):
        raise ConfigError(f"gradient canaries support one-process flat clipping only, got "
                          f"{type(optimizer).__name__}")
    sigma, clip = optimizer.noise_multiplier, optimizer.max_grad_norm
    if not isinstance(sigma, int | float) or not math.isfinite(sigma) or sigma < 0:
        raise ConfigError(f"the optimiser has no noise multiplier to audit, got {sigma!r}")
    if not isinstance(clip, int | float) or not (math.isfinite(clip) and clip > 0):
        raise ConfigError(f"the optimiser needs one max_grad_norm > 0, got {clip!r}")


def _join(optimizer: Any, block: nn.Parameter) -> nn.Parameter:
    """The canary block as one of the optimiser's parameters. An optimiser built from a copy
    of the wrapped model (``ModuleValidator.fix`` clones it) holds the copy's block, marked:
    that one. One built from the model before ``wrap`` lacks it: ``block`` becomes one more
    parameter group of the wrapped optimiser, so that Opacus clips, noises and releases it
    as every other."""
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p is block for p in held):
        return block
    copies = [p for p in held if getattr(p, "fedlap_canary_block", False)
              and p.shape == block.shape]
    if len(copies) == 1:
        return copies[0]
    block.summed_grad = None  # what DPOptimizer.__init__ sets on each of its parameters
    optimizer.original_optimizer.add_param_group({"params": [block]})
    return block


def hook_dp_optimizer(canaries: Any, optimizer: Any, block: nn.Parameter) -> None:
    """Wrap ``optimizer.add_noise`` and ``optimizer.pre_step`` (module docstring) so that
    ``canaries`` (a :class:`~.gradient_canaries.GradientCanaries`) enter and record each
    released step; ``block`` is the canary block's weight."""
    check_dp_optimizer(optimizer)
    block = _join(optimizer, block)
    opacus_add_noise = optimizer.add_noise
    opacus_pre_step = optimizer.pre_step

    def add_noise() -> None:
        if block.summed_grad is None:
            raise ConfigError("the canary block received no clipped sum: is it a parameter "
                              "of the model passed to make_private?")
        canaries.enter_step(block.summed_grad, max_grad_norm=optimizer.max_grad_norm,
                            accumulated=_accumulated(optimizer))
        opacus_add_noise()

    def pre_step(closure: Any = None) -> Any:
        released = opacus_pre_step(closure)
        if released and canaries.step_open:
            accumulated = _accumulated(optimizer)
            scale = 1.0
            if optimizer.loss_reduction == "mean":
                scale = float(optimizer.expected_batch_size * accumulated)
            with torch.no_grad():
                noisy_sum = block.grad.detach() * scale
            expected = optimizer.expected_batch_size
            canaries.release_step(noisy_sum, noise_multiplier=float(optimizer.noise_multiplier),
                                  max_grad_norm=float(optimizer.max_grad_norm),
                                  accumulated=accumulated,
                                  expected_batch_size=None if expected is None
                                  else float(expected))
        return released

    optimizer.add_noise = add_noise
    optimizer.pre_step = pre_step


def attach_to_parameter(canaries: Any, optimizer: Any, parameter: nn.Parameter,
                        sample_rate: float) -> None:
    """Canaries on the first ``m`` coordinates of one of the optimiser's own parameters
    instead of the dedicated block, Poisson at ``sample_rate``: only to measure why the block
    is needed (every record's gradient reaches these coordinates and drowns the canaries;
    benchmarks/audit_power/opacus_canaries.py). :meth:`GradientCanaries.attach` always uses the
    block."""
    if parameter.numel() < canaries.m:
        raise ConfigError(f"{canaries.m} canaries need a parameter of at least "
                          f"{canaries.m} entries, got {parameter.numel()}")
    canaries._set_sampling(sample_rate, None)
    canaries._route = "optimizer"
    hook_dp_optimizer(canaries, optimizer, parameter)
    canaries._optimizer = optimizer
