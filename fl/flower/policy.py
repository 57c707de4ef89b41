"""A SuperNode's own privacy policy: what it answers, checked before it touches its data.

A client institution does not trust the server with its privacy (docs/threat-model.md,
"Cross-silo deployment"). Contract of :meth:`NodePolicy.check`: an instruction (the run's
configuration and the round's public broadcast) is refused with one line naming the rule
unless ALL of these hold, and nothing is read from the node's records before it passes:

* every number of the configuration is finite and >= 0 (no NaN, inf or negative value),
  then the full :meth:`TrainConfig.validate` (sigma and clip finite and positive, no
  ``init=real`` for DP, ALI-DPFL's first tau within ``tau_max``, ...);
* ``allowed-methods``. Each method is priced under the notion it really has
  (:data:`PRICING`): its epsilon bounds each of the node's records (record-level), a whole
  client against observers of the model with noise the SERVER adds (client-level), each
  reported weight of one round and no record (local, LDP-FL), or nothing (none). The
  default admits the record-level methods only; a method of any other notion is admitted
  only when the node names it. Then the node's ``threat-model``: ``server`` (default)
  admits only notions whose epsilon holds against the server (record-level and local, and
  client-level DP-FedAvg over secure aggregation, where the node adds its own noise share
  and the server sees only the sum: :mod:`.secure_node`); ``trusted-server`` admits any
  allowed method. A node sees only the rounds it answered and
  cannot check the server's client sampling, so its ledger never assumes hidden selection;
* Gaussian methods: a sigma (at discovery a run may still leave it to the server to plan
  from its target epsilon; each round's instruction must carry it), sigma >= ``min-sigma``
  (the multiplier the run is accounted with: for fixed-size client cohorts sigma / 2),
  clip <= ``max-clip`` (and the clip norm a round broadcasts, dp-fedavg-client's adaptive
  one), the run's delta <= the node's ``delta``;
* the round's learning rate in (0, ``max-lr``] (the server broadcasts it);
* accesses to private data this round (T of Theorem 5.8; ALI-DPFL: the broadcast tau, which
  must also be within ``tau_max``) <= ``max-accesses``. A method whose epsilon does not
  price the batch size and the local steps (any notion but record-level, where q = B / N_k
  and T are accounted) must also keep ``local-steps`` <= ``max-accesses`` and
  ``batch-size`` >= ``min-batch-size``; FedLAP-DP must optimise its synthetic set
  (``syn-steps`` >= 1);
* ``reproducible-noise`` (noise derived from a seed the server knows) only with
  ``allow-reproducible-noise = true``;
* the run's ``model`` (a factory spec, ``module:FUNC`` or ``FILE.py:FUNC``, never code) only
  when ``allowed-models`` lists it exactly: importing a module runs its code, so a node
  never imports what the server names unless its operator listed it. The default lists the
  built-in tabular MLP only (:data:`~fedlap_privacy.model_factory.DEFAULT_TABULAR`); the
  built-in ConvNet (no ``model``, images) imports nothing and is always admitted.

Nothing else the server broadcasts changes what the upload reveals unchecked: LDP-FL's
weight ranges are the node's own (:func:`node_round_info`), never the server's.

The budgets are the node ledger's (:mod:`.node_ledger`): one per notion that the node can
account itself, never one notion's epsilon against another's budget: ``epsilon`` (at the
node's ``delta``) for record-level DP, ``local-epsilon`` for local DP (per-weight epsilon
composed over rounds and runs). Policy sources: node config keys, over the TOML file named
by the node config key ``policy-file``; an unknown key or a value of the wrong type is
refused.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from fedlap_privacy.accountant import AccountantName, accountant_names
from fedlap_privacy.errors import ConfigError, FedlapError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.methods.interface import RoundInfo
from fedlap_privacy.fl.methods.ldpfl import layer_ranges
from fedlap_privacy.fl.methods.method_table import METHOD_TABLE
from fedlap_privacy.fl.methods.schedule import CROSS_DEVICE
from fedlap_privacy.model_factory import DEFAULT_TABULAR
from fedlap_privacy.vocabulary import NOTION_THREAT_MODELS, Notion, ThreatModel

__all__ = ["NODE_THREAT_MODELS", "PRICING", "SECURE_PRICING", "NodePolicy", "PolicyRefusal",
           "Pricing",
           "accesses_of", "node_round_info"]

#: the threat models a node ledger can hold for (see the module docstring): a node sees only
#: the rounds it answered, so it cannot check that the selection stayed hidden
NODE_THREAT_MODELS = (ThreatModel.SERVER, ThreatModel.TRUSTED_SERVER)
#: the default ``min-batch-size``: the cross-device defaults' B (McMahan et al. 2017's B = 10),
#: so that a node that admits a method whose epsilon does not price B (client-level DP,
#: LDP-FL, none; only a policy that names it and trusts the server admits one) admits
#: ``train``'s cross-device runs. The floor is defence in depth, never a guarantee: an
#: upload without noise against the server is one step's or a few steps' gradients of B
#: records, and a one-record gradient gives that record away (a fully connected layer's
#: input exactly, Phong et al. 2017), while reconstruction from an averaged batch grows
#: harder with B (Zhu et al. 2019; Geiping et al. 2020) yet is never ruled out. A node
#: that needs a guarantee against the server admits record-level methods only (the default).
_MIN_BATCH_SIZE: int = CROSS_DEVICE["batch_size"]
#: node config keys that are not policy keys
NODE_KEYS = ("partition-id", "num-partitions", "device", "data-dir", "data-file", "state-dir",
             "state-token", "policy-file")


class PolicyRefusal(FedlapError):
    """The node refuses an instruction (one line naming the rule)."""


@dataclass(frozen=True)
class Pricing:
    """How a node prices the methods of one notion (module docstring)."""

    bounds: str  # what the method's epsilon bounds, in the words of a refusal
    budget: str | None  # the policy key of the node's budget for it; None: none it can keep


#: every notion under what it really bounds, and the node budget that pays for it
PRICING: dict[Notion, Pricing] = {
    Notion.RECORD: Pricing("each of the node's records", "epsilon"),
    Notion.LOCAL: Pricing("each reported weight of a round, no record", "local-epsilon"),
    Notion.CLIENT: Pricing("a whole client against observers of the model, with noise the "
                           "server adds", None),
    Notion.NONE: Pricing("nothing", None),
}
#: client-level DP-FedAvg over secure aggregation: the node adds its own noise share and the
#: server sees only the sum, so the node can keep this budget (against the server)
SECURE_PRICING = Pricing("a whole client against the server, with noise the clients add "
                         "over secure aggregation", "client-epsilon")


def _record_level_methods() -> tuple[str, ...]:
    return tuple(m for m, spec in METHOD_TABLE.items() if spec.notion == Notion.RECORD)


@dataclass(frozen=True)
class NodePolicy:
    """The node's rules (module docstring); defaults protect a node that configured nothing."""

    allowed_methods: tuple[str, ...] = dataclasses.field(default_factory=_record_level_methods)
    min_sigma: float = 0.5
    max_clip: float = math.inf  # privacy does not depend on it (sigma is a multiplier)
    max_accesses: int = 200
    max_lr: float = 10.0  # the round's learning rate, broadcast by the server
    # methods whose epsilon does not price B (not record-level): _MIN_BATCH_SIZE
    min_batch_size: int = _MIN_BATCH_SIZE
    delta: float = 1e-5  # the node's delta: the largest a run may use; its ledger's delta
    epsilon: float = 10.0  # the node's record-level budget over every run on its records
    local_epsilon: float = 10.0  # its local-DP budget (per weight), if it admits ldp-fl
    # its client-level budget against the server, over secure aggregation (SECURE_PRICING)
    client_epsilon: float = 10.0
    threat_model: str = ThreatModel.SERVER.value
    accountant: str = AccountantName.PLD  # the node's own (PLD, the tightest; "rdp": Theorem 5.8's)
    allow_reproducible_noise: bool = False
    allowed_models: tuple[str, ...] = (DEFAULT_TABULAR,)  # factory specs it may import

    def __post_init__(self) -> None:
        unknown = [m for m in self.allowed_methods if m not in METHOD_TABLE]
        malformed = [m for m in self.allowed_models if not _is_factory_spec(m)]
        checks = [
            (not unknown, f"allowed-methods: unknown method {unknown[0] if unknown else ''!r}"),
            (self.min_sigma >= 0 and math.isfinite(self.min_sigma), "min-sigma must be >= 0"),
            (self.max_clip > 0, "max-clip must be > 0"),
            (self.max_accesses >= 1, "max-accesses must be >= 1"),
            (0 < self.max_lr and math.isfinite(self.max_lr), "max-lr must be finite, > 0"),
            (self.min_batch_size >= 1, "min-batch-size must be >= 1"),
            (0 < self.delta < 1, "delta must be in (0, 1)"),
            (self.epsilon > 0 and math.isfinite(self.epsilon), "epsilon must be finite, > 0"),
            (self.local_epsilon > 0 and math.isfinite(self.local_epsilon),
             "local-epsilon must be finite, > 0"),
            (self.client_epsilon > 0 and math.isfinite(self.client_epsilon),
             "client-epsilon must be finite, > 0"),
            (self.threat_model in NODE_THREAT_MODELS,
             f"threat-model {self.threat_model!r} must be server or trusted-server (a node "
             "sees only the rounds it answered: hidden selection cannot be checked)"),
            (self.accountant in accountant_names(),
             f"accountant must be one of {accountant_names()}"),
            (not malformed, f"allowed-models: {malformed[0] if malformed else ''!r} is not "
             "module:FUNC or FILE.py:FUNC"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"node policy: {message}")

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> NodePolicy:
        """A policy from kebab-case keys (TOML or node config values), strictly typed."""
        fields = {f.name.replace("_", "-"): f for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        for key, raw in values.items():
            if key not in fields:
                raise ConfigError(f"node policy: unknown key {key!r} (known: "
                                  f"{', '.join(fields)})")
            out[key.replace("-", "_")] = _typed(key, cls.__dataclass_fields__[
                key.replace("-", "_")].default, raw)
        return cls(**out)

    @classmethod
    def from_node_config(cls, node_config: dict[str, Any]) -> NodePolicy:
        """The policy of a SuperNode: its ``policy-file`` (TOML) overridden by node config."""
        values: dict[str, Any] = {}
        path = str(node_config.get("policy-file", ""))
        if path:
            try:
                values = tomllib.loads(Path(path).expanduser().read_text())
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError(f"node policy file {path}: {exc}") from None
        values.update({k: v for k, v in node_config.items() if k not in NODE_KEYS})
        return cls.from_values(values)

    def budget(self, notion: str, secure: bool = False) -> float | None:
        """The node's budget for ``notion`` (:data:`PRICING`; ``secure``: a client-level run
        over secure aggregation, :data:`SECURE_PRICING`); None: no budget it can keep."""
        key = (SECURE_PRICING if secure else PRICING[Notion(notion)]).budget
        return None if key is None else float(getattr(self, key.replace("-", "_")))

    def check(self, cfg: TrainConfig, info: RoundInfo) -> int:
        """Refuse (:class:`PolicyRefusal`) or return the round's accounted accesses T."""
        self.check_config(cfg)
        lr = info.lr
        if not (math.isfinite(lr) and 0 < lr <= self.max_lr):
            raise PolicyRefusal(f"learning rate {lr:g} outside the node's bounds "
                                f"(0, {self.max_lr:g}] (max-lr)")
        clip = info.extras.get("clip")  # dp-fedavg-client's (adaptive) clip of the round
        if clip is not None and not (isinstance(clip, int | float) and not isinstance(clip, bool)
                                     and math.isfinite(clip) and 0 < clip <= self.max_clip):
            raise PolicyRefusal(f"the round's clip norm {clip!r} outside the node's bounds "
                                f"(0, {self.max_clip:g}] (max-clip)")
        steps = accesses_of(cfg, info)
        if steps > self.max_accesses:
            raise PolicyRefusal(f"{steps} accesses per round above the node's maximum "
                                f"{self.max_accesses}")
        return steps

    def check_config(self, cfg: TrainConfig, *, discovery: bool = False) -> None:
        """The rules that depend on the run's configuration only (also at ``discovery``,
        where a Gaussian run may still leave its sigma to the server's plan)."""
        try:
            _check_numbers(cfg)
            cfg.validate()
        except ConfigError as exc:
            raise PolicyRefusal(f"invalid instruction: {exc}") from None
        self._check_method(cfg)
        if cfg.private:
            self._check_gaussian(cfg, discovery)
        if cfg.notion != Notion.RECORD:
            self._check_unpriced(cfg)
        if cfg.reproducible_noise and not self.allow_reproducible_noise:
            raise PolicyRefusal("reproducible-noise (noise the server can recompute from the "
                                "seed) is refused by the node's policy")
        if cfg.model is not None:
            self.check_factory(cfg.model)
        if cfg.is_fedlap and cfg.syn_steps < 1:
            raise PolicyRefusal(f"syn-steps {cfg.syn_steps}: FedLAP-DP must optimise its "
                                "synthetic set (it would upload its initialisation)")

    def check_factory(self, spec: str) -> None:
        """Refuse a model factory the node's ``allowed-models`` does not list (module
        docstring): nothing is imported before this check."""
        if spec not in self.allowed_models:
            raise PolicyRefusal(f"model {spec!r} is not allowed by the node's policy "
                                f"(allowed-models: {', '.join(self.allowed_models) or 'none'}); "
                                "importing it would run its code on this node")

    def _check_method(self, cfg: TrainConfig) -> None:
        if cfg.method not in self.allowed_methods:
            opt_in = "" if cfg.notion == Notion.RECORD else (
                f"; its {cfg.notion} epsilon bounds {PRICING[cfg.notion].bounds}, so only a "
                "policy naming it admits it")
            raise PolicyRefusal(f"method {cfg.method} is not allowed by the node's policy "
                                f"(allowed: {', '.join(self.allowed_methods) or 'none'})"
                                f"{opt_in}")
        if (self.threat_model == ThreatModel.SERVER and cfg.secure_aggregation is None
                and ThreatModel.SERVER not in NOTION_THREAT_MODELS[cfg.notion]):
            raise PolicyRefusal(f"{cfg.method} has no guarantee against the server "
                                f"({cfg.notion} privacy), the node's threat model")

    def _check_gaussian(self, cfg: TrainConfig, discovery: bool) -> None:
        if cfg.sigma is None:
            if discovery and cfg.target_eps is not None:
                return  # the server plans sigma; every round's instruction carries it
            raise PolicyRefusal(f"invalid instruction: {cfg.method} needs a sigma (empty: "
                                "the node does not plan one)")
        # the multiplier the run is accounted with (client level, fixed cohorts: sigma / 2)
        sigma = cfg.sampling.accounted_sigma(cfg.sigma) if cfg.notion == Notion.CLIENT \
            else cfg.sigma
        if sigma < self.min_sigma:
            raise PolicyRefusal(f"sigma {sigma:g} below the node's minimum "
                                f"{self.min_sigma:g}" + ("" if sigma == cfg.sigma else
                                                         f" (the run's {cfg.sigma:g} halved "
                                                         "for fixed-size cohorts)"))
        if cfg.clip > self.max_clip:
            raise PolicyRefusal(f"clip {cfg.clip:g} above the node's maximum "
                                f"{self.max_clip:g}")
        if cfg.delta > self.delta:
            raise PolicyRefusal(f"delta {cfg.delta:g} above the node's {self.delta:g}")

    def _check_unpriced(self, cfg: TrainConfig) -> None:
        """Batch size and local steps of a method whose epsilon does not account them."""
        if cfg.batch_size < self.min_batch_size:
            raise PolicyRefusal(f"batch size {cfg.batch_size} below the node's minimum "
                                f"{self.min_batch_size} for {cfg.method}, whose epsilon does "
                                "not price it (min-batch-size)")
        if cfg.local_steps > self.max_accesses:
            raise PolicyRefusal(f"{cfg.local_steps} local steps above the node's maximum "
                                f"{self.max_accesses} accesses per round")


def accesses_of(cfg: TrainConfig, info: RoundInfo) -> int:
    """T of this round: the accesses the client step may make (a method that adapts T per
    round broadcasts it, ALI-DPFL its tau: at most the T its rounds are accounted for)."""
    key = cfg.spec.broadcast_steps
    if key is None:
        return cfg.accesses_per_round
    steps = info.extras.get(key)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise PolicyRefusal(f"{cfg.method} {key} {steps!r} must be an integer >= 1")
    if steps > cfg.accesses_per_round:
        raise PolicyRefusal(f"{cfg.method} {key} {steps} above the {cfg.accesses_per_round} "
                            "accesses its rounds are accounted for")
    return steps


def node_round_info(cfg: TrainConfig, info: RoundInfo, weights: dict[str, Tensor]
                    ) -> RoundInfo:
    """The round as the node runs it on the broadcast ``weights`` (its model's state dict):
    LDP-FL's per-layer ranges are the node's own, by the method's rule
    (:func:`fedlap_privacy.fl.methods.ldpfl.layer_ranges` of the global model, public), whatever the
    server sent: a server's range decides what each reported weight reveals."""
    if cfg.spec.notion != Notion.LOCAL:  # the local-DP method (LDP-FL) reports in ranges
        return info
    extras = {**info.extras, "ranges": layer_ranges(weights)}
    return dataclasses.replace(info, extras=extras)


def _check_numbers(cfg: TrainConfig) -> None:
    """Every number of the configuration finite and >= 0 (none of its fields may be less)."""
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{field.name.replace('_', '-')} {value!r} must be a finite "
                              "number >= 0")


def _is_factory_spec(spec: str) -> bool:
    where, sep, name = spec.rpartition(":")
    return bool(sep and where and name.isidentifier())


def _typed(key: str, default: Any, raw: Any) -> Any:
    """``raw`` with the type of the field's ``default`` (a list or comma string for tuples)."""
    if isinstance(default, bool):
        ok = isinstance(raw, bool)
    elif isinstance(default, int):
        ok = isinstance(raw, int) and not isinstance(raw, bool)
    elif isinstance(default, float):
        ok = isinstance(raw, int | float) and not isinstance(raw, bool) and not math.isnan(raw)
    elif isinstance(default, str):
        ok = isinstance(raw, str)
    else:  # allowed-methods, allowed-models
        if isinstance(raw, str):
            raw = [m.strip() for m in raw.split(",") if m.strip()]
        ok = isinstance(raw, list) and all(isinstance(m, str) for m in raw)
        raw = tuple(raw) if ok else raw
    if not ok:
        raise ConfigError(f"node policy: {key} = {raw!r} has the wrong type")
    return float(raw) if isinstance(default, float) else raw
