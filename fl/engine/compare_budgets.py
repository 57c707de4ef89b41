"""The budget each run of a comparison is given (:mod:`~fedlap_privacy.fl.engine.compare`): every
method's base configuration, resolved as ``train`` resolves it, and the configuration that
spends a target epsilon in R rounds by the method table's budget rule."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.config_resolve import parse_overrides, resolve_config
from fedlap_privacy.fl.config_rules import METHODS
from fedlap_privacy.fl.methods.method_table import METHOD_TABLE, Budget, method_spec
from fedlap_privacy.fl.methods.schedule import SCHEDULED_METHOD

__all__ = [
    "BUDGET_KEYS",
    "NO_DP",
    "Bases",
    "base_for",
    "bases_by_rounds",
    "budget_config",
    "check_methods",
    "check_overrides",
    "client_sizes",
    "method_bases",
    "round_counts",
]

#: the column of the non-private methods
NO_DP = "non-private"
#: the base configuration of a comparison: one for every method, or one per method
Bases = TrainConfig | Mapping[str, TrainConfig]


def client_sizes(cfg: TrainConfig, split_seed: int | None = None) -> list[int]:
    from fedlap_privacy.data.datasets import load_dataset
    from fedlap_privacy.fl.engine.run_split import client_parts
    from fedlap_privacy.fl.run.randomness import run_split_seed
    from fedlap_privacy.fl.run.user_runs import prepare_data

    if cfg.data is not None:  # a user's records: their natural partition, if any
        cfg, data = prepare_data(cfg, run_split_seed(cfg, split_seed))
    else:
        data = load_dataset(cfg.dataset, cfg.data_dir)
    return [len(p) for p in client_parts(cfg, data, split_seed)]


def budget_config(base: TrainConfig, method: str, eps: float | None,
                  split_seed: int | None = None) -> TrainConfig:
    """The configuration of ``method`` that spends ``eps`` (None: the non-private run) in
    ``base.rounds`` rounds, by the method table's
    :class:`~fedlap_privacy.fl.methods.method_table.Budget` rule (the module docstring).
    ``split_seed``: the comparison's secret split seed (ALI-DPFL's sigma depends on the
    client sizes)."""
    budget = method_spec(method).budget
    cfg = dataclasses.replace(base, method=method, target_eps=None, ldp_epsilon=None)
    if budget == Budget.NONE:
        if eps is not None:
            raise ConfigError(f"{method} is not private: it has no epsilon to match")
        return cfg.validate()
    if eps is None:
        raise ConfigError(f"{method} is private: give it a target epsilon")
    if budget == Budget.LDP:
        cfg = dataclasses.replace(cfg, ldp_epsilon=eps / cfg.rounds)
    elif budget == Budget.ALI:
        from fedlap_privacy.fl.run.privacy import with_planned_sigma

        reference = dataclasses.replace(cfg, method="dp-fedavg", sigma=None, target_eps=eps)
        sigma = with_planned_sigma(reference, client_sizes(reference, split_seed)).sigma
        cfg = dataclasses.replace(cfg, sigma=sigma, target_eps=eps)
    else:
        cfg = dataclasses.replace(cfg, sigma=None, target_eps=eps)  # planned by the driver
    return cfg.validate()


#: the keys each cell's budget sets (budget_config): a --set of one would be overwritten
BUDGET_KEYS = ("sigma", "target_eps", "ldp_epsilon")


def check_overrides(settings: Sequence[str], several_counts: bool) -> None:
    """Refuse ``--set`` values that compare would overwrite rather than silently drop: the
    budget keys (each cell plans its own from its target epsilon), ``method`` and, with
    several round counts, ``rounds``."""
    keys = set(parse_overrides(settings))
    if "method" in keys:
        raise ConfigError("--set method=...: compare runs the methods given by --methods")
    budget = sorted(keys.intersection(BUDGET_KEYS))
    if budget:
        raise ConfigError(
            f"--set {budget[0]}: compare sets the noise of every run from its target epsilon "
            "(--eps); for a fixed sigma use train --sigma"
        )
    if several_counts and "rounds" in keys:
        raise ConfigError(
            "--set rounds=... with several --rounds: give the round counts with --rounds only"
        )


def method_bases(flags: dict[str, Any], settings: Sequence[str], methods: Sequence[str],
                 schedule: str = "auto") -> dict[str, TrainConfig]:
    """Each method's base configuration, resolved as ``train`` resolves it
    (:func:`~fedlap_privacy.fl.config_resolve.resolve_config`): FedLAP-DP gets its ``schedule``
    (by default picked from the client size), and no other method gets its keys."""
    check_methods(methods)
    if schedule != "auto" and SCHEDULED_METHOD not in methods:
        raise ConfigError(f"--schedule {schedule} is FedLAP-DP's, which --methods leaves out")
    bases = {}
    for m in dict.fromkeys(methods):
        stand_in = _BUDGET_STAND_INS.get(METHOD_TABLE[m].budget, {})
        cfg = resolve_config(None, {**stand_in, **flags, "method": m}, settings,
                             plan_sigma_for_target=False,
                             schedule=schedule if m == SCHEDULED_METHOD else "auto")
        bases[m] = dataclasses.replace(cfg, **{k: getattr(_DEFAULTS, k) for k in stand_in})
    return bases


#: the budget keys a method's own check asks for before :func:`budget_config` gives them
#: (ALI-DPFL: a target and a fixed sigma; LDP-FL: a per-weight epsilon): stand-ins, so the
#: base passes every other check up front, reset to the defaults in the base (a template
#: that every job's budget overwrites, never trained as it is)
_BUDGET_STAND_INS: dict[Budget, dict[str, float]] = {
    Budget.ALI: {"target_eps": 1.0, "sigma": 1.0},
    Budget.LDP: {"ldp_epsilon": 1.0},
}
_DEFAULTS = TrainConfig()


def bases_by_rounds(
    flags: dict[str, Any], settings: Sequence[str], methods: Sequence[str], schedule: str,
    counts: Sequence[int | None],
) -> dict[int | None, dict[str, TrainConfig]]:
    """:func:`method_bases` for each round count in ``counts`` (``flags["rounds"]`` = it;
    None: the default or ``--set rounds``), so a schedule key that depends on the run's
    length (the large schedule's ``reinits``) is the one ``train --rounds R`` would use."""
    return {r: method_bases({**flags, "rounds": r}, settings, methods, schedule) for r in counts}


def check_methods(methods: Sequence[str]) -> None:
    unknown = [m for m in methods if m not in METHOD_TABLE]
    if unknown:
        raise ConfigError(f"unknown method(s) {', '.join(unknown)}: choose from {METHODS}")


def base_for(base: Bases, method: str) -> TrainConfig:
    return base[method] if isinstance(base, Mapping) else base


def round_counts(rounds: Sequence[int]) -> list[int]:
    """The distinct round counts of ``rounds``, ascending (duplicates are dropped); each must
    be an integer >= 1 and there must be at least one."""
    if not rounds:
        raise ConfigError("give one or more round counts, e.g. --rounds 1,3,10")
    bad = [r for r in rounds if isinstance(r, bool) or not isinstance(r, int) or r < 1]
    if bad:
        raise ConfigError(f"round counts {bad} must be integers >= 1, e.g. --rounds 1,3,10")
    return sorted(set(rounds))
