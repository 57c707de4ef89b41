"""A SuperNode's own privacy policy: what it answers, checked before it touches its data.

A client institution does not trust the server with its privacy (docs/threat-model.md,
"Cross-silo deployment"). Contract of :meth:`NodePolicy.check`: an instruction (the run's
configuration and the round's public broadcast) is refused with one line naming the rule
unless ALL of these hold, and nothing is read from the node's records before it passes:

* the full :meth:`TrainConfig.validate` (sigma and clip finite and positive, no ``init=real``
  for DP, ALI-DPFL's first tau within ``tau_max``, ...);
* ``allowed-methods`` (default: every method with a formal guarantee) and the node's
  ``threat-model``: ``server`` (default) admits only methods whose epsilon holds against the
  server (record-level and local DP; DP-NormFedAvg's client-level epsilon assumes a trusted
  server and is refused); ``trusted-server`` admits any allowed method (a node that trusts
  the server, e.g. in a test federation). A node sees only the rounds it answered and cannot
  check the server's client sampling, so its ledger never assumes hidden selection;
* Gaussian methods: sigma >= ``min-sigma``, clip <= ``max-clip``, the run's delta <= the
  node's ``delta``;
* accesses to private data this round (T of Theorem 5.8; ALI-DPFL: the broadcast tau, which
  must also be within ``tau_max``) <= ``max-accesses``; FedLAP-DP must optimise its
  synthetic set (``syn-steps`` >= 1);
* ``reproducible-noise`` (noise derived from a seed the server knows) only with
  ``allow-reproducible-noise = true``.

The budget (``epsilon`` at the node's ``delta``) and replays are the node ledger's
(:mod:`.node_ledger`). Policy sources: node config keys, over the TOML file named by the
node config key ``policy-file``; an unknown key or a value of the wrong type is refused.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlap_privacy.accountant import ACCOUNTANTS
from fedlap_privacy.errors import ConfigError, FedlapError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.method_table import METHOD_TABLE
from fedlap_privacy.fl.methods import RoundInfo
from fedlap_privacy.ledger import NOTION_THREAT_MODELS, Notion

__all__ = ["NODE_THREAT_MODELS", "NodePolicy", "PolicyRefusal", "accesses_of"]

#: the threat models a node ledger can hold for (see the module docstring)
NODE_THREAT_MODELS = ("server", "trusted-server")
#: node config keys that are not policy keys
NODE_KEYS = ("partition-id", "num-partitions", "device", "data-dir", "data-file", "state-dir",
             "policy-file")


class PolicyRefusal(FedlapError):
    """The node refuses an instruction (one line naming the rule)."""


def _formal_methods() -> tuple[str, ...]:
    return tuple(m for m, spec in METHOD_TABLE.items() if spec.notion != Notion.NONE)


@dataclass(frozen=True)
class NodePolicy:
    """The node's rules (module docstring); defaults protect a node that configured nothing."""

    allowed_methods: tuple[str, ...] = dataclasses.field(default_factory=_formal_methods)
    min_sigma: float = 0.5
    max_clip: float = math.inf  # privacy does not depend on it (sigma is a multiplier)
    max_accesses: int = 200
    delta: float = 1e-5  # the node's delta: the largest a run may use; its ledger's delta
    epsilon: float = 10.0  # the node's budget over every run on its records
    threat_model: str = "server"
    accountant: str = "rdp"
    allow_reproducible_noise: bool = False

    def __post_init__(self) -> None:
        unknown = [m for m in self.allowed_methods if m not in METHOD_TABLE]
        checks = [
            (not unknown, f"allowed-methods: unknown method {unknown[0] if unknown else ''!r}"),
            (self.min_sigma >= 0 and math.isfinite(self.min_sigma), "min-sigma must be >= 0"),
            (self.max_clip > 0, "max-clip must be > 0"),
            (self.max_accesses >= 1, "max-accesses must be >= 1"),
            (0 < self.delta < 1, "delta must be in (0, 1)"),
            (self.epsilon > 0 and math.isfinite(self.epsilon), "epsilon must be finite, > 0"),
            (self.threat_model in NODE_THREAT_MODELS,
             f"threat-model {self.threat_model!r} must be server or trusted-server (a node "
             "sees only the rounds it answered: hidden selection cannot be checked)"),
            (self.accountant in ACCOUNTANTS, f"accountant must be one of {ACCOUNTANTS}"),
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

    def check(self, cfg: TrainConfig, info: RoundInfo) -> int:
        """Refuse (:class:`PolicyRefusal`) or return the round's accounted accesses T."""
        self.check_config(cfg)
        steps = accesses_of(cfg, info)
        if steps > self.max_accesses:
            raise PolicyRefusal(f"{steps} accesses per round above the node's maximum "
                                f"{self.max_accesses}")
        return steps

    def check_config(self, cfg: TrainConfig) -> None:
        """The rules that depend on the run's configuration only (also at discovery)."""
        try:
            cfg.validate()
        except ConfigError as exc:
            raise PolicyRefusal(f"invalid instruction: {exc}") from None
        if cfg.method not in self.allowed_methods:
            raise PolicyRefusal(f"method {cfg.method} is not allowed by the node's policy "
                                f"(allowed: {', '.join(self.allowed_methods) or 'none'})")
        if self.threat_model == "server" and "server" not in NOTION_THREAT_MODELS[cfg.notion]:
            raise PolicyRefusal(f"{cfg.method} has no guarantee against the server "
                                f"({cfg.notion} privacy), the node's threat model")
        if cfg.private:
            assert cfg.sigma is not None  # validate: a DP run has sigma or a target
            if cfg.sigma < self.min_sigma:
                raise PolicyRefusal(f"sigma {cfg.sigma:g} below the node's minimum "
                                    f"{self.min_sigma:g}")
            if cfg.clip > self.max_clip:
                raise PolicyRefusal(f"clip {cfg.clip:g} above the node's maximum "
                                    f"{self.max_clip:g}")
            if cfg.delta > self.delta:
                raise PolicyRefusal(f"delta {cfg.delta:g} above the node's {self.delta:g}")
        if cfg.reproducible_noise and not self.allow_reproducible_noise:
            raise PolicyRefusal("reproducible-noise (noise the server can recompute from the "
                                "seed) is refused by the node's policy")
        if cfg.is_fedlap and cfg.syn_steps < 1:
            raise PolicyRefusal(f"syn-steps {cfg.syn_steps}: FedLAP-DP must optimise its "
                                "synthetic set (it would upload its initialisation)")


def accesses_of(cfg: TrainConfig, info: RoundInfo) -> int:
    """T of this round: the accesses the client step may make (ALI-DPFL: the broadcast tau)."""
    if cfg.method != "ali-dpfl":
        return cfg.accesses_per_round
    tau = info.extras.get("tau")
    if isinstance(tau, bool) or not isinstance(tau, int) or tau < 1:
        raise PolicyRefusal(f"ALI-DPFL tau {tau!r} must be an integer >= 1")
    if tau > cfg.tau_max:
        raise PolicyRefusal(f"ALI-DPFL tau {tau} above tau_max {cfg.tau_max}")
    return tau


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
    else:  # allowed-methods
        if isinstance(raw, str):
            raw = [m.strip() for m in raw.split(",") if m.strip()]
        ok = isinstance(raw, list) and all(isinstance(m, str) for m in raw)
        raw = tuple(raw) if ok else raw
    if not ok:
        raise ConfigError(f"node policy: {key} = {raw!r} has the wrong type")
    return float(raw) if isinstance(default, float) else raw
