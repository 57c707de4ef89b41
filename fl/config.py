"""Training configuration: every knob of FedLAP-DP and the baselines, and the presets that load
the authors' values (docs/algorithms.md#default-configurations).

Each key's rule lives in :mod:`~fedlap_privacy.fl.config_rules`; the way from what a user
typed (flags, ``--set``, presets, ``--resume``) to a configuration in
:mod:`~fedlap_privacy.fl.config_resolve`."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Any

from fedlap_privacy.accountant import AccountantName
from fedlap_privacy.accountant.client_level import ClientSampling
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config_rules import FIELD_RULES
from fedlap_privacy.fl.methods.method_table import METHOD_TABLE, MethodSpec, method_spec
from fedlap_privacy.fl.methods.schedule import AUTHORS_DP
from fedlap_privacy.state.canary_state import MIN_AUDIT_CANARIES
from fedlap_privacy.state.ledger import selection_withheld
from fedlap_privacy.vocabulary import NOTION_THREAT_MODELS, CanaryKind, NoiseKind, Notion

__all__ = [
    "DEFAULT_SIGMA", "PRESETS", "RECORDED_ACCOUNTANT", "TrainConfig", "field_types",
    "optional_field", "plans_sigma",
]

#: sigma when neither a sigma nor a target epsilon is given
DEFAULT_SIGMA = 1.5


class _DefaultSigma(float):
    """The default sigma as a marker: :class:`TrainConfig` tells it from a sigma its caller
    passed (``TrainConfig(sigma=1.5)``), which a target epsilon then leaves alone. Replaced
    by the plain number (or None) as the configuration is built, never stored."""


_SIGMA_NOT_GIVEN = _DefaultSigma(DEFAULT_SIGMA)
#: the attributes beside the fields: the keys given (:attr:`TrainConfig.given`), and whether
#: construction is over (an assignment then adds its key to them)
_GIVEN, _TRACKING = "_given", "_tracking"


def plans_sigma(method: str, target_eps: float | None) -> bool:
    """The one rule of the CLI and the Python API: a target epsilon given without a sigma
    plans sigma for the rounds (sigma None, planned by the driver), except for a method whose
    budget rule keeps a fixed sigma (ALI-DPFL). With a sigma given too, the target is a
    budget the run stops before exceeding."""
    return (target_eps is not None and method in METHOD_TABLE
            and not method_spec(method).target_is_budget)


@dataclass
class TrainConfig:
    """A run's configuration. Defaults: FedLAP-DP on ``digits``, tuned for epsilon <= 10.

    The digits defaults (10 rounds, sigma 1.5, B 64, T = 1 x 5 x 2 = 10 accesses per round,
    lr_net 0.05) spend epsilon 8.73 at delta 1e-5 on the paper's non-IID split (PLD, the
    default accountant; RDP's Theorem 5.8 bound: 9.55). They are
    FedLAP-DP's ``small`` schedule:
    :func:`~fedlap_privacy.fl.config_resolve.resolve_config` lays the ``large`` one over them
    for clients of 1,024 records or more (:mod:`~fedlap_privacy.fl.methods.schedule`). 8x8 inputs
    get a narrower, shallower ConvNet (32 channels, 2 blocks): with 3 blocks the last
    GroupNorm sees 2x2 maps and training stalls, and fewer weights mean less DP noise.

    FedLAP knobs follow Algorithm 3 (docs/algorithms.md#fedlap-dp-client): ``reinits`` R_i,
    ``max_loops`` L_max, ``real_batches`` R_b,
    ``syn_steps`` R_s, ``local_model_steps`` R_l. Baselines use ``local_steps`` accesses
    per round (DP-SGD steps for the DP ones) at learning rate ``lr_local``.
    """

    method: str = "fedlap-dp"
    dataset: str = "digits"
    data_dir: str | None = None
    # a user's .npz records (fedlap_privacy.data.user_data); dataset "custom"
    data: str | None = None
    model: str | None = None  # FILE.py:FUNC or module:FUNC (fedlap_privacy.model_factory)
    split: str = "noniid"
    dirichlet_alpha: float = 0.5
    clients: int = 5
    client_records: int | None = None  # at most this many records per client (a random subset)
    validation_records: int = 0  # training records held out of every client, for tuning
    client_fraction: float = 1.0  # Poisson client sampling: each client's probability per round
    # fixed-size cohorts: K clients per round drawn uniformly without replacement (None: Poisson
    # at client_fraction); accounted by dp-fedavg-client (accountant/client_level.py)
    clients_per_round: int | None = None
    rounds: int = 10
    seed: int = 0  # the initial weights (public randomness: the released weights reveal it)
    # the split, the validation hold-out and the client subsets; None: a secret seed drawn
    # per run and kept in private.pt; set: reproducible, and the membership is declared public
    split_seed: int | None = None
    width: int | None = None  # ConvNet channels; None: 128 (docs/algorithms.md#convnet), 8x8: 32
    depth: int | None = None  # ConvNet blocks; None: 3 (docs/algorithms.md#convnet), 8x8: 2
    # privacy (record level). Not given: DEFAULT_SIGMA, or None (planned for the rounds)
    # where a target epsilon is given (plans_sigma: the CLI's rule)
    sigma: float | None = _SIGMA_NOT_GIVEN
    clip: float = 1.0
    delta: float = 1e-5
    target_eps: float | None = None
    # "pld" (default): sigma planned and epsilon reported with privacy loss distributions,
    # RDP's figure kept beside it; "rdp": Theorem 5.8's Renyi-DP bound (looser)
    accountant: str = AccountantName.PLD.value
    batch_size: int = 64
    # FedLAP (Algorithms 1-3)
    ipc: int = 10
    init: str = "noise"
    reinit_each_round: bool = False
    reinits: int = 1
    max_loops: int = 5
    real_batches: int = 2
    syn_steps: int = 5
    local_model_steps: int = 2
    mse_weight: float = 0.0
    lr_img: float = 100.0
    img_momentum: float = 0.5
    lr_net: float = 0.05
    radius: float = 1.5
    radius_rule: str = "fixed"
    server_epochs: int = 100
    server_batch: int = 512
    server_momentum: float = 0.5
    lr_schedule: str = "cosine"  # "cosine" (the authors') or "cosine-open" (LR_SCHEDULES)
    dsa: bool = True
    # baselines and the other methods (docs/algorithms.md#other-methods)
    local_steps: int = 10  # ALI-DPFL: its first round's tau
    lr_local: float = 0.5
    prox_mu: float = 0.01  # FedProx, DP-FedProx
    # the server's step: SCAFFOLD, DP-NormFedAvg: the global step on the averaged update;
    # FedLAP: its server optimisation runs at server_lr times the round's rate
    server_lr: float = 1.0
    tau_max: int = 100  # ALI-DPFL: upper clamp of tau
    ldp_epsilon: float | None = None  # LDP-FL: epsilon of each weight per round
    # dp-fedavg-client's adaptive clipping (Andrew et al. 2021); clip is the initial norm
    clip_quantile: float | None = None  # target quantile gamma of update norms; None: fixed
    clip_lr: float = 0.2  # eta_C of the geometric update C <- C exp(-eta_C (b - gamma))
    clip_count_sigma: float | None = None  # count noise std; None: max(cohort / 20, sigma)
    # threat model and randomness (docs/threat-model.md)
    threat_model: str | None = None  # None: the strongest the notion supports
    reproducible_noise: bool = False  # derive DP randomness from the seed: NOT private
    # canary audits (fl/auditing/canaries.py)
    canaries: int = 0  # M canaries, each included with a secret coin
    canary_kind: str | None = None  # None: white-box / clients / black-box by method
    canary_coordinates: str | None = None  # white box: None = dedicated for FedLAP-DP
    # the in-process driver's cohort (fl/engine/cohort.py): "vectorised" trains the selected clients
    # of FedAvg, FedProx and dp-fedavg-client in lockstep with vmap (refused where the model
    # does not allow it), "packed" packs their ConvNets into one network
    # (fl/engine/packed_cohort.py; ConvNet only), "loop" one by one; "auto": packed on the CPU where
    # the model packs (the fastest there: docs/train.md, "Cross-device scale"), else the loop;
    # vectorised on an accelerator where the model allows. The same result up to rounding
    cohort_training: str = "auto"
    # dp-fedavg-client over secure aggregation (docs/threat-model.md): each client adds its
    # share of "skellam" or "discrete-gaussian" noise (fl/secure_sum/training.py); None: the
    # trusted server adds Gaussian noise. Bits of the modular sum (None: the fewest within 2%
    # of central DP's noise for the model's size), the fewest uploads a round is released
    # with (None: secure_min_survivors), and the clients assumed to collude with the server
    secure_aggregation: str | None = None
    secure_bits: int | None = None
    min_survivors: int | None = None
    colluding: int = 0

    def __new__(cls, *args: Any, **kwargs: Any) -> TrainConfig:
        """Records the keys the caller passed (:attr:`given`), positionally or by name."""
        self = super().__new__(cls)
        self.__dict__[_GIVEN] = frozenset(_field_names()[:len(args)]) | frozenset(kwargs)
        return self

    def __post_init__(self) -> None:
        if self.sigma is _SIGMA_NOT_GIVEN:  # no sigma passed: the CLI's rule (plans_sigma)
            self.sigma = None if plans_sigma(self.method, self.target_eps) else DEFAULT_SIGMA
        self.__dict__[_TRACKING] = True  # from now on, a key assigned is a key given

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if self.__dict__.get(_TRACKING) and name in _field_names():
            self.__dict__[_GIVEN] = self.__dict__[_GIVEN] | {name}

    @property
    def given(self) -> frozenset[str]:
        """The keys the caller set: passed to the constructor (as ``from_dict`` and
        ``dataclasses.replace`` pass every key they hold) or assigned later. The keys left
        out are still to be decided by
        :func:`~fedlap_privacy.fl.config_resolve.resolve_given` (FedLAP-DP's schedule, the
        cross-device defaults, a planned sigma), as the CLI decides the flags a user did not
        type; a resolved configuration has every key given."""
        return self.__dict__[_GIVEN]  # type: ignore[no-any-return]

    def given_values(self) -> dict[str, Any]:
        """The values of the keys the caller set (:attr:`given`)."""
        return {key: getattr(self, key) for key in self.given}

    @property
    def spec(self) -> MethodSpec:
        """The method's row of the method table (:mod:`~fedlap_privacy.fl.methods.method_table`)."""
        return method_spec(self.method)

    @property
    def notion(self) -> Notion:
        """The privacy notion of the method: what its epsilon protects."""
        return self.spec.notion

    @property
    def resolved_threat_model(self) -> str | None:
        """Who the epsilon holds against (``fedlap_privacy.state.ledger``): the configured one, else
        the server where the notion allows it (client-level: observers of the models)."""
        allowed = NOTION_THREAT_MODELS[self.notion]
        return self.threat_model or (allowed[0].value if allowed else None)

    @property
    def resolved_canary_kind(self) -> str:
        """White box where the method releases noisy gradients, canary clients for
        client-level DP, canary records otherwise (unless ``canary_kind`` says)."""
        if self.canary_kind is not None:
            return self.canary_kind
        if self.spec.releases_gradients:
            return CanaryKind.WHITE_BOX.value
        kind = CanaryKind.CLIENTS if self.notion == Notion.CLIENT else CanaryKind.BLACK_BOX
        return kind.value

    @property
    def resolved_canary_coordinates(self) -> str:
        """Where white-box canaries go (unless ``canary_coordinates`` says): the method
        table's default (a dedicated block for FedLAP-DP, whose large Poisson batches on a
        small model put the real records' gradients on every weight and blur canaries there;
        the model's own weights for the other methods: ``fedlap_privacy.fl.methods.dp``)."""
        if self.canary_coordinates is not None:
            return self.canary_coordinates
        return self.spec.canary_coordinates

    @property
    def noise(self) -> str:
        """"secret" (OS-seeded DP randomness), "seeded" (``reproducible_noise``) or "none"
        (a non-private method: its randomness is seeded, there is nothing to protect)."""
        if self.notion == Notion.NONE:
            return NoiseKind.NONE.value
        return (NoiseKind.SEEDED if self.reproducible_noise else NoiseKind.SECRET).value

    @property
    def public_metadata(self) -> tuple[str, ...]:
        """What the method releases WITHOUT noise, declared public in the guarantee."""
        if self.notion == Notion.NONE:
            return ()
        split = () if self.split_seed is None else (
            f"which records each client holds (and the validation hold-out): they follow from "
            f"split_seed {self.split_seed}",)
        # where the epsilon assumes the selection hidden, the release withholds it (ledger)
        selection = () if selection_withheld(self.resolved_threat_model) else (
            "which clients were selected in each round, and how many",)
        return ("each client's dataset size N_k (the smallest sets the sampling rate)",
                *selection, *self.spec.public, *split)

    @property
    def private(self) -> bool:
        """Gaussian-noise DP with an (epsilon, delta) accountant (record or client level)."""
        return self.spec.private

    @property
    def is_fedlap(self) -> bool:
        return self.spec.fedlap

    @property
    def accesses_per_round(self) -> int:
        """Worst-case accesses to private data per client-round (T of Theorem 5.8; ALI-DPFL:
        tau_max, each round entering its own tau; client level: one release per round)."""
        return self.spec.accounted_steps(self)

    def validate(self) -> TrainConfig:
        """Refuse (one line, :class:`ConfigError`) an impossible configuration, before any data
        is read: first every key against its rule
        (:data:`~fedlap_privacy.fl.config_rules.FIELD_RULES`: type, finite, range),
        then the rules that tie keys together (the method's own, canaries, threat model)."""
        from fedlap_privacy.data.datasets import CUSTOM

        for f in dataclasses.fields(self):
            FIELD_RULES[f.name].check(f.name, getattr(self, f.name), optional_field(f.name))
        if (self.data is not None) != (self.dataset == CUSTOM):
            raise ConfigError(f"dataset {CUSTOM!r} means a user's records: it goes with "
                              "data=PATH (--data)")
        if self.accesses_per_round < 1:
            raise ConfigError("each round must make at least one access")
        self._validate_sampling()
        if not self.spec.adaptive_clip and (self.clip_quantile is not None
                                            or self.clip_count_sigma is not None):
            raise ConfigError(f"adaptive clipping (clip_quantile, clip_count_sigma) is "
                              f"dp-fedavg-client's, not {self.method}'s")
        self._validate_client_count()
        self.spec.check(self)
        self._validate_canaries()
        self._validate_secure()
        allowed = NOTION_THREAT_MODELS[self.notion]
        if self.threat_model is not None and self.threat_model not in allowed:
            raise ConfigError(
                f"threat model {self.threat_model!r} does not apply to {self.method} "
                f"({self.notion} DP); it allows: {', '.join(allowed) or 'none'}"
            )
        return self

    @property
    def sampling(self) -> ClientSampling:
        """How each round's clients are drawn (Poisson at ``client_fraction``, or fixed-size
        cohorts of ``clients_per_round``), as the accountant prices it."""
        return ClientSampling(self.clients, self.client_fraction, self.clients_per_round)

    @property
    def clip_count_noise(self) -> float:
        """Adaptive clipping's count noise std: ``clip_count_sigma``, else Andrew et al.'s
        default, the expected cohort / 20, raised to sigma where that is less (the update
        noise is then at most 2/sqrt(3) sigma; below sigma / 2 it could be none)."""
        if self.clip_count_sigma is not None:
            return self.clip_count_sigma
        return max(self.sampling.expected_cohort / 20.0, self.sigma or 0.0)

    def _validate_sampling(self) -> None:
        if self.clients_per_round is None:
            return
        if self.clients_per_round > self.clients:
            raise ConfigError(f"clients per round {self.clients_per_round} is larger than the "
                              f"{self.clients} clients")
        if self.client_fraction != 1.0:
            raise ConfigError("give a client fraction (Poisson sampling) or clients per round "
                              "(fixed-size cohorts), not both")
        if self.private and not self.spec.fixed_cohorts:
            raise ConfigError(f"clients per round: {self.method}'s accountant assumes Poisson "
                              "client sampling; use a client fraction")
        if self.canaries:
            raise ConfigError("canaries are sampled at the client fraction: they do not run "
                              "with fixed-size cohorts (clients per round)")
    @property
    def secure_capacity(self) -> int:
        """The most uploads a round over secure aggregation sums: K, else every client plus
        every canary client (Poisson sampling may select them all)."""
        return self.clients_per_round or self.clients + self.canaries

    @property
    def secure_min_survivors(self) -> int:
        """``min_survivors``, else every client of a fixed cohort (K, or all at client
        fraction 1) and half the expected cohort, rounded up, under Poisson sampling; at
        least one more than the colluding clients."""
        if self.min_survivors is not None:
            return self.min_survivors
        fixed = self.clients_per_round or (self.clients if self.client_fraction == 1.0 else 0)
        return max(fixed or math.ceil(self.sampling.expected_cohort / 2), self.colluding + 1)

    def _validate_secure(self) -> None:
        """Secure aggregation: client-level DP-FedAvg with a fixed clip and a given sigma
        (the noise multiplier of the sum of min_survivors - colluding honest shares)."""
        if self.secure_aggregation is None:
            if self.secure_bits is not None or self.min_survivors is not None or self.colluding:
                raise ConfigError("bits, min_survivors and colluding go with secure_aggregation "
                                  "(--secure-aggregation)")
            return
        why = (f"is client-level DP-FedAvg's (--method dp-fedavg-client), not {self.method}'s"
               if self.method != "dp-fedavg-client" else
               "sums the updates at a fixed clip: adaptive clipping's noisy count is not summed "
               "securely (leave clip_quantile unset)" if self.clip_quantile is not None else
               "draws every share from the operating system: --reproducible-noise does not "
               "apply" if self.reproducible_noise else None)
        if why is None and not (self.colluding < self.secure_min_survivors
                                <= self.secure_capacity):
            why = (f"needs colluding ({self.colluding}) < min_survivors "
                   f"({self.secure_min_survivors}) <= the uploads a round sums "
                   f"({self.secure_capacity})")
        if why is not None:
            raise ConfigError(f"secure aggregation {why}")

    def _validate_client_count(self) -> None:
        """A built-in dataset's records must go round the clients (each holds one or more;
        the shards split two shards of one or more): refused before the data is read."""
        from fedlap_privacy.data.datasets import TRAIN_RECORDS

        if self.dataset not in TRAIN_RECORDS or self.split == "noniid":
            return  # noniid: split_clients refuses more clients than classes
        records = TRAIN_RECORDS[self.dataset] - self.validation_records
        per_client = 2 if self.split == "shards" else 1
        if self.clients * per_client > records:
            what = "2 shards of at least one record each" if per_client == 2 else "a record"
            raise ConfigError(f"clients {self.clients}: {self.dataset} has {records:,} training "
                              f"records for the clients, too few to give each of them {what} "
                              f"(at most {records // per_client:,} clients)")

    def _validate_canaries(self) -> None:
        if 0 < self.canaries < MIN_AUDIT_CANARIES:
            raise ConfigError(f"canaries {self.canaries}: the one-run audit needs at least "
                              f"{MIN_AUDIT_CANARIES} canaries to rank (0: none)")
        kind = self.resolved_canary_kind
        if kind == CanaryKind.WHITE_BOX and not self.spec.releases_gradients:
            releasing = [m for m, spec in METHOD_TABLE.items() if spec.releases_gradients]
            raise ConfigError(f"white-box canaries need a method that releases noisy gradients "
                              f"({', '.join(releasing)}), not {self.method}")
        if self.canary_coordinates is not None and kind != CanaryKind.WHITE_BOX:
            raise ConfigError("canary_coordinates applies to white-box canaries only")
        if kind == CanaryKind.CLIENTS and self.notion != Notion.CLIENT:
            raise ConfigError("canary clients audit client-level DP (dp-normfedavg, "
                              "dp-fedavg-client) only")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ConfigError(f"unknown configuration keys: {', '.join(sorted(unknown))}")
        return cls(**values)

    @classmethod
    def from_recorded(cls, values: dict[str, Any]) -> TrainConfig:
        """A configuration a run recorded (its private state, a reference model's manifest).
        One recorded without an ``accountant`` predates the choice and ran with RDP, the
        default then: it keeps RDP (PLD became the default later), and its ledger's entries,
        which record their accountant, must agree."""
        return cls.from_dict({"accountant": RECORDED_ACCOUNTANT, **values})



#: the accountant of a recorded configuration without one (:meth:`TrainConfig.from_recorded`)
RECORDED_ACCOUNTANT = AccountantName.RDP.value


@functools.cache
def _field_names() -> tuple[str, ...]:
    """:class:`TrainConfig`'s fields in the constructor's order."""
    return tuple(f.name for f in dataclasses.fields(TrainConfig))


@functools.cache
def field_types() -> dict[str, type]:
    """Every :class:`TrainConfig` field and its base type (bool, int, float or str)."""
    hints = typing.get_type_hints(TrainConfig)
    out: dict[str, type] = {}
    for f in dataclasses.fields(TrainConfig):
        base = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
        out[f.name] = base[0] if base else hints[f.name]
    return out


@functools.cache
def optional_field(key: str) -> bool:
    """Whether ``key`` may be None (its type hint is ``X | None``)."""
    return type(None) in typing.get_args(typing.get_type_hints(TrainConfig)[key])


#: the authors' configurations, DP run / non-private (docs/algorithms.md#default-configurations)
PRESETS: dict[str, dict[str, Any]] = {
    "paper-dp": dict(
        method="fedlap-dp", rounds=30, **AUTHORS_DP, sigma=1.0, clip=1.0, delta=1e-5,
        clients=5, client_fraction=1.0, local_steps=200, lr_local=0.1,
    ),
    "paper": dict(
        method="fedlap", rounds=200, reinits=1, max_loops=5, real_batches=40, syn_steps=5,
        local_model_steps=0, ipc=50, init="real", reinit_each_round=True, mse_weight=0.1,
        lr_img=100.0, lr_net=0.1, radius=10.0, radius_rule="min", server_epochs=100,
        server_batch=512, server_momentum=0.0, clients=5, client_fraction=1.0, batch_size=256,
        sigma=None,
    ),
}
