"""Scores of white-box gradient canaries from the releases they were added to (torch-free).

A gradient canary ``j`` owns coordinate ``j`` of a block of parameters that no record's
gradient reaches (:mod:`.gradient_canaries`). At step ``t`` the optimiser releases, on that
coordinate, ``u_t = b_t + z_t`` in units of the clipping norm ``C``: ``b_t = 1`` when the
canary is included (secret coin ``S_j``) and was sampled at this step, else 0, and ``z_t`` the
mechanism's noise, ``N(0, sigma^2)`` for DP-SGD with noise multiplier ``sigma``.

Scores (higher = more likely included):

* :func:`poisson_scores`: the log-likelihood ratio of "included" against "not included" for a
  canary Poisson-sampled at rate ``q`` per step (the Neyman-Pearson statistic
  for one canary, the releases of a step being independent given the coins):
  ``sum_t log(1 - q + q exp((u_t - 1/2) / s^2))``, where ``N(1, s^2) / N(0, s^2)`` at ``u`` is
  ``exp((u - 1/2) / s^2)``;
* :func:`shuffle_scores`: the same ratio for a canary that, as every record of a shuffled
  epoch, enters exactly one of the epoch's ``k`` steps, chosen uniformly:
  ``sum_epochs log((k - n)/k + (1/k) sum_{t in epoch} exp((u_t - 1/2) / s^2))`` (``n`` steps of
  the epoch observed; ``k - n`` slots after the end of an unfinished epoch release nothing);
* :func:`summed_scores`: ``sum_t u_t``, the total update on the coordinate (what a
  final-model auditor sees).

``s`` is the noise multiplier the score assumes: the claimed one, or the one measured on the
block (:func:`measured_noise_multiplier`: a robust scale of all ``m T`` released values,
most of which are pure noise; :func:`measured_noise_by_step`: the same over the steps the
optimiser ran with the same noise multiplier and clipping norm, one scale per step). Any
function of the releases alone is a valid one-run score (Steinke, Nasr, Jagielski 2023, the
guesser may post-process the output freely); the measured scale never looks at the secret
coins, nor do the groups (the optimiser's own values). With the scale of the noise that
actually ran the ratio is the most powerful test of each canary's inclusion
(Neyman-Pearson), so a run whose noise is too small is seen as such.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import logsumexp

from fedlap_privacy.audit.canaries.canary_steps import Change, OptimizerSetup
from fedlap_privacy.errors import ConfigError

__all__ = ["CanaryRun", "measured_noise_by_step", "measured_noise_multiplier", "poisson_scores",
           "shuffle_scores", "summed_scores"]

#: MAD of a standard normal (Phi^-1(3/4)): MAD / this estimates its scale
_MAD_NORMAL = 0.6744897501960817


@dataclass(frozen=True)
class CanaryRun:
    """What the canaries saw: ``steps`` released steps, the sampling rule (``sample_rate``,
    the rate the run was set up to be accounted at per step, and ``steps_per_epoch`` for
    shuffled batches, None for Poisson), the noise multiplier and clipping norm the
    optimiser used (single values, or None when they changed), and the noise multiplier
    measured on the block (units of ``C``).

    ``route``: where the canaries entered (``optimizer``, ``data pipeline``, ``plain
    loop``); ``setup``: what the Opacus optimiser was set up with (None in a plain loop);
    ``set_up_noise_multiplier``: the claimed noise (the set-up one, or a plain loop's first
    step's); ``changes``: what differed from the set-up values, and when. With canary
    records: ``canary_records`` placed in the dataset, ``canary_draws``: how many of them the
    released steps' clipped sums held (``C`` each on the block), ``accounted_draws``: how
    many the rates the steps were accounted at give on average."""

    canaries: int
    steps: int
    sample_rate: float
    steps_per_epoch: int | None
    noise_multiplier: float | None
    max_grad_norm: float | None
    measured_noise_multiplier: float
    route: str = "plain loop"
    setup: OptimizerSetup | None = None
    set_up_noise_multiplier: float | None = None
    changes: tuple[Change, ...] = ()
    canary_records: int | None = None
    canary_draws: int | None = None
    accounted_draws: float | None = None

    @property
    def sampling(self) -> str:
        return "poisson" if self.steps_per_epoch is None else "shuffle"

    def to_json(self) -> dict[str, Any]:
        return {"canaries": self.canaries, "steps": self.steps, "sampling": self.sampling,
                "sample_rate": self.sample_rate, "steps_per_epoch": self.steps_per_epoch,
                "noise_multiplier": self.noise_multiplier, "max_grad_norm": self.max_grad_norm,
                "measured_noise_multiplier": self.measured_noise_multiplier,
                "route": self.route,
                "set_up": None if self.setup is None else self.setup.to_json(),
                "set_up_noise_multiplier": self.set_up_noise_multiplier,
                "changes": [c.to_json() for c in self.changes],
                "canary_records": self.canary_records, "canary_draws": self.canary_draws,
                "accounted_draws": self.accounted_draws}


def _releases(releases: np.ndarray) -> np.ndarray:
    arr = np.asarray(releases, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ConfigError(f"the releases must be a (steps, canaries) array with at least one "
                          f"step, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ConfigError("the released canary block holds NaN or infinite values: the "
                          "training diverged or the optimiser released no noisy sum")
    return arr


def measured_noise_multiplier(releases: np.ndarray) -> float:
    """The noise multiplier the releases show: the median absolute deviation of every
    released value about its median, over ``Phi^-1(3/4)`` (a consistent estimate of a
    Gaussian's scale, barely moved by the canaries' ones: at most ``q/2`` of the values on
    average). In units of ``C``, as the releases."""
    arr = _releases(releases)
    flat = arr.ravel()
    mad = float(np.median(np.abs(flat - np.median(flat))))
    return mad / _MAD_NORMAL


def measured_noise_by_step(releases: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """One noise multiplier per step: :func:`measured_noise_multiplier` of the steps that
    share the step's group (steps the optimiser ran with the same noise multiplier and
    clipping norm), so that a run whose noise changed is scored step by step at the noise
    each part actually had."""
    arr = _releases(releases)
    keys = np.asarray(groups)
    if keys.shape != (arr.shape[0],):
        raise ConfigError(f"one group per step needed: {arr.shape[0]} steps, got shape "
                          f"{keys.shape}")
    out = np.empty(arr.shape[0])
    for key in np.unique(keys):
        rows = keys == key
        out[rows] = measured_noise_multiplier(arr[rows])
    return out


def _scales(sigma: float | np.ndarray, steps: int) -> np.ndarray:
    """``sigma`` (one, or one per step) as a column of per-step variances."""
    values = np.broadcast_to(np.asarray(sigma, dtype=np.float64), (steps,))
    if not np.all(np.isfinite(values) & (values > 0.0)):
        raise ConfigError(f"the score needs noise multipliers > 0, got {sigma}")
    return (values ** 2)[:, None]


def poisson_scores(releases: np.ndarray, rates: np.ndarray | float,
                   sigma: float | np.ndarray) -> np.ndarray:
    """Per-canary log-likelihood ratio of a canary Poisson-sampled at ``rates`` (one per
    step, or one for all) under noise multiplier ``sigma`` (one per step, or one for all;
    module docstring)."""
    arr = _releases(releases)
    s2 = _scales(sigma, arr.shape[0])
    q = np.broadcast_to(np.asarray(rates, dtype=np.float64), (arr.shape[0],))
    if not np.all((q > 0.0) & (q <= 1.0)):
        raise ConfigError("every sample rate must lie in (0, 1]")
    gain = (arr - 0.5) / s2  # log N(1, s2) / N(0, s2) at u
    with np.errstate(divide="ignore"):
        stay = np.log1p(-q)[:, None]  # -inf where q = 1: the canary is then always there
    return np.logaddexp(stay, np.log(q)[:, None] + gain).sum(axis=0)


def shuffle_scores(releases: np.ndarray, steps_per_epoch: int,
                   sigma: float | np.ndarray) -> np.ndarray:
    """Per-canary log-likelihood ratio of a canary that enters exactly one uniformly chosen
    step of each epoch of ``steps_per_epoch`` steps, under noise multiplier ``sigma`` (one per
    step, or one for all; module docstring)."""
    arr = _releases(releases)
    k = int(steps_per_epoch)
    if k < 1:
        raise ConfigError(f"an epoch needs at least one step, got {steps_per_epoch}")
    gain = (arr - 0.5) / _scales(sigma, arr.shape[0])
    total = np.zeros(arr.shape[1])
    for start in range(0, arr.shape[0], k):
        part = gain[start:start + k]
        n = part.shape[0]
        terms = np.vstack([part, np.full((1, arr.shape[1]), math.log(k - n))]) if n < k \
            else part
        total += logsumexp(terms, axis=0) - math.log(k)
    return total


def summed_scores(releases: np.ndarray) -> np.ndarray:
    """Per-canary total of the released values (units of ``C``)."""
    return _releases(releases).sum(axis=0)
