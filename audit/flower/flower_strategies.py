"""Flower strategies that insert canary clients (:mod:`.flower_canaries`): one for the legacy
``flwr.server.strategy`` API (``configure_fit`` / ``aggregate_fit``), one for the Message API
of ``flwr.serverapp.strategy`` (``configure_train`` / ``aggregate_train``). Both delegate every
call to the wrapped strategy and, in the training aggregation, add the round's canary replies
(replacing as many sampled real replies by default) before calling it, then record the
aggregated model's change. Imported only when :func:`~.flower_audit.CanaryClients` is
called (Flower is an optional extra).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common import (
    Code,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy as MessageStrategy

from fedlap_privacy.audit.flower.flower_canaries import (
    SERVER_SIDE_SCALE,
    CanaryClientRounds,
    FlowerAudit,
)
from fedlap_privacy.errors import ConfigError

__all__ = ["LegacyCanaryClients", "MessageCanaryClients", "find_attribute", "wrap"]

#: the metric Flower's adaptive clipping reads from every reply (its clients' mods set it)
NORM_BIT = "norm_bit"


def find_attribute(strategy: Any, name: str) -> Any:
    """``name`` on ``strategy`` or the first strategy it wraps (``.strategy`` chain)."""
    seen = 0
    while strategy is not None and seen < 16:
        if hasattr(strategy, name):
            return getattr(strategy, name)
        strategy, seen = getattr(strategy, "strategy", None), seen + 1
    return None


def _client_side(strategy: Any) -> bool:
    """Whether a wrapper in the chain expects its clients to clip (``...ClientSide...``)."""
    seen = 0
    while strategy is not None and seen < 16:
        if "ClientSide" in type(strategy).__name__:
            return True
        strategy, seen = getattr(strategy, "strategy", None), seen + 1
    return False


def _flat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])


def _unflat(flat: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    out, start = [], 0
    for a in like:
        out.append(flat[start:start + a.size].reshape(a.shape).astype(a.dtype))
        start += a.size
    return out


@dataclass(frozen=True)
class _Settings:
    clip_norm: float | None
    update_scale: float | None
    num_examples: float | None
    replace_clients: bool


class _Canaries:
    """What both APIs share: the clip, the canary replies of a round, the audit."""

    strategy: Any
    canaries: CanaryClientRounds
    settings: _Settings
    _current: list[np.ndarray]
    _rate: float | None
    _round_clip: float

    def _setup(self, strategy: Any, canaries: CanaryClientRounds, settings: _Settings) -> None:
        self.strategy, self.canaries, self.settings = strategy, canaries, settings
        self._current, self._rate, self._round_clip = [], None, 0.0

    def _clip(self) -> float:
        clip = self.settings.clip_norm or find_attribute(self.strategy, "clipping_norm")
        if clip is None or not clip > 0:
            raise ConfigError("the strategy has no clipping_norm: CanaryClients goes OUTSIDE "
                              "Flower's DP wrapper (for a strategy without one, pass "
                              "clip_norm=, the clip the canaries are scaled to)")
        return float(clip)

    def _round(self, weights: list[float]) -> tuple[list[tuple[np.ndarray, float]], set[int]]:
        """This round's canary replies (flat parameters, weight) and the real replies they
        replace (indices into ``weights``)."""
        if self._rate is None or not self._current:
            raise ConfigError("aggregation before configuration: CanaryClients must see the "
                              "round's configure call (wrap the outermost strategy)")
        current = _flat(self._current)
        self.canaries.start(current.size)
        clip = self._clip()
        scale = self.settings.update_scale or (1.0 if _client_side(self.strategy)
                                               else SERVER_SIDE_SCALE)
        weight = self.settings.num_examples or (float(np.median(weights)) if weights else 1.0)
        picked = self.canaries.sample(self._rate)
        replies = [(current + self.canaries.update(int(j), scale * clip), weight)
                   for j in picked]
        dropped: set[int] = set()
        if self.settings.replace_clients and weights:
            order = self.canaries.drop(len(weights))
            dropped = {int(i) for i in order[:len(replies)]}
        self._round_clip = clip
        return replies, dropped

    def _observe(self, aggregated: list[np.ndarray] | None, replies: int) -> None:
        if aggregated is None:
            return
        n = find_attribute(self.strategy, "num_sampled_clients") or replies
        self.canaries.observe(_flat(aggregated) - _flat(self._current), self._round_clip, n)

    def audit(self, delta: float = 1e-5, *, noise_multiplier: float | None = None,
              sample_rate: float | None = None, rounds: int | None = None,
              claimed_epsilon: float | None = None, confidence: float = 0.95,
              out: str | None = None) -> FlowerAudit:
        """Score the canaries and test the claim: by default the wrapper's noise multiplier,
        the rate the strategy sampled at and the rounds aggregated
        (:meth:`~fedlap_privacy.audit.flower.flower_canaries.CanaryClientRounds.audit`); ``out``:
        a folder for report.json / report.md."""
        z = noise_multiplier if noise_multiplier is not None else find_attribute(self.strategy,
                                                                       "noise_multiplier")
        if z is None:
            raise ConfigError("the strategy has no noise_multiplier: pass the claimed "
                              "noise_multiplier= to audit()")
        result = self.canaries.audit(float(z), delta, sample_rate=sample_rate, rounds=rounds,
                                     claimed_epsilon=claimed_epsilon, confidence=confidence)
        if out is not None:
            result.write(out)
        return result


class _CanaryProxy(ClientProxy):
    """The proxy of a simulated canary client: the server never calls it."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("a canary client is simulated inside the aggregation: it cannot "
                          "be called")

    get_properties = get_parameters = fit = evaluate = reconnect = _refuse  # type: ignore[assignment]



