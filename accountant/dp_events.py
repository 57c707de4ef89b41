"""FedLAP-DP's composition (paper Theorem 5.8) as a dp-accounting ``DpEvent``.

Contract (:mod:`fedlap_privacy.accountant.schedule`): each round of a schedule is one
Poisson-sampled Gaussian at ``q1`` followed by ``local_steps - 1`` at ``q2``, all with noise
multiplier ``sigma`` (add/remove-one neighbours). Composition is commutative, so ``M`` rounds
are exported as equal-rate steps grouped together::

    ComposedDpEvent([
        SelfComposedDpEvent(PoissonSampledDpEvent(q1, GaussianDpEvent(sigma)), M),
        SelfComposedDpEvent(PoissonSampledDpEvent(q2, GaussianDpEvent(sigma)), M * (T - 1)),
    ])

(one entry when ``q1 == q2``; for rounds with different schedules, one entry per distinct
rate, in order of first appearance). Any dp-accounting accountant composes it:

>>> from dp_accounting.rdp import RdpAccountant
>>> from fedlap_privacy.accountant import DEFAULT_ORDERS, FedLAPSchedule
>>> s = FedLAPSchedule(batch_size=256, client_size=10000, local_steps=200)
>>> acc = RdpAccountant(orders=list(DEFAULT_ORDERS)).compose(schedule_event(s, 1.0, 15))
>>> round(float(acc.get_epsilon(1e-5)), 2)
10.18

dp-accounting's RDP of the sampled Gaussian is exact at integer orders and an upper bound at
fractional ones, so its epsilon is never below :func:`~fedlap_privacy.accountant.epsilon`.
This module imports dp-accounting (pure Python, about a second to import), so
``fedlap_privacy.accountant`` leaves it out: import it as
``fedlap_privacy.accountant.dp_events``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import dp_accounting
import numpy as np

from fedlap_privacy.accountant.client_level import ClientSampling
from fedlap_privacy.accountant.schedule import RoundSchedule, step_counts
from fedlap_privacy.errors import ConfigError

__all__ = [
    "RoundSchedule", "client_level_event", "composed_event", "schedule_event", "step_counts",
]


def _event(counts: dict[float, int], sigma: float) -> dp_accounting.ComposedDpEvent:
    if not (math.isfinite(sigma) and sigma > 0):
        raise ConfigError(f"sigma {sigma!r} must be a positive number")
    gaussian = dp_accounting.GaussianDpEvent(float(sigma))
    return dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, gaussian), n)
        for q, n in counts.items()
    ])


def schedule_event(
    schedule: RoundSchedule, sigma: float, rounds: int = 1
) -> dp_accounting.ComposedDpEvent:
    """``rounds`` rounds of ``schedule`` at noise multiplier ``sigma`` as one ``DpEvent``.

    The event an accountant composes gives the epsilon of
    ``epsilon(schedule, sigma, rounds, delta)`` (Theorem 5.8).
    """
    if not (isinstance(rounds, int | np.integer) and rounds >= 1):
        raise ConfigError(f"rounds {rounds!r} must be a positive integer")
    return _event(step_counts([(schedule, int(rounds))]), sigma)


def composed_event(
    schedules: Sequence[RoundSchedule], sigma: float
) -> dp_accounting.ComposedDpEvent:
    """Rounds that differ in their schedule (one entry per round, e.g. per-round ``T``) as one
    ``DpEvent``: the counterpart of
    :func:`~fedlap_privacy.accountant.composed_epsilon`. An empty list is an empty
    composition (epsilon 0)."""
    return _event(step_counts((schedule, 1) for schedule in schedules), sigma)


def client_level_event(
    sampling: ClientSampling, sigma: float, rounds: int = 1
) -> dp_accounting.ComposedDpEvent:
    """``rounds`` rounds of client-level DP-FedAvg at noise multiplier ``sigma`` as the
    event its ledger prices (:mod:`fedlap_privacy.accountant.client_level`): a Poisson
    sampled Gaussian at ``sampling.q`` with multiplier ``sampling.accounted_sigma(sigma)``
    per round (for fixed-size cohorts, the add/remove bound at rate K/n and sensitivity 2C;
    dp-accounting's ``SampledWithoutReplacementDpEvent`` is a replace-one analysis)."""
    return schedule_event(sampling.schedule(), sampling.accounted_sigma(sigma), rounds)
