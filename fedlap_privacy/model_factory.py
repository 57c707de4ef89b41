"""A user's model: ``--model FILE.py:FUNC`` or ``--model module:FUNC`` (docs/own-data.md).

``FUNC(input_shape, num_classes)`` returns any ``torch.nn.Module`` taking a batch of records
``(B, *input_shape)`` to ``(B, num_classes)`` logits. The factory is code the USER names on
the command line, imported from their own installation or file; nothing from a data file or
a checkpoint is ever imported or run. A run records only the factory's spec
(:class:`FactorySpec`: the text the user gave, the input shape, the classes) in ``ckpt.pt``
and ``private.pt``, never code.

Consent (:func:`named_factory`): a spec read from a run's files is data that anyone who
handed over the folder may have edited, so it is SHOWN, never imported on its own. A model
that a recorded spec describes is rebuilt only from the factory that the person running the
command names (``audit --model-factory``, ``train --resume --model`` equal to the recorded
spec), or, for the package's own factories, by an exact match of the recorded text against
the fixed table :data:`BUILTIN_FACTORIES`, which maps it to the function itself: nothing is
imported by a recorded name.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from torch import nn

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.models import tabular_mlp

__all__ = ["BUILTIN_FACTORIES", "DEFAULT_TABULAR", "FactorySpec", "build_model",
           "check_per_record", "load_factory", "named_factory", "shown_spec"]

#: the model of tabular data when ``--model`` is not given
DEFAULT_TABULAR = "fedlap_privacy.models:tabular_mlp"
#: the package's own factories by their exact spec: a recorded spec equal to a key is rebuilt
#: from this table without consent (package code, not the user's); any other text is not
BUILTIN_FACTORIES: Mapping[str, Callable[..., nn.Module]] = MappingProxyType(
    {DEFAULT_TABULAR: tabular_mlp})
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


def shown_spec(spec: str) -> str:
    """A recorded spec as a message shows it: as written when it is short printable text
    without spaces or markup brackets, else quoted (``repr``, at most 200 characters)."""
    plain = (spec.isprintable() and len(spec) <= 200
             and not any(c.isspace() or c in "[]'\"" for c in spec))
    return spec if plain else repr(spec[:200])


def named_factory(recorded: str, named: str | None, where: str, flag: str,
                  exact: bool = False) -> str:
    """The factory that may rebuild a model whose spec ``recorded`` was read from ``where``
    (a run's file): ``named``, the spec that the person running the command gave with
    ``flag`` (``exact``: it must be the recorded text itself, as on ``train --resume``), else
    the recorded spec only where it is one of :data:`BUILTIN_FACTORIES`. Anything else is
    one line showing the recorded spec, which is never imported (module docstring)."""
    if named is not None:
        if exact and named != recorded:
            raise ConfigError(f"{flag} {shown_spec(named)} is not the factory of this run "
                              f"({shown_spec(recorded)}, recorded in {where})")
        return named
    if recorded in BUILTIN_FACTORIES:
        return recorded
    shown = shown_spec(recorded)
    raise ConfigError(f"this run's model was built by {shown} (recorded in {where}, not "
                      f"imported); rerun with {flag} {shown} if that code is yours")


def load_factory(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names: one of :data:`BUILTIN_FACTORIES`, or its module imported
    (user code, named by the user). One line if it cannot be imported, raises while
    importing, or is not callable."""
    if spec in BUILTIN_FACTORIES:
        return BUILTIN_FACTORIES[spec]
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
