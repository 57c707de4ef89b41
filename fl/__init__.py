"""Federated training: FedLAP / FedLAP-DP and the field's other methods (docs/algorithms.md).

>>> from fedlap_privacy.fl import TrainConfig, train
>>> result = train(TrainConfig(), "runs/example")   # FedLAP-DP on digits

:func:`train` decides the keys a configuration was not given as the CLI decides the flags a
user did not type (:func:`resolve_given`, which shows the configuration a run will have).
The configuration imports without torch (so the CLI's ``plan`` stays light); the drivers
load on first use.
"""

from typing import Any

from fedlap_privacy.fl.config import PRESETS, TrainConfig
from fedlap_privacy.fl.config_resolve import resolve_given
from fedlap_privacy.fl.config_rules import METHODS

__all__ = ["METHODS", "PRESETS", "TrainConfig", "TrainResult", "resolve_given", "resume",
           "train"]


def __getattr__(name: str) -> Any:
    if name in ("TrainResult", "resume", "train"):
        from fedlap_privacy.fl.engine import simulation

        return getattr(simulation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
