"""Rehearse a Flower strategy's training rounds in-process, with synthetic clients.

:func:`rehearse` drives any Flower strategy (legacy ``flwr.server.strategy`` or Message-API
``flwr.serverapp.strategy``, wrapped or not in
:func:`~fedlap_privacy.audit.flower.flower_audit.CanaryClients`) through its own
``configure_fit`` / ``aggregate_fit`` (or ``configure_train`` / ``aggregate_train``) calls,
without a deployment: a population of ``population`` clients is available, the strategy
samples among them as it would, and every sampled client answers with the round's model
plus a synthetic update (a shared drift plus its own random part, of norm ``update_norm``,
weight ``num_examples``). It audits what the server does with the replies (clipping,
weighting, noise), in seconds, before a real deployment. A Message-API strategy runs as the
ServerApp of Flower's Simulation Engine (:func:`_in_flower_runtime`: Flower's public API
gives its messages a run's identity only there), which needs the ``simulation`` extra and
adds Ray's start, about 10 s. Imported only when called (Flower is an optional extra).
"""

from __future__ import annotations

import logging
import math
import signal
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common import (
    Code,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy as MessageStrategy

from fedlap_privacy.audit.flower.flower_strategies import find_attribute
from fedlap_privacy.errors import ConfigError

__all__ = ["rehearse"]


class _SyntheticProxy(ClientProxy):
    """A client of the rehearsal: its replies are made by :func:`rehearse`, never asked."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("a rehearsal client answers only inside rehearse()")

    get_properties = get_parameters = fit = evaluate = reconnect = _refuse  # type: ignore[assignment]


class _Population:
    """The node ids a Message-API strategy samples from (the one Grid call it makes)."""

    def __init__(self, size: int) -> None:
        self._ids = list(range(1, size + 1))

    def get_node_ids(self) -> list[int]:
        return list(self._ids)


class _Updates:
    """Synthetic client updates: ``drift`` of the norm along one direction shared by all
    clients (what training has in common), the rest along each reply's own direction."""

    def __init__(self, dimension: int, norm: float, drift: float, seed: int | None) -> None:
        self.rng = np.random.default_rng(seed)
        g = self.rng.standard_normal(dimension)
        self.shared = g / np.linalg.norm(g)
        self.norm, self.drift = norm, drift

    def __call__(self, current: np.ndarray) -> np.ndarray:
        own = self.rng.standard_normal(current.size)
        own /= np.linalg.norm(own)
        update = self.drift * self.shared + math.sqrt(1.0 - self.drift**2) * own
        return (current + self.norm * update).astype(np.float32)


@contextmanager
def _quiet_flower(quiet: bool) -> Iterator[None]:
    """Flower's per-reply INFO lines muted (below errors) while the block runs, when
    ``quiet``."""
    logger = logging.getLogger("flwr")
    level = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _in_flower_runtime(work: Callable[[], np.ndarray]) -> np.ndarray:
    """``work()`` run as the ServerApp of Flower's Simulation Engine (its public
    ``flwr.simulation.run_simulation``), in this process: a Message-API strategy builds its
    instructions with ``Message(...)``, which takes the run's identity that only Flower's
    runtimes give a ServerApp. The one virtual SuperNode is never asked (the replies are
    :func:`rehearse`'s). Ray is started for the call on this machine, its sockets and
    session files in a temporary folder of this user's, and shut down after it; the
    process's SIGTERM handler, which ``ray.init`` replaces, is restored."""
    try:
        import ray
        from flwr.simulation import run_simulation
    except ImportError:
        raise ConfigError("rehearsing a Message-API strategy runs it in Flower's Simulation "
                          "Engine: pip install '.[simulation]' in a clone of "
                          "fedlap-privacy") from None
    if ray.is_initialized():
        raise ConfigError("rehearsing a Message-API strategy starts a Ray instance of its "
                          "own: call it outside a running Ray (ray.shutdown() first)")
    done: list[np.ndarray] = []
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        done.append(work())

    before = signal.getsignal(signal.SIGTERM)
    with tempfile.TemporaryDirectory(prefix="fedlap-ray-") as tmp, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Ray's tips, Flower's deprecation notice
        init = {"address": "local", "logging_level": "ERROR", "log_to_driver": False,
                "include_dashboard": False, "_temp_dir": tmp}
        try:
            ray.init(**init)
            run_simulation(server_app=app, client_app=ClientApp(), num_supernodes=1,
                           backend_config={"client_resources": {"num_cpus": 1.0,
                                                                "num_gpus": 0.0},
                                           "init_args": init})
        finally:
            if ray.is_initialized():
                ray.shutdown()
            signal.signal(signal.SIGTERM, before)
    if not done:
        raise ConfigError("Flower's Simulation Engine ended before the rehearsal ran")
    return done[0]


def rehearse(strategy: Any, rounds: int, *, population: int, dimension: int,
             update_norm: float = 1.0, drift: float = 0.5, num_examples: int = 100,
             seed: int | None = None, quiet: bool = True) -> np.ndarray:
    """Run ``rounds`` training rounds of ``strategy`` with synthetic clients (module
    docstring), starting from a model of ``dimension`` zeros; returns the final model.
    ``seed`` fixes the clients' updates only (Flower's own noise draws from
    ``np.random``); ``quiet`` mutes Flower's log below errors meanwhile."""
    if not (isinstance(rounds, int) and rounds >= 1):
        raise ConfigError(f"rounds must be an integer >= 1, got {rounds!r}")
    if not (isinstance(population, int) and population >= 2):
        raise ConfigError(f"population must be an integer >= 2, got {population!r}")
    if not (isinstance(dimension, int) and dimension >= 3):
        raise ConfigError(f"dimension must be an integer >= 3, got {dimension!r}")
    if not (0.0 <= drift <= 1.0 and math.isfinite(update_norm) and update_norm > 0):
        raise ConfigError(f"need 0 <= drift <= 1 and update_norm > 0, got {drift}, "
                          f"{update_norm}")
    updates = _Updates(dimension, update_norm, drift, seed)
    model = np.zeros(dimension, dtype=np.float32)
    if isinstance(strategy, LegacyStrategy):
        with _quiet_flower(quiet):
            return _legacy(strategy, rounds, population, model, updates, num_examples)
    if isinstance(strategy, MessageStrategy):
        with _quiet_flower(quiet):
            return _in_flower_runtime(lambda: _messages(strategy, rounds, population, model,
                                                        updates, num_examples))
    raise ConfigError(f"rehearse drives a Flower strategy (flwr.server.strategy or "
                      f"flwr.serverapp.strategy), got {type(strategy).__name__}")


def _legacy(strategy: LegacyStrategy, rounds: int, population: int, model: np.ndarray,
            updates: _Updates, num_examples: int) -> np.ndarray:
    clients = SimpleClientManager()
    for i in range(population):
        clients.register(_SyntheticProxy(str(i)))
    parameters = ndarrays_to_parameters([model])
    for t in range(1, rounds + 1):
        current = parameters_to_ndarrays(parameters)[0]
        results = [(proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(
            [updates(current)]), num_examples, {}))
            for proxy, _ in strategy.configure_fit(t, parameters, clients)]
        aggregated, _ = strategy.aggregate_fit(t, results, [])
        if aggregated is not None:
            parameters = aggregated
    return parameters_to_ndarrays(parameters)[0]


def _messages(strategy: MessageStrategy, rounds: int, population: int, model: np.ndarray,
              updates: _Updates, num_examples: int) -> np.ndarray:
    grid = _Population(population)
    arrays_key = find_attribute(strategy, "arrayrecord_key") or "arrays"
    weight_key = find_attribute(strategy, "weighted_by_key") or "num-examples"
    arrays = ArrayRecord({"model": Array(model)})
    for t in range(1, rounds + 1):
        current = arrays["model"].numpy()
        replies = []
        for instruction in strategy.configure_train(t, arrays, ConfigRecord(), grid):  # type: ignore[arg-type]
            content = RecordDict({
                arrays_key: ArrayRecord({"model": Array(updates(current))}),
                "metrics": MetricRecord({weight_key: num_examples})})
            replies.append(Message(content, reply_to=instruction))
        aggregated, _ = strategy.aggregate_train(t, replies)
        if aggregated is not None:
            arrays = aggregated
    return arrays["model"].numpy()
