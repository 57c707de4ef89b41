"""A user's model: ``--model FILE.py:FUNC`` or ``--model module:FUNC`` (docs/own-data.md).

``FUNC(input_shape, num_classes)`` returns any ``torch.nn.Module`` taking a batch of records
``(B, *input_shape)`` to ``(B, num_classes)`` logits. The factory is code the USER names on
the command line, imported from their own installation or file; nothing from a data file or
a checkpoint is ever imported or run. A run records only the factory's spec
(:class:`FactorySpec`: the text the user gave, the input shape, the classes) in ``ckpt.pt``,
never code, so ``audit --model ckpt.pt`` rebuilds the model where that spec is importable.

Per-record DP (Abadi et al. 2016, the SGM of docs/accounting.md) needs every record's
gradient to depend on that record alone. Layers that mix the records of a batch break it
and are refused (:func:`check_per_record`), as Opacus' ``ModuleValidator`` does: BatchNorm
of any kind (its batch statistics; also in evaluation mode, its running statistics are
computed from the batch during training) and InstanceNorm tracking running statistics. The
fix is GroupNorm or LayerNorm.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from fedlap_privacy.errors import ConfigError

__all__ = ["DEFAULT_TABULAR", "FactorySpec", "build_model", "check_per_record", "load_factory"]

#: the model of tabular data when ``--model`` is not given
DEFAULT_TABULAR = "fedlap_privacy.models:tabular_mlp"
_MIXING = (nn.modules.batchnorm._BatchNorm,)
_FILE_MODULES: dict[str, Any] = {}


@dataclass(frozen=True)
class FactorySpec:
    """How to rebuild a run's model: ``factory`` (``FILE.py:FUNC`` or ``module:FUNC``, as the
    user gave it) called with ``input_shape`` and ``num_classes``."""

    factory: str
    input_shape: tuple[int, ...]
    num_classes: int

    def to_dict(self) -> dict[str, Any]:
        return {"factory": self.factory, "input_shape": list(self.input_shape),
                "num_classes": self.num_classes}

    @classmethod
    def from_dict(cls, values: Any) -> FactorySpec:
        """The record of a checkpoint, type-checked (a checkpoint is data, never obeyed)."""
        ok = (isinstance(values, dict) and isinstance(values.get("factory"), str)
              and isinstance(values.get("input_shape"), list | tuple)
              and all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                      for d in values["input_shape"])
              and isinstance(values.get("num_classes"), int)
              and not isinstance(values["num_classes"], bool))
        if not ok:
            raise ConfigError("the model factory record is malformed (factory, input_shape, "
                              "num_classes)")
        return cls(values["factory"], tuple(values["input_shape"]), values["num_classes"])


def _split(spec: str) -> tuple[str, str]:
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ConfigError(f"--model {spec!r}: expected FILE.py:FUNC or module:FUNC")
    return where, name


def _file_module(where: str) -> Any:
    """The module of a factory file, imported once per process."""
    path = Path(where).expanduser().resolve()
    key = str(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file {where}")
    if key not in _FILE_MODULES:
        tag = hashlib.sha256(key.encode()).hexdigest()[:12]
        location = importlib.util.spec_from_file_location(f"fedlap_user_model_{tag}", path)
        if location is None or location.loader is None:
            raise ImportError(f"cannot load {where}")
        module = importlib.util.module_from_spec(location)
        location.loader.exec_module(module)
        _FILE_MODULES[key] = module
    return _FILE_MODULES[key]


def load_factory(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names (its module imported: user code). One line if it cannot be
    imported, raises while importing, or is not callable."""
    where, name = _split(spec)
    try:
        module = _file_module(where) if where.endswith(".py") else importlib.import_module(where)
    except Exception as exc:  # user code: whatever its import raises is one line
        raise ConfigError(f"--model {spec!r}: cannot import it ({type(exc).__name__}: "
                          f"{_first_line(exc)})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"--model {spec!r}: {where} has no function {name}")
    return function


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:160]


def build_model(spec: FactorySpec) -> nn.Module:
    """``FUNC(input_shape, num_classes)``, checked: a module, without record-mixing layers."""
    function = load_factory(spec.factory)
    try:
        model = function(tuple(spec.input_shape), int(spec.num_classes))
    except Exception as exc:  # user code: whatever it raises is one line
        raise ConfigError(f"--model {spec.factory!r} raised {type(exc).__name__} for input "
                          f"shape {tuple(spec.input_shape)} and {spec.num_classes} classes: "
                          f"{_first_line(exc)}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec.factory!r} returned a {type(model).__name__}, not a "
                          "torch.nn.Module")
    check_per_record(model, spec.factory)
    return model


def check_per_record(model: nn.Module, name: str = "the model") -> None:
    """Refuse a module whose layers mix the records of a batch (module docstring)."""
    for path, module in model.named_modules():
        tracking = (isinstance(module, nn.modules.instancenorm._InstanceNorm)
                    and module.track_running_stats)
        if isinstance(module, _MIXING) or tracking:
            kind = type(module).__name__
            raise ConfigError(
                f"{name}: layer {path or '(top)'!r} is {kind}, which mixes the records of a "
                "batch and breaks per-record DP; use GroupNorm or LayerNorm instead"
            )
