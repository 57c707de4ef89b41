"""The rule of every configuration key: its type, its range or its words
(:data:`FIELD_RULES`), and the word lists the keys choose from. :meth:`TrainConfig.validate
<fedlap_privacy.fl.config.TrainConfig.validate>` checks every key against its rule before any
data is read (docs/algorithms.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fedlap_privacy.accountant import accountant_names
from fedlap_privacy.accountant.distributed import DistributedNoise
from fedlap_privacy.accountant.planning import SIGMA_RANGE
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.methods.method_table import LDP_MAX_EPSILON, METHOD_TABLE
from fedlap_privacy.vocabulary import CanaryCoordinates, CanaryKind, ThreatModel, words

__all__ = [
    "COHORT_TRAINING", "FIELD_RULES", "INITS", "LR_SCHEDULES", "MAX_ROUNDS", "METHODS",
    "RADIUS_RULES", "FieldRule",
]

METHODS = tuple(METHOD_TABLE)
RADIUS_RULES = ("fixed", "min", "max", "median", "iterations")
INITS = ("noise", "real")  # FedLAP's synthetic images start as noise or as real records
#: FedLAP's rate over rounds (``fl.methods.fedlap.cosine_lr``): the authors' cosine, which reaches
#: its 1e-6 floor in the last round, or the cosine that stops one round short of zero
LR_SCHEDULES = ("cosine", "cosine-open")
#: how the in-process driver trains a round's cohort (``cohort_training``, fl/engine/cohort.py;
#: ``packed``: fl/engine/packed_cohort.py)
COHORT_TRAINING = ("auto", "packed", "vectorised", "loop")
#: the most rounds a run may have (the accountant's epsilon curve of a plan goes as far).
#: PLD composes any number of rounds in one FFT (100,000 rounds in about a second); a run
#: whose privacy loss it cannot discretise within its memory budget is refused when its
#: ledger is built (``fl.run.privacy.check_accountable``), naming the RDP fallback
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
    from fedlap_privacy.data.datasets import CUSTOM, DATASETS

    return (*DATASETS, CUSTOM)


def _splits() -> Sequence[str]:
    from fedlap_privacy.data.datasets import SPLITS

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
    "data": FieldRule(str),  # a user's .npz records (fedlap_privacy.data.user_data checks them)
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
    "split_seed": _int(0, 2**63 - 1),  # none: secret, drawn per run (fl.run.randomness)
    "width": _int(1, 1024),  # ConvNet channels: width^2 x 9 weights per block
    "depth": _int(1, 5),  # each block halves the image: 5 blocks take 32x32 to 1x1
    "sigma": _num(0, SIGMA_RANGE[1], lo_open=True),
    "clip": _num(0, 1e6, lo_open=True),
    "delta": _num(0, 1, lo_open=True, hi_open=True),
    "target_eps": _POSITIVE,
    "accountant": _words(accountant_names),
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
    "threat_model": _words(lambda: words(ThreatModel)),
    "reproducible_noise": _BOOL,
    "canaries": _int(0, 10**6),
    "canary_kind": _words(lambda: words(CanaryKind)),
    "canary_coordinates": _words(lambda: words(CanaryCoordinates)),
    "cohort_training": _words(lambda: COHORT_TRAINING),
    "secure_aggregation": _words(lambda: words(DistributedNoise)),
    "secure_bits": _int(2, 62),  # the sum must also fit without wrap-around (accountant)
    "min_survivors": _int(1, 100_000),
    "colluding": _int(0, 100_000),
}
