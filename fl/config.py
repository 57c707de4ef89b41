"""Training configuration: every knob of FedLAP-DP and the baselines, and the presets that load
the authors' values (docs/algorithms.md#default-configurations)."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlap_privacy.accountant import ACCOUNTANTS
from fedlap_privacy.accountant.client_level import ClientSampling
from fedlap_privacy.accountant.planning import SIGMA_RANGE
from fedlap_privacy.canary_state import CANARY_COORDINATES, CANARY_KINDS
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.method_table import (
    LDP_MAX_EPSILON,
    METHOD_TABLE,
    MethodSpec,
    method_spec,
)
from fedlap_privacy.fl.schedule import (
    AUTHORS_DP,
    SCHEDULED_METHOD,
    ClientSchedule,
    choose_schedule,
)
from fedlap_privacy.ledger import (
    NOTION_THREAT_MODELS,
    THREAT_MODELS,
    Notion,
    selection_withheld,
)

__all__ = [
    "FIELD_RULES", "INITS", "LR_SCHEDULES", "MAX_ROUNDS", "METHODS", "PRESETS",
    "RADIUS_RULES", "RECORDED_ACCOUNTANT", "FieldRule", "TrainConfig", "check_resume_flags",
    "config_value", "fedlap_schedule", "field_types", "parse_overrides", "resolve_config",
    "resumed_config", "typed_value",
]

METHODS = tuple(METHOD_TABLE)
RADIUS_RULES = ("fixed", "min", "max", "median", "iterations")
INITS = ("noise", "real")  # FedLAP's synthetic images start as noise or as real records
#: FedLAP's rate over rounds (``fl.fedlap.cosine_lr``): the authors' cosine, which reaches its
#: 1e-6 floor in the last round, or the cosine that stops one round short of zero
LR_SCHEDULES = ("cosine", "cosine-open")
#: how the in-process driver trains a round's cohort (``cohort_training``, fl/cohort.py;
#: ``packed``: fl/packed_cohort.py)
COHORT_TRAINING = ("auto", "packed", "vectorised", "loop")


@dataclass
class TrainConfig:
    """A run's configuration. Defaults: FedLAP-DP on ``digits``, tuned for epsilon <= 10.

    The digits defaults (10 rounds, sigma 1.5, B 64, T = 1 x 5 x 2 = 10 accesses per round,
    lr_net 0.05) spend epsilon 8.73 at delta 1e-5 on the paper's non-IID split (PLD, the
    default accountant; RDP's Theorem 5.8 bound: 9.55). They are
    FedLAP-DP's ``small`` schedule: :func:`resolve_config` lays the ``large`` one over them
    for clients of 1,024 records or more (:mod:`~fedlap_privacy.fl.schedule`). 8x8 inputs
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
    data: str | None = None  # a user's .npz records (fedlap_privacy.user_data); dataset "custom"
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
    # privacy (record level)
    sigma: float | None = 1.5
    clip: float = 1.0
    delta: float = 1e-5
    target_eps: float | None = None
    # "pld" (default): sigma planned and epsilon reported with privacy loss distributions,
    # RDP's figure kept beside it; "rdp": Theorem 5.8's Renyi-DP bound (looser)
    accountant: str = "pld"
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
    # canary audits (fl/canaries.py)
    canaries: int = 0  # M canaries, each included with a secret coin
    canary_kind: str | None = None  # None: white-box / clients / black-box by method
    canary_coordinates: str | None = None  # white box: None = dedicated for FedLAP-DP
    # the in-process driver's cohort (fl/cohort.py): "vectorised" trains the selected clients
    # of FedAvg, FedProx and dp-fedavg-client in lockstep with vmap (refused where the model
    # does not allow it), "packed" packs their ConvNets into one network (fl/packed_cohort.py;
    # ConvNet only), "loop" one by one; "auto": packed on the CPU where the model packs (the
    # fastest there: docs/train.md, "Cross-device scale"), else the loop; vectorised on an
    # accelerator where the model allows. The same result up to rounding
    cohort_training: str = "auto"

    @property
    def spec(self) -> MethodSpec:
        """The method's row of the method table (:mod:`~fedlap_privacy.fl.method_table`)."""
        return method_spec(self.method)

    @property
    def notion(self) -> Notion:
        """The privacy notion of the method: what its epsilon protects."""
        return self.spec.notion

    @property
    def resolved_threat_model(self) -> str | None:
        """Who the epsilon holds against (``fedlap_privacy.ledger``): the configured one, else
        the server where the notion allows it (client-level: observers of the models)."""
        allowed = NOTION_THREAT_MODELS[self.notion]
        return self.threat_model or (allowed[0] if allowed else None)

    @property
    def resolved_canary_kind(self) -> str:
        """White box where the method releases noisy gradients, canary clients for
        client-level DP, canary records otherwise (unless ``canary_kind`` says)."""
        if self.canary_kind is not None:
            return self.canary_kind
        if self.spec.releases_gradients:
            return "white-box"
        return "clients" if self.notion == "client-level" else "black-box"

    @property
    def resolved_canary_coordinates(self) -> str:
        """Where white-box canaries go (unless ``canary_coordinates`` says): a dedicated
        block for FedLAP-DP, whose large Poisson batches on a small model put the real
        records' gradients on every weight and blur canaries there; the model's own
        weights for the other methods (``fedlap_privacy.fl.dp``, module docstring)."""
        if self.canary_coordinates is not None:
            return self.canary_coordinates
        return "dedicated" if self.method == "fedlap-dp" else "weights"

    @property
    def noise(self) -> str:
        """"secret" (OS-seeded DP randomness), "seeded" (``reproducible_noise``) or "none"
        (a non-private method: its randomness is seeded, there is nothing to protect)."""
        if self.notion == "none":
            return "none"
        return "seeded" if self.reproducible_noise else "secret"

    @property
    def public_metadata(self) -> tuple[str, ...]:
        """What the method releases WITHOUT noise, declared public in the guarantee."""
        if self.notion == "none":
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
        is read: first every key against its rule (:data:`FIELD_RULES`: type, finite, range),
        then the rules that tie keys together (the method's own, canaries, threat model)."""
        from fedlap_privacy.data import CUSTOM

        for f in dataclasses.fields(self):
            FIELD_RULES[f.name].check(f.name, getattr(self, f.name), _optional(f.name))
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
    def _validate_client_count(self) -> None:
        """A built-in dataset's records must go round the clients (each holds one or more;
        the shards split two shards of one or more): refused before the data is read."""
        from fedlap_privacy.data import TRAIN_RECORDS

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
        kind = self.resolved_canary_kind
        if kind == "white-box" and not self.spec.releases_gradients:
            releasing = [m for m, spec in METHOD_TABLE.items() if spec.releases_gradients]
            raise ConfigError(f"white-box canaries need a method that releases noisy gradients "
                              f"({', '.join(releasing)}), not {self.method}")
        if self.canary_coordinates is not None and kind != "white-box":
            raise ConfigError("canary_coordinates applies to white-box canaries only")
        if kind == "clients" and self.notion != "client-level":
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
RECORDED_ACCOUNTANT = "rdp"
#: the most rounds a run may have (the accountant's epsilon curve of a plan goes as far).
#: PLD composes any number of rounds in one FFT (100,000 rounds in about a second); a run
#: whose privacy loss it cannot discretise within its memory budget is refused when its
#: ledger is built (``fl.privacy.check_accountable``), naming the RDP fallback
MAX_ROUNDS = 100_000


@dataclass(frozen=True)
class FieldRule:
    """What one configuration key accepts: its type (``kind``) and, for a number, a finite
    value in the range from ``lo`` to ``hi`` (None: unbounded; ``*_open``: the end itself
    excluded), for a word one of ``choices`` (a callable: read on use). Whether None is
    allowed comes from the field's type hint (``X | None``)."""

    kind: type
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: Callable[[], Sequence[str]] | None = None

    def allows(self, value: Any) -> bool:
        """Whether ``value`` (not None) has the right type and lies in the range."""
        if self.kind is bool:
            return isinstance(value, bool)
        if self.kind is str:
            return isinstance(value, str) and (self.choices is None or value in self.choices())
        if isinstance(value, bool) or not isinstance(value, int if self.kind is int else
                                                     int | float):
            return False
        if not math.isfinite(value):
            return False
        above = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        below = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return above and below

    def describe(self, optional: bool = False) -> str:
        """The allowed values in words, e.g. "an integer in [1, 1024]"."""
        if self.kind is bool:
            text = "true or false"
        elif self.kind is str:
            text = "a text" if self.choices is None else f"one of {', '.join(self.choices())}"
        else:
            text = "an integer" if self.kind is int else "a finite number"
            if self.lo is not None and self.hi is not None:
                opening, closing = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
                text += f" in {opening}{_number(self.lo)}, {_number(self.hi)}{closing}"
            elif self.lo is not None:
                text += f" {'>' if self.lo_open else '>='} {_number(self.lo)}"
        return text + (" or none" if optional else "")

    def check(self, key: str, value: Any, optional: bool) -> None:
        """Refuse ``value`` for ``key`` with one line naming both and the allowed range."""
        if value is None and optional:
            return
        if value is None or not self.allows(value):
            raise ConfigError(f"{key} {value!r} must be {self.describe(optional)}")


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _int(lo: int, hi: int | None = None) -> FieldRule:
    return FieldRule(int, lo, hi)


def _num(lo: float | None, hi: float | None = None, *, lo_open: bool = False,
         hi_open: bool = False) -> FieldRule:
    return FieldRule(float, lo, hi, lo_open, hi_open)


def _words(choices: Callable[[], Sequence[str]]) -> FieldRule:
    return FieldRule(str, choices=choices)


def _datasets() -> Sequence[str]:
    from fedlap_privacy.data import CUSTOM, DATASETS

    return (*DATASETS, CUSTOM)


def _splits() -> Sequence[str]:
    from fedlap_privacy.data import SPLITS

    return SPLITS


_BOOL = FieldRule(bool)
_POSITIVE = _num(0, lo_open=True)
_MOMENTUM = _num(0, 1, hi_open=True)
#: loop counts (accesses, steps, epochs): a bound far above any real run, so that a typo
#: cannot ask for a run that never ends
_LOOPS = 10**5

#: the rule of every :class:`TrainConfig` key (docs/algorithms.md; :meth:`TrainConfig.validate`
#: checks them all before any data is read). A new key needs its rule here.
FIELD_RULES: dict[str, FieldRule] = {
    "method": _words(lambda: METHODS),
    "dataset": _words(_datasets),
    "data_dir": FieldRule(str),
    "data": FieldRule(str),  # a user's .npz records (fedlap_privacy.user_data checks them)
    "model": FieldRule(str),  # a factory spec (fedlap_privacy.model_factory checks it)
    "split": _words(_splits),
    "dirichlet_alpha": _POSITIVE,
    "clients": _int(1, 100_000),
    "client_records": _int(1),
    "validation_records": _int(0),
    "client_fraction": _num(0, 1, lo_open=True),
    "clients_per_round": _int(1, 100_000),  # at most the clients (checked with them)
    "rounds": _int(1, MAX_ROUNDS),
    "seed": _int(0, 2**63 - 1),  # numpy's and torch's seeds
    "split_seed": _int(0, 2**63 - 1),  # none: secret, drawn per run (fl.randomness)
    "width": _int(1, 1024),  # ConvNet channels: width^2 x 9 weights per block
    "depth": _int(1, 5),  # each block halves the image: 5 blocks take 32x32 to 1x1
    "sigma": _num(0, SIGMA_RANGE[1], lo_open=True),
    "clip": _num(0, 1e6, lo_open=True),
    "delta": _num(0, 1, lo_open=True, hi_open=True),
    "target_eps": _POSITIVE,
    "accountant": _words(lambda: ACCOUNTANTS),
    "batch_size": _int(1, 10**6),
    "ipc": _int(1, 1000),  # synthetic images per class, held by every client and the server
    "init": _words(lambda: INITS),
    "reinit_each_round": _BOOL,
    "reinits": _int(1, _LOOPS),
    "max_loops": _int(1, _LOOPS),
    "real_batches": _int(1, _LOOPS),
    "syn_steps": _int(0, _LOOPS),  # 0: a node policy refuses it for FedLAP-DP
    "local_model_steps": _int(0, _LOOPS),
    "mse_weight": _num(0),
    "lr_img": _POSITIVE,
    "img_momentum": _MOMENTUM,
    "lr_net": _POSITIVE,
    "radius": _POSITIVE,
    "radius_rule": _words(lambda: RADIUS_RULES),
    "server_epochs": _int(1, _LOOPS),
    "server_batch": _int(1, 10**6),
    "server_momentum": _MOMENTUM,
    "lr_schedule": _words(lambda: LR_SCHEDULES),
    "dsa": _BOOL,
    "local_steps": _int(1, _LOOPS),
    "lr_local": _POSITIVE,
    "prox_mu": _num(0),
    "server_lr": _POSITIVE,
    "tau_max": _int(1, _LOOPS),
    "ldp_epsilon": _num(0, LDP_MAX_EPSILON, lo_open=True),
    "clip_quantile": _num(0, 1, lo_open=True, hi_open=True),
    "clip_lr": _num(0, 10, lo_open=True),
    "clip_count_sigma": _num(0, 1e9, lo_open=True),
    "threat_model": _words(lambda: THREAT_MODELS),
    "reproducible_noise": _BOOL,
    "canaries": _int(0, 10**6),
    "canary_kind": _words(lambda: CANARY_KINDS),
    "canary_coordinates": _words(lambda: CANARY_COORDINATES),
    "cohort_training": _words(lambda: COHORT_TRAINING),
}


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
def _optional(key: str) -> bool:
    return type(None) in typing.get_args(typing.get_type_hints(TrainConfig)[key])


def config_value(key: str, raw: Any, *, text: bool) -> Any:
    """The ONE parser of a configuration value: ``raw`` for field ``key`` as its type.

    ``text=True`` (``--set KEY=VALUE``): ``raw`` is text, read as the field's type
    (``none``/``null``/empty for an optional field; true/false/1/0 for a bool). ``text=False``
    (a Flower run config, TOML-typed): ``raw`` must already have the field's type (an
    integral float for an int), ``""`` standing for None; nothing is converted from text.
    Ranges are not checked here: :meth:`TrainConfig.validate` does (:data:`FIELD_RULES`).
    """
    types = field_types()
    if key not in types:
        raise ConfigError(f"unknown configuration key {key.replace('_', '-')!r}")
    kind = types[key]
    if text:
        word = str(raw).strip()
        if _optional(key) and word.lower() in ("none", "null", ""):
            return None
        try:
            if kind is bool:
                return {"true": True, "false": False, "1": True, "0": False}[word.lower()]
            return kind(word)
        except (KeyError, ValueError):
            raise ConfigError(f"{key}: {word!r} is not a valid {kind.__name__}") from None
    if raw == "" and _optional(key):
        return None
    return typed_value(key.replace("_", "-"), kind, raw)


def typed_value(name: str, kind: type, raw: Any) -> Any:
    """``raw`` as a ``kind`` (bool, int, float, str), refusing anything but that type (an
    integral float passes for an int): the check of a TOML-typed value."""
    ok = {
        bool: isinstance(raw, bool),
        int: isinstance(raw, int | float) and not isinstance(raw, bool)
        and math.isfinite(raw) and float(raw).is_integer(),
        float: isinstance(raw, int | float) and not isinstance(raw, bool),
        str: isinstance(raw, str),
    }[kind]
    if not ok:
        raise ConfigError(f"configuration key {name} must be {kind.__name__}, not {raw!r}")
    return kind(raw)


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["key=value", ...]`` (``--set``) -> typed TrainConfig values (:func:`config_value`)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in field_types():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a configuration key")
        try:
            out[key] = config_value(key, text, text=True)
        except ConfigError as exc:
            raise ConfigError(f"--set {item!r}: {exc}") from None
    return out


def resolve_config(
    preset: str | None = None,
    flags: dict[str, Any] | None = None,
    settings: Sequence[str] = (),
    plan_sigma_for_target: bool = True,
    schedule: str = "auto",
) -> TrainConfig:
    """The one way from what a user typed to a validated configuration.

    Layers, each over the previous: the defaults, FedLAP-DP's ``schedule`` (``auto``: picked
    from the client size, :mod:`~fedlap_privacy.fl.schedule`), ``preset`` (:data:`PRESETS`),
    ``flags`` (None: not given) and ``settings`` (``--set KEY=VALUE``). Then, with
    ``plan_sigma_for_target``, a target epsilon given without a sigma (neither as a flag nor
    as a setting) plans sigma for the rounds, except for methods whose budget rule keeps a
    fixed sigma (ALI-DPFL).
    """
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"preset {preset!r} must be one of {', '.join(PRESETS)}")
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    given.update(parse_overrides(settings))
    values = {**(PRESETS[preset] if preset else {}), **given}
    chosen = fedlap_schedule(schedule, values)
    if chosen is not None:
        values = {**chosen.values(values.get("rounds", TrainConfig.rounds)), **values}
    if plan_sigma_for_target and given.get("target_eps") is not None and "sigma" not in given:
        from fedlap_privacy.fl.method_table import Budget

        if method_spec(values.get("method", TrainConfig.method)).budget != Budget.ALI:
            values["sigma"] = None
    return TrainConfig.from_dict(values).validate()


