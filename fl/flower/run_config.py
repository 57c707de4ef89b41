"""The run config (Flower's TOML values) <-> :class:`TrainConfig`, and the Flower App files.

Contract: every :class:`TrainConfig` field travels under its kebab-case name (``target-eps``,
``batch-size``; ``""`` stands for None) and the driver's own keys are those of
:data:`DRIVER_DEFAULTS`. :func:`parse_config` is the ONE parser of such values — for the
run config the ServerApp receives and for the configuration a ClientApp receives in an
instruction — and it is strict: an unknown key, or a value of the wrong type (a string for a
number, a bool for an integer, a fraction for an integer), is a one-line
:class:`~fedlap_privacy.errors.ConfigError`. It does not validate ranges: callers run
:meth:`TrainConfig.validate` (and a node its policy, :mod:`.policy`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig, field_types
from fedlap_privacy.fl.config_resolve import config_value, typed_value

__all__ = [
    "APP_NAME", "DRIVER_DEFAULTS", "config_from_run_config", "config_values", "parse_config",
    "run_config_of", "toml_table", "write_app",
]

#: the driver's own run-config keys (beside TrainConfig's) and their defaults
DRIVER_DEFAULTS: dict[str, Any] = {
    "out": "runs/flower",  # on the SuperLink's machine; relative to where it was started
    "device": "auto",  # the server's device (evaluation, global optimisation)
    "round-timeout": 0.0,  # seconds to wait for the selected clients; 0: no limit
    "allow-client-failures": False,  # continue a round without clients that do not answer
    "node-wait": 120.0,  # seconds to wait for a SuperNode per partition before round 1
    "resume": False,  # continue the run in `out` (then `rounds` > 0 raises the total)
    # the token of the lock `train --engine flower` holds on `out` for this ServerApp
    # (fedlap_privacy.state.run_lock); "": the ServerApp takes the lock itself
    "run-lock": "",
}
APP_NAME = "fedlap-flower"
#: where ``flwr run`` finds the apps (written into the App's pyproject.toml)
SERVER_APP_REF = "fedlap_privacy.fl.flower.server_app:server_app"
CLIENT_APP_REF = "fedlap_privacy.fl.flower.client_app:client_app"
Value = bool | int | float | str


def _kebab(name: str) -> str:
    return name.replace("_", "-")


def config_values(cfg: TrainConfig) -> dict[str, Value]:
    """``cfg`` as run-config values: kebab-case keys, ``""`` for None."""
    return {_kebab(k): ("" if v is None else v) for k, v in cfg.to_dict().items()}


def parse_config(values: dict[str, Any]) -> TrainConfig:
    """The :class:`TrainConfig` of run-config values (strict; see the module docstring):
    every value through :func:`fedlap_privacy.fl.config_resolve.config_value`, the one parser."""
    out = {key.replace("-", "_"): config_value(key.replace("-", "_"), raw, text=False)
           for key, raw in values.items()}
    return TrainConfig.from_dict(out)


def run_config_of(cfg: TrainConfig, **driver: Any) -> dict[str, Value]:
    """The run config (TOML values) of ``cfg`` and the driver's keys; None becomes ``""``."""
    values: dict[str, Any] = config_values(cfg)
    unknown = set(map(_kebab, driver)) - set(DRIVER_DEFAULTS)
    if unknown:
        raise ConfigError(f"unknown Flower driver options: {', '.join(sorted(unknown))}")
    values.update(DRIVER_DEFAULTS)
    values.update({_kebab(k): v for k, v in driver.items()})
    return values


def config_from_run_config(run_config: dict[str, Any]) -> tuple[TrainConfig, dict[str, Any]]:
    """(TrainConfig, driver options) from a Flower run config; ``""`` means None."""
    driver = dict(DRIVER_DEFAULTS)
    rest: dict[str, Any] = {}
    for key, raw in run_config.items():
        if key in DRIVER_DEFAULTS:
            driver[key] = typed_value(key, type(DRIVER_DEFAULTS[key]), raw)
        elif key.replace("-", "_") in field_types():
            rest[key] = raw
        else:
            raise ConfigError(f"unknown run-config key {key!r}")
    return parse_config(rest), driver


def _toml_value(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def toml_table(values: dict[str, Any]) -> str:
    """``key = value`` lines of a TOML table (bool, int, float and str values)."""
    return "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items())


def write_app(directory: str | Path, cfg: TrainConfig | None = None, **driver: Any) -> Path:
    """Write the Flower App (``pyproject.toml``) that ``flwr run DIRECTORY`` starts.

    Its run config lists every key with the values of ``cfg`` (default: TrainConfig's
    defaults) and the driver options; ``flwr run --run-config`` overrides any of them.
    The app's code is the installed package: every machine needs fedlap-privacy with its
    ``flower`` extra.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    run_config = run_config_of(cfg or TrainConfig(), **driver)
    text = (
        "# Flower App of fedlap-privacy (written by "
        "fedlap_privacy.fl.engine.flower_app.write_app)\n"
        "[project]\n"
        f'name = "{APP_NAME}"\nversion = "0.1.0"\n'
        'description = "FedLAP-DP and its baselines on Flower"\nlicense = "MIT"\n'
        "dependencies = []  # fedlap-privacy with its flower extra on every machine\n\n"
        '[tool.flwr.app]\npublisher = "fedlap-privacy"\n\n'
        "[tool.flwr.app.components]\n"
        f'serverapp = "{SERVER_APP_REF}"\n'
        f'clientapp = "{CLIENT_APP_REF}"\n\n'
        "[tool.flwr.app.config]\n" + toml_table(run_config)
    )
    (directory / "pyproject.toml").write_text(text)
    return directory
