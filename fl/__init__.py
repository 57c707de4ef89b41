"""Federated training: FedLAP / FedLAP-DP and the field's other methods (docs/algorithms.md).

>>> from fedlap_privacy.fl import TrainConfig, train
>>> result = train(TrainConfig(), "runs/example")   # FedLAP-DP on digits

In a terminal, :func:`train` and :func:`resume` print a line per round on stderr
(``progress=False``: silent; ``progress=True``: also outside a terminal); a ``callback``
receives the events instead.

:func:`train` decides the keys a configuration was not given as the CLI decides the flags a
user did not type (:func:`resolve_given`, which shows the configuration a run will have).
The configuration imports without torch (so the CLI's ``plan`` stays light); the drivers
load on first use.
"""

from typing import TYPE_CHECKING, Any

from fedlap_privacy.fl.config import PRESETS, TrainConfig
from fedlap_privacy.fl.config_resolve import resolve_given
from fedlap_privacy.fl.config_rules import METHODS

if TYPE_CHECKING:
    from fedlap_privacy.fl.engine.simulation import TrainResult

__all__ = ["METHODS", "PRESETS", "TrainConfig", "TrainResult", "resolve_given", "resume",
           "train"]


def train(cfg: TrainConfig, out_dir: Any = None, *args: Any, progress: bool | None = None,
          **kwargs: Any) -> "TrainResult":
    """:func:`fedlap_privacy.fl.engine.simulation.train`, with a line per round on stderr
    when stderr is a terminal (``progress=None``, the default), always (True) or never
    (False)."""
    from fedlap_privacy.fl.engine import simulation

    return simulation.train(cfg, out_dir, *args, progress=progress, **kwargs)


def resume(out_dir: Any, *args: Any, progress: bool | None = None,
           **kwargs: Any) -> "TrainResult":
    """:func:`fedlap_privacy.fl.engine.simulation.resume`, with :func:`train`'s progress."""
    from fedlap_privacy.fl.engine import simulation

    return simulation.resume(out_dir, *args, progress=progress, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "TrainResult":
        from fedlap_privacy.fl.engine import simulation

        return getattr(simulation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