class LegacyCanaryClients(LegacyStrategy, _Canaries):
    """Canary clients in a legacy (``flwr.server.strategy``) strategy."""

    def __init__(self, strategy: LegacyStrategy, canaries: CanaryClientRounds,
                 settings: _Settings) -> None:
        super().__init__()
        self._setup(strategy, canaries, settings)

    def __repr__(self) -> str:
        return f"CanaryClients({self.strategy!r}, m={self.canaries.size})"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return self.strategy.initialize_parameters(client_manager)

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        self._current = parameters_to_ndarrays(parameters)
        instructions = self.strategy.configure_fit(server_round, parameters, client_manager)
        available = client_manager.num_available()
        self._rate = len(instructions) / available if available else None
        return instructions

    def aggregate_fit(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        replies, dropped = self._round([float(res.num_examples) for _, res in results])
        metrics: dict[str, Scalar] = {NORM_BIT: True} if _client_side(self.strategy) else {}
        kept = [r for i, r in enumerate(results) if i not in dropped]
        for k, (flat, weight) in enumerate(replies):
            res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(
                _unflat(flat, self._current)), round(weight), dict(metrics))
            kept.append((_CanaryProxy(f"canary-{server_round}-{k}"), res))
        parameters, out_metrics = self.strategy.aggregate_fit(server_round, kept, failures)
        self._observe(None if parameters is None else parameters_to_ndarrays(parameters),
                      len(kept))
        return parameters, out_metrics

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list[tuple[ClientProxy, EvaluateIns]]:
        return self.strategy.configure_evaluate(server_round, parameters, client_manager)

    def aggregate_evaluate(
        self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        return self.strategy.aggregate_evaluate(server_round, results, failures)

    def evaluate(self, server_round: int,
                 parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        return self.strategy.evaluate(server_round, parameters)


class MessageCanaryClients(MessageStrategy, _Canaries):
    """Canary clients in a Message-API (``flwr.serverapp.strategy``) strategy."""

    def __init__(self, strategy: MessageStrategy, canaries: CanaryClientRounds,
                 settings: _Settings) -> None:
        self._setup(strategy, canaries, settings)
        self._keys: list[str] = []

    def __repr__(self) -> str:
        return f"CanaryClients({self.strategy!r}, m={self.canaries.size})"

    def summary(self) -> None:
        self.strategy.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._keys = list(arrays.keys())
        self._current = [arrays[k].numpy() for k in self._keys]
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        available = len(list(grid.get_node_ids()))
        self._rate = len(messages) / available if available else None
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message],
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        key = find_attribute(self.strategy, "weighted_by_key") or "num-examples"
        arrays_key = find_attribute(self.strategy, "arrayrecord_key") or "arrays"
        weights = []
        for msg in replies:
            if msg.has_error() or not msg.content.metric_records:
                continue
            value = next(iter(msg.content.metric_records.values())).get(key)
            if isinstance(value, int | float):
                weights.append(float(value))
        canary, dropped = self._round(weights)
        kept = [m for i, m in enumerate(replies) if i not in dropped]
        for flat, weight in canary:
            record = ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(
                self._keys, _unflat(flat, self._current), strict=True)})
            metrics: dict[str, Any] = {key: weight}
            if _client_side(self.strategy):
                metrics[NORM_BIT] = True
            content = RecordDict({arrays_key: record, "metrics": MetricRecord(metrics)})
            kept.append(Message(content, dst_node_id=0, message_type=MessageType.TRAIN))
        arrays, metrics_out = self.strategy.aggregate_train(server_round, kept)
        self._observe(None if arrays is None else [arrays[k].numpy() for k in self._keys],
                      len(kept))
        return arrays, metrics_out

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int,
                           replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)


def wrap(strategy: Any, canaries: CanaryClientRounds, *, clip_norm: float | None,
         update_scale: float | None, num_examples: float | None,
         replace_clients: bool) -> LegacyCanaryClients | MessageCanaryClients:
    """The canary strategy for ``strategy``'s API (a one-line error for anything else)."""
    for name, value in (("clip_norm", clip_norm), ("update_scale", update_scale),
                        ("num_examples", num_examples)):
        if value is not None and not (np.isfinite(value) and value > 0):
            raise ConfigError(f"{name} must be finite and > 0, got {value}")
    settings = _Settings(clip_norm, update_scale, num_examples, bool(replace_clients))
    if isinstance(strategy, LegacyStrategy):
        return LegacyCanaryClients(strategy, canaries, settings)
    if isinstance(strategy, MessageStrategy):
        return MessageCanaryClients(strategy, canaries, settings)
    raise ConfigError(f"CanaryClients wraps a Flower strategy (flwr.server.strategy or "
                      f"flwr.serverapp.strategy), got {type(strategy).__name__}")
