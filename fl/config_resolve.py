"""From what a user typed to a validated configuration: the ``--set KEY=VALUE`` parser (the
one parser of a configuration value, shared with Flower's run config), the layering of
defaults, schedule, preset, flags and settings (:func:`resolve_config`), the same layers
under the keys a Python caller gave :class:`TrainConfig` (:func:`resolve_given`, the path of
the Python API's ``train``), and what ``train --resume`` continues (:func:`resumed_config`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import (
    DEFAULT_SIGMA,
    PRESETS,
    TrainConfig,
    field_types,
    optional_field,
)
from fedlap_privacy.fl.methods.schedule import (
    SCHEDULED_METHOD,
    ClientSchedule,
    CrossDevice,
    choose_schedule,
    cross_device,
)

__all__ = [
    "check_resume_flags", "config_value", "cross_device_defaults", "fedlap_schedule",
    "number_text", "parse_overrides",
    "resolve_config", "resolve_given", "resumed_config", "typed_value",
]


def config_value(key: str, raw: Any, *, text: bool) -> Any:
    """The ONE parser of a configuration value: ``raw`` for field ``key`` as its type.

    ``text=True`` (``--set KEY=VALUE``): ``raw`` is text, read as the field's type
    (``none``/``null``/empty for an optional field; true/false/1/0 for a bool; a number
    also as a fraction, ``1/30``: :func:`number_text`). ``text=False``
    (a Flower run config, TOML-typed): ``raw`` must already have the field's type (an
    integral float for an int), ``""`` standing for None; nothing is converted from text.
    Ranges are not checked here: :meth:`TrainConfig.validate` does (:data:`FIELD_RULES`).
    """
    types = field_types()
    if key not in types:
        raise ConfigError(f"unknown configuration key {key.replace('_', '-')!r}")
    kind = types[key]
    if text:
        word = str(raw).strip()
        if optional_field(key) and word.lower() in ("none", "null", ""):
            return None
        try:
            if kind is bool:
                return {"true": True, "false": False, "1": True, "0": False}[word.lower()]
            return number_text(word) if kind is float else kind(word)
        except (KeyError, ValueError):
            raise ConfigError(f"{key}: {word!r} is not a valid {kind.__name__}") from None
    if raw == "" and optional_field(key):
        return None
    return typed_value(key.replace("_", "-"), kind, raw)


def number_text(text: str) -> float:
    """A number typed as text: a float (``0.05``, ``1e-5``) or a fraction of two (``1/30``,
    a client fraction as a user writes it). A ValueError (:class:`ConfigError`) otherwise."""
    top, slash, bottom = text.strip().partition("/")
    try:
        if not slash:
            return float(top)
        value = float(top) / float(bottom)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"{text!r} is not a number (e.g. 0.05 or 1/30)") from None
    return value


def typed_value(name: str, kind: type, raw: Any) -> Any:
    """``raw`` as a ``kind`` (bool, int, float, str), refusing anything but that type (an
    integral float passes for an int): the check of a TOML-typed value."""
    ok = {
        bool: isinstance(raw, bool),
        int: isinstance(raw, int | float) and not isinstance(raw, bool)
        and math.isfinite(raw) and float(raw).is_integer(),
        float: isinstance(raw, int | float) and not isinstance(raw, bool),
        str: isinstance(raw, str),
    }[kind]
    if not ok:
        raise ConfigError(f"configuration key {name} must be {kind.__name__}, not {raw!r}")
    return kind(raw)


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["key=value", ...]`` (``--set``) -> typed TrainConfig values (:func:`config_value`)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in field_types():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a configuration key")
        try:
            out[key] = config_value(key, text, text=True)
        except ConfigError as exc:
            raise ConfigError(f"--set {item!r}: {exc}") from None
    return out


def resolve_config(
    preset: str | None = None,
    flags: dict[str, Any] | None = None,
    settings: Sequence[str] = (),
    plan_sigma_for_target: bool = True,
    schedule: str = "auto",
) -> TrainConfig:
    """The one way from what a user typed to a validated configuration.

    Layers, each over the previous: the defaults, FedLAP-DP's ``schedule`` (``auto``: picked
    from the client size, :mod:`~fedlap_privacy.fl.methods.schedule`) or the cross-device
    defaults of the other methods (many clients of few records each, the same module),
    ``preset`` (:data:`PRESETS`),
    ``flags`` (None: not given) and ``settings`` (``--set KEY=VALUE``). Then, with
    ``plan_sigma_for_target``, a target epsilon given without a sigma (neither as a flag nor
    as a setting) plans sigma for the rounds, except for methods whose budget rule keeps a
    fixed sigma (ALI-DPFL).
    """
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"preset {preset!r} must be one of {', '.join(PRESETS)}")
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    given.update(parse_overrides(settings))
    return _layered(given, preset, schedule, plan_sigma_for_target)


def resolve_given(cfg: TrainConfig, schedule: str = "auto") -> TrainConfig:
    """The Python API's way to the CLI's configuration (:func:`resolve_config`): the keys the
    caller set (:attr:`TrainConfig.given`) play the part of the flags a user typed, every
    other key is decided as ``train`` decides it (FedLAP-DP's ``schedule``, the cross-device
    defaults, sigma planned for a target). A key the caller set always wins, even where it
    equals the default. Idempotent: the configuration returned has every key given, so
    resolving it again returns it unchanged (as does resolving a recorded one)."""
    if cfg.given == frozenset(field_types()):
        if schedule != "auto":
            fedlap_schedule(schedule, cfg.to_dict())  # refuse a schedule for another method
        return cfg.validate()
    return _layered(cfg.given_values(), None, schedule, True)


def _layered(given: dict[str, Any], preset: str | None, schedule: str,
             plan_sigma_for_target: bool) -> TrainConfig:
    """The layers of :func:`resolve_config` under the ``given`` keys, as a validated
    configuration with every key given (its values decided)."""
    values = {**(PRESETS[preset] if preset else {}), **given}
    chosen = fedlap_schedule(schedule, values)
    if chosen is not None:
        values = {**chosen.values(values.get("rounds", TrainConfig.rounds)), **values}
    scale = cross_device_defaults(values)
    if scale is not None:
        values = {**scale.values(), **values}
    if "sigma" not in given:
        if plan_sigma_for_target and given.get("target_eps") is not None:
            values.pop("sigma", None)  # a preset's sigma too: TrainConfig plans it (plans_sigma)
        elif "sigma" not in values:
            values["sigma"] = DEFAULT_SIGMA
    # dataclasses.replace passes every key: the configuration returned has them all given
    return dataclasses.replace(TrainConfig.from_dict(values)).validate()


def check_resume_flags(
    recorded: TrainConfig,
    flags: Mapping[str, tuple[str, Any]],
    preset: str | None = None,
    settings: Sequence[str] = (),
    schedule: str = "auto",
) -> None:
    """``train --resume`` continues a run with its RECORDED configuration: refuse, in one line
    naming them, the flags that ask for another value (they used to be ignored silently).

    ``flags``: each flag the user typed, its name -> (configuration key, value); ``preset``,
    ``settings`` (``--set``) and a named ``schedule`` (``auto``: none), layered as
    :func:`resolve_config` layers them, so a flag shadows the preset's or schedule's value of
    its key, and a target epsilon given without a sigma asks for the planned sigma the run
    recorded. A flag equal to the recorded value passes. ``--rounds`` is not among ``flags``:
    it may change the total; a preset's or schedule's round count is left out likewise.
    """
    asked: dict[str, tuple[str, Any]] = {}  # key -> (the flag that asks, as shown; the value)
    chosen = None if schedule == "auto" else fedlap_schedule(schedule, recorded.to_dict())
    if chosen is not None:
        asked.update({k: (f"--schedule {schedule} ({k}={v!r})", v)
                      for k, v in chosen.values(recorded.rounds).items()})
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"preset {preset!r} must be one of {', '.join(PRESETS)}")
        asked.update({k: (f"--preset {preset} ({k}={v!r})", v)
                      for k, v in PRESETS[preset].items()})
    asked.pop("rounds", None)
    overrides = parse_overrides(settings)
    asked.update({key: (f"{flag} {value!r}", value) for flag, (key, value) in flags.items()})
    asked.update({key: (f"--set {key}={value!r}", value) for key, value in overrides.items()})
    typed = {key for key, _ in flags.values()} | set(overrides)
    if "target_eps" in typed and "sigma" not in typed:
        asked.pop("sigma", None)  # the planned sigma, as the run planned it
    conflicts = [
        f"{shown} (the run has {getattr(recorded, key)!r})"
        for key, (shown, value) in asked.items() if not _same(key, value, getattr(recorded, key))
    ]
    if conflicts:
        raise ConfigError(f"--resume continues the run with its recorded settings; these flags "
                          f"differ: {'; '.join(conflicts)} (only --rounds may change)")


def _same(key: str, asked: Any, recorded: Any) -> bool:
    """Whether a flag's value is the recorded one (a data folder: the same folder)."""
    if key == "data_dir" and asked is not None and recorded is not None:
        return Path(asked).resolve() == Path(recorded).resolve()
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (asked, recorded))
    return asked == recorded if numbers else type(asked) is type(recorded) and asked == recorded