def check_resume_flags(
    recorded: TrainConfig,
    flags: Mapping[str, tuple[str, Any]],
    preset: str | None = None,
    settings: Sequence[str] = (),
    schedule: str = "auto",
) -> None:
    """``train --resume`` continues a run with its RECORDED configuration: refuse, in one line
    naming them, the flags that ask for another value (they used to be ignored silently).

    ``flags``: each flag the user typed, its name -> (configuration key, value); ``preset``,
    ``settings`` (``--set``) and a named ``schedule`` (``auto``: none), layered as
    :func:`resolve_config` layers them, so a flag shadows the preset's or schedule's value of
    its key, and a target epsilon given without a sigma asks for the planned sigma the run
    recorded. A flag equal to the recorded value passes. ``--rounds`` is not among ``flags``:
    it may change the total; a preset's or schedule's round count is left out likewise.
    """
    asked: dict[str, tuple[str, Any]] = {}  # key -> (the flag that asks, as shown; the value)
    chosen = None if schedule == "auto" else fedlap_schedule(schedule, recorded.to_dict())
    if chosen is not None:
        asked.update({k: (f"--schedule {schedule} ({k}={v!r})", v)
                      for k, v in chosen.values(recorded.rounds).items()})
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"preset {preset!r} must be one of {', '.join(PRESETS)}")
        asked.update({k: (f"--preset {preset} ({k}={v!r})", v)
                      for k, v in PRESETS[preset].items()})
    asked.pop("rounds", None)
    overrides = parse_overrides(settings)
    asked.update({key: (f"{flag} {value!r}", value) for flag, (key, value) in flags.items()})
    asked.update({key: (f"--set {key}={value!r}", value) for key, value in overrides.items()})
    typed = {key for key, _ in flags.values()} | set(overrides)
    if "target_eps" in typed and "sigma" not in typed:
        asked.pop("sigma", None)  # the planned sigma, as the run planned it
    conflicts = [
        f"{shown} (the run has {getattr(recorded, key)!r})"
        for key, (shown, value) in asked.items() if not _same(key, value, getattr(recorded, key))
    ]
    if conflicts:
        raise ConfigError(f"--resume continues the run with its recorded settings; these flags "
                          f"differ: {'; '.join(conflicts)} (only --rounds may change)")


