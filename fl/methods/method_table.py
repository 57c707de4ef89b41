"""The method table: one row per training method, the one place a method's facts live.

Torch-free (the configuration, ``compare`` and the Flower node policy read it without
loading any method's code). A row says: the privacy notion
(:class:`~fedlap_privacy.vocabulary.Notion`), the class that implements the method
(``module:Class``, imported on use), the accesses to private data a round is accounted
for (T of Theorem 5.8, the worst case), the method's own configuration checks, how
``compare`` gives it a privacy budget, and the facts other parts ask about (whether it
releases noisy gradients a white-box auditor can read, FedProx's proximal term, what it
releases as public metadata). Adding a method is one module and one row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from fedlap_privacy.accountant.client_level import update_sigma
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.vocabulary import CanaryCoordinates, Notion

if TYPE_CHECKING:
    from fedlap_privacy.fl.config import TrainConfig

__all__ = ["LDP_MAX_EPSILON", "METHOD_TABLE", "Budget", "MethodSpec", "method_spec"]

#: LDP-FL: the largest per-weight epsilon whose rarer output a float64 draw still realises
#: faithfully (probability 1/(e^eps+1) >> 2^-53; see ``fl/methods/ldpfl.py``)
LDP_MAX_EPSILON = 30.0


class Budget(StrEnum):
    """How ``compare`` matches a method to a target epsilon."""

    NONE = "none"  # not private: run once as the reference column
    PLAN_SIGMA = "plan-sigma"  # sigma planned so that the rounds spend the target
    ALI = "ali-budget"  # DP-FedAvg's planned sigma, the target as the method's own budget
    LDP = "ldp-per-round"  # per-weight epsilon per round = target / rounds


def _local_steps(cfg: TrainConfig) -> int:
    return cfg.local_steps


def _fedlap_steps(cfg: TrainConfig) -> int:
    return cfg.reinits * cfg.max_loops * cfg.real_batches  # R_i x L_max x R_b


def _no_check(cfg: TrainConfig) -> None:
    return None


def _check_fedlap_dp(cfg: TrainConfig) -> None:
    if cfg.init == "real":
        raise ConfigError("init 'real' reads private images without noise: use 'noise' for DP")
    if cfg.radius_rule != "fixed":
        raise ConfigError("client-suggested radii read private data: use radius rule 'fixed'")


def _check_ali_dpfl(cfg: TrainConfig) -> None:
    if cfg.target_eps is None or cfg.sigma is None:
        raise ConfigError("ali-dpfl needs a privacy budget --target-eps and a fixed --sigma")
    if cfg.local_steps > cfg.tau_max:
        raise ConfigError(f"local steps {cfg.local_steps} must be <= tau_max for ali-dpfl")


def _check_ldp_fl(cfg: TrainConfig) -> None:
    if not (cfg.ldp_epsilon is not None and 0 < cfg.ldp_epsilon <= LDP_MAX_EPSILON):
        raise ConfigError(f"ldp-fl needs a per-weight epsilon (ldp_epsilon) in "
                          f"(0, {LDP_MAX_EPSILON:g}]")


def _check_dp_fedavg_client(cfg: TrainConfig) -> None:
    if cfg.clip_quantile is None:
        if cfg.clip_count_sigma is not None:
            raise ConfigError("clip_count_sigma is the noise of adaptive clipping: set "
                              "clip_quantile too (or leave it unset for a fixed clip)")
    else:
        if cfg.canaries:
            raise ConfigError("canary clients upload at a fixed clip: audit dp-fedavg-client "
                              "with fixed clipping (leave clip_quantile unset)")
        if cfg.sigma is not None:  # a planned sigma is checked once planned
            update_sigma(cfg.sigma, cfg.clip_count_noise)


@dataclass(frozen=True)
class MethodSpec:
    """One row of the method table (module docstring)."""

    name: str
    notion: Notion
    implementation: str  # "module:Class"
    budget: Budget
    accounted_steps: Callable[[TrainConfig], int] = _local_steps
    check: Callable[[TrainConfig], None] = _no_check
    releases_gradients: bool = False  # noisy gradients a white-box auditor can read
    proximal: bool = False  # FedProx's (mu/2)||w - w_g||^2 in the local loss
    fedlap: bool = False  # the FedLAP family (synthetic sets, trust region)
    public: tuple[str, ...] = ()  # metadata released without noise, beyond sizes/selection
    fixed_cohorts: bool = False  # its accountant prices fixed-size cohorts (clients_per_round)
    adaptive_clip: bool = False  # the clip norm may follow a quantile (clip_quantile)
    # where its white-box canaries go by default (FedLAP-DP: a dedicated block; its large
    # batches on a small model blur canaries on the weights)
    canary_coordinates: str = CanaryCoordinates.WEIGHTS.value
    #: T of the first round where the method adapts T per round (ALI-DPFL: local_steps, its
    #: first tau); None: ``accounted_steps``
    first_round_steps: Callable[[TrainConfig], int] | None = None
    #: the public value broadcast each round that says the round's T (ALI-DPFL: "tau"), at
    #: most ``accounted_steps``; None: every round is accounted ``accounted_steps``
    broadcast_steps: str | None = None

    @property
    def private(self) -> bool:
        """Gaussian noise of multiplier sigma, accounted as (epsilon, delta)-DP."""
        return self.notion.gaussian

    @property
    def target_is_budget(self) -> bool:
        """Whether a target epsilon is the method's own budget, spent at a fixed sigma (ALI-
        DPFL), rather than the epsilon sigma is planned for (``Budget.PLAN_SIGMA``)."""
        return self.budget is Budget.ALI

    def first_steps(self, cfg: TrainConfig) -> int:
        """T of the run's first round (the dry run's figure)."""
        return (self.first_round_steps or self.accounted_steps)(cfg)


_CLASSES = ("each client's list of classes (the labels of its synthetic set)",)
_FEDLAP = "fedlap_privacy.fl.methods.fedlap:FedLAP"
_LOCAL_SGD = "fedlap_privacy.fl.methods.fedavg:LocalSGD"

METHOD_TABLE: dict[str, MethodSpec] = {spec.name: spec for spec in (
    MethodSpec("fedlap", Notion.NONE, _FEDLAP, Budget.NONE, _fedlap_steps, fedlap=True),
    MethodSpec("fedlap-dp", Notion.RECORD, _FEDLAP, Budget.PLAN_SIGMA, _fedlap_steps,
               _check_fedlap_dp, releases_gradients=True, fedlap=True, public=_CLASSES,
               canary_coordinates=CanaryCoordinates.DEDICATED.value),
    MethodSpec("fedavg", Notion.NONE, _LOCAL_SGD, Budget.NONE),
    MethodSpec("fedprox", Notion.NONE, _LOCAL_SGD, Budget.NONE, proximal=True),
    MethodSpec("scaffold", Notion.NONE, "fedlap_privacy.fl.methods.scaffold:Scaffold", Budget.NONE),
    MethodSpec("fedsgd", Notion.NONE, "fedlap_privacy.fl.methods.fedsgd:FedSGD", Budget.NONE),
    MethodSpec("dp-fedavg", Notion.RECORD, _LOCAL_SGD, Budget.PLAN_SIGMA,
               releases_gradients=True),
    MethodSpec("dp-fedprox", Notion.RECORD, _LOCAL_SGD, Budget.PLAN_SIGMA,
               releases_gradients=True, proximal=True),
    MethodSpec("ali-dpfl", Notion.RECORD, "fedlap_privacy.fl.methods.alidpfl:ALIDPFL", Budget.ALI,
               lambda cfg: cfg.tau_max, _check_ali_dpfl, releases_gradients=True,
               public=("the number of local iterations tau of each round",),
               first_round_steps=_local_steps, broadcast_steps="tau"),
    MethodSpec("dp-normfedavg", Notion.CLIENT, "fedlap_privacy.fl.methods.normfedavg:DPNormFedAvg",
               Budget.PLAN_SIGMA, lambda cfg: 1),
    MethodSpec("dp-fedavg-client", Notion.CLIENT,
               "fedlap_privacy.fl.methods.dp_fedavg_client:DPFedAvgClient", Budget.PLAN_SIGMA,
               lambda cfg: 1, _check_dp_fedavg_client, fixed_cohorts=True, adaptive_clip=True),
    MethodSpec("ldp-fl", Notion.LOCAL, "fedlap_privacy.fl.methods.ldpfl:LDPFL", Budget.LDP,
               check=_check_ldp_fl),
)}


def method_spec(name: str) -> MethodSpec:
    """The row of ``name``; a one-line error for an unknown method."""
    if name not in METHOD_TABLE:
        raise ConfigError(f"method {name!r} must be one of {', '.join(METHOD_TABLE)}")
    return METHOD_TABLE[name]