def resumed_config(
    out: str | Path,
    flags: Mapping[str, tuple[str, Any]],
    preset: str | None = None,
    settings: Sequence[str] = (),
    schedule: str = "auto",
    rounds: int | None = None,
) -> TrainConfig:
    """The configuration ``train --resume`` continues: the run's recorded one (``rounds``: a
    new total), after :func:`check_resume_flags` found no flag asking for another value and
    a model factory of the user's is named by ``--model`` (the recorded one is never
    imported on its own: :func:`fedlap_privacy.model_factory.named_factory`)."""
    from fedlap_privacy.fl.run.run_files import PRIVATE, load_run_config
    from fedlap_privacy.model_factory import named_factory

    recorded = load_run_config(Path(out))
    check_resume_flags(recorded, flags, preset, settings, schedule)
    if recorded.model is not None:
        named = flags["--model"][1] if "--model" in flags else None
        named_factory(recorded.model, named, str(Path(out) / PRIVATE), "--model", exact=True)
    return (recorded if rounds is None else dataclasses.replace(recorded, rounds=rounds)).validate()


def fedlap_schedule(requested: str, values: dict[str, Any]) -> ClientSchedule | None:
    """The schedule :func:`resolve_config` lays under ``values`` (configuration keys, the
    defaults where absent); None for a method other than FedLAP-DP, which ``requested``
    must then leave at ``auto``."""
    default = TrainConfig()
    method = values.get("method", default.method)
    if method != SCHEDULED_METHOD:
        if requested != "auto":
            raise ConfigError(f"--schedule {requested}: schedules are FedLAP-DP's, not {method}'s")
        return None
    return choose_schedule(
        requested, *(values.get(key, getattr(default, key)) for key in
                     ("dataset", "clients", "client_records", "validation_records", "data")),
    )


def cross_device_defaults(values: dict[str, Any]) -> CrossDevice | None:
    """The cross-device defaults :func:`resolve_config` lays under ``values`` (configuration
    keys, the defaults where absent; :func:`~fedlap_privacy.fl.methods.schedule.cross_device`),
    None where the run is not cross-device or is FedLAP's."""
    default = TrainConfig()
    return cross_device(*(values.get(key, getattr(default, key)) for key in
                          ("method", "dataset", "clients", "client_records",
                           "validation_records", "data", "model")))