def _same(key: str, asked: Any, recorded: Any) -> bool:
    """Whether a flag's value is the recorded one (a data folder: the same folder)."""
    if key == "data_dir" and asked is not None and recorded is not None:
        return Path(asked).resolve() == Path(recorded).resolve()
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (asked, recorded))
    return asked == recorded if numbers else type(asked) is type(recorded) and asked == recorded


def resumed_config(
    out: str | Path,
    flags: Mapping[str, tuple[str, Any]],
    preset: str | None = None,
    settings: Sequence[str] = (),
    schedule: str = "auto",
    rounds: int | None = None,
) -> TrainConfig:
    """The configuration ``train --resume`` continues: the run's recorded one (``rounds``: a
    new total), after :func:`check_resume_flags` found no flag asking for another value."""
    from fedlap_privacy.fl.run_files import load_run_config

    recorded = load_run_config(Path(out))
    check_resume_flags(recorded, flags, preset, settings, schedule)
    return (recorded if rounds is None else dataclasses.replace(recorded, rounds=rounds)).validate()


def fedlap_schedule(requested: str, values: dict[str, Any]) -> ClientSchedule | None:
    """The schedule :func:`resolve_config` lays under ``values`` (configuration keys, the
    defaults where absent); None for a method other than FedLAP-DP, which ``requested``
    must then leave at ``auto``."""
    default = TrainConfig()
    method = values.get("method", default.method)
    if method != SCHEDULED_METHOD:
        if requested != "auto":
            raise ConfigError(f"--schedule {requested}: schedules are FedLAP-DP's, not {method}'s")
        return None
    return choose_schedule(
        requested, *(values.get(key, getattr(default, key)) for key in
                     ("dataset", "clients", "client_records", "validation_records", "data")),
    )


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
