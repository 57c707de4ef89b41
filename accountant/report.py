"""One privacy plan as plain data: what ``fedlap-privacy plan`` computes and prints.

Dispatches on which of (target epsilon, sigma, rounds) are given (docs/accounting.md#planning):
sigma + rounds -> the epsilon curve (and whether a target holds); eps + sigma -> plan the
rounds; eps + rounds -> plan sigma; eps alone -> plan sigma for ``DEFAULT_ROUNDS``; neither
eps nor sigma -> the authors' sigma = 1.

Threat model: ``hidden-selection`` (default here) is Theorem 5.8 as published — the first
access of a round at ``q1 = C B / N``, amplified by client sampling, which holds only
against adversaries who do not know which clients were selected. ``server`` accounts against
the server, which does know: every access at ``q2``, and a client may be selected in every
round (the plan is then the worst case over clients). With client fraction 1 they agree.

The plan is made with one accountant (default RDP: Theorem 5.8 as published, which reproduces
the paper); ``epsilon_by_accountant`` gives the final epsilon of the same sigma and rounds by
every accountant, the plan's first (None where one cannot price it, e.g. PLD beyond its
memory budget), so the tighter PLD figure is printed beside RDP's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlap_privacy.accountant.accountants import AccountantName
from fedlap_privacy.accountant.planning import (
    Orders,
    _check,
    check_curve_rounds,
    curve_rounds_limit,
    epsilon,
    epsilon_curve,
    plan_rounds,
    plan_sigma,
    rdp_epsilon,
)
from fedlap_privacy.accountant.registry import accountant_names
from fedlap_privacy.accountant.schedule import FedLAPSchedule
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.vocabulary import (
    LARGE_EPSILON,
    NOTION_THREAT_MODELS,
    SMALL_CLIENT_RATE,
    Notion,
    ThreatModel,
)

__all__ = ["DEFAULT_ROUNDS", "DEFAULT_SIGMA", "PLAN_THREAT_MODELS", "PrivacyPlan",
           "large_epsilon_reason", "privacy_plan"]

#: the record-level threat models, Theorem 5.8 as published (``hidden-selection``) first: the
#: plan's default
PLAN_THREAT_MODELS = tuple(sorted(NOTION_THREAT_MODELS[Notion.RECORD],
                                  key=lambda t: t != ThreatModel.HIDDEN_SELECTION))

DEFAULT_ROUNDS = 30  # the authors' DP configuration
DEFAULT_SIGMA = 1.0


def large_epsilon_reason(epsilon: float, rounds: int, steps: int, rate: float, sigma: float,
                         batch: str) -> str | None:
    """Why a record-level epsilon above :data:`LARGE_EPSILON` is that large (None when it is
    not): a per-access rate of at least :data:`SMALL_CLIENT_RATE` (``batch``: how the batch
    is drawn, in words) that batch sampling barely hides, else the number of noisy accesses
    composed. ``plan`` and ``train`` both print it, each with the flags that lower it."""
    if not rounds or not epsilon > LARGE_EPSILON:
        return None
    if rate >= SMALL_CLIENT_RATE:
        return (f"few records per client for the batch: each record is in {batch} with "
                f"probability q2 = {rate:.2g} at each of T = {steps} accesses a round, so batch "
                "sampling hides it little")
    return (f"{rounds} rounds of T = {steps} accesses compose {rounds * steps:,} noisy steps "
            f"at sigma {sigma:.3g}")


@dataclass(frozen=True)
class PrivacyPlan:
    """Every number of one plan (:func:`privacy_plan`); ``to_json`` is ``plan --json``."""

    mode: str  # epsilon | plan-rounds | plan-sigma
    accountant: str
    epsilon: float
    epsilon_by_accountant: dict[str, float | None]
    target_epsilon: float | None
    within_budget: bool | None
    delta: float
    sigma: float
    rounds: int
    q1: float
    q2: float
    local_steps: int
    batch_size: float
    client_size: int
    client_fraction: float
    threat_model: str
    order: float | None
    curve: list[float]

    def large_epsilon_reason(self) -> str | None:
        """:func:`large_epsilon_reason` for this plan."""
        return large_epsilon_reason(
            self.epsilon, self.rounds, self.local_steps, self.q2, self.sigma,
            f"a batch (B {self.batch_size:g} of N_k {self.client_size:,})")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def privacy_plan(
    schedule: FedLAPSchedule,
    delta: float,
    *,
    eps: float | None = None,
    sigma: float | None = None,
    rounds: int | None = None,
    accountant: str = AccountantName.RDP,
    orders: Orders = None,
    threat_model: str = ThreatModel.HIDDEN_SELECTION,
) -> PrivacyPlan:
    """Solve for the missing quantity and return every number of the plan.

    Refuses, before computing anything, rounds (given, or planned for ``eps``) above the
    curve's memory and time bound (:func:`~fedlap_privacy.accountant.planning.
    curve_rounds_limit`).
    """
    _check(eps=eps, sigma=sigma, rounds=rounds, delta=delta, accountant=accountant)
    if rounds is not None:
        check_curve_rounds(rounds, accountant, orders)
    if threat_model not in PLAN_THREAT_MODELS:
        raise ConfigError(f"threat model {threat_model!r} must be one of "
                          f"{', '.join(PLAN_THREAT_MODELS)}")
    threat_model = ThreatModel(threat_model).value
    fraction = schedule.client_fraction
    if threat_model == ThreatModel.SERVER:
        schedule = dataclasses.replace(schedule, client_fraction=1.0)
    if eps is not None and sigma is not None and rounds is None:
        mode = "plan-rounds"
        rounds = plan_rounds(schedule, sigma, eps, delta, accountant, orders,
                             limit=curve_rounds_limit(accountant, orders))
    elif eps is not None and sigma is None:
        mode = "plan-sigma"
        rounds = DEFAULT_ROUNDS if rounds is None else rounds
        sigma = plan_sigma(schedule, rounds, eps, delta, accountant, orders)
    else:
        mode = "epsilon"
        sigma = DEFAULT_SIGMA if sigma is None else sigma
        rounds = DEFAULT_ROUNDS if rounds is None else rounds
    curve = (
        epsilon_curve(schedule, sigma, rounds, delta, accountant, orders)
        if rounds > 0
        else np.zeros(0)
    )
    order = (
        rdp_epsilon(schedule, sigma, rounds, delta, orders)[1]
        if accountant == AccountantName.RDP and rounds > 0
        else None
    )
    final = float(curve[-1]) if rounds > 0 else 0.0
    return PrivacyPlan(
        mode=mode, accountant=accountant, epsilon=final,
        epsilon_by_accountant=_by_accountant(schedule, sigma, rounds, delta, accountant,
                                             final, orders),
        target_epsilon=eps,
        within_budget=None if eps is None else bool(rounds > 0 and final <= eps),
        delta=delta, sigma=sigma, rounds=rounds, q1=schedule.q1, q2=schedule.q2,
        local_steps=schedule.local_steps, batch_size=schedule.batch_size,
        client_size=schedule.client_size, client_fraction=fraction,
        threat_model=threat_model, order=order, curve=[float(e) for e in curve],
    )


def _by_accountant(schedule: FedLAPSchedule, sigma: float, rounds: int, delta: float,
                   accountant: str, final: float, orders: Orders) -> dict[str, float | None]:
    """The plan's final epsilon by every accountant, the plan's own first (None: one that
    cannot price this configuration; it said why in a ConfigError)."""
    out: dict[str, float | None] = {accountant: final}
    for other in accountant_names():
        if other == accountant:
            continue
        try:
            out[other] = epsilon(schedule, sigma, rounds, delta, other, orders) if rounds else 0.0
        except ConfigError:
            out[other] = None
    return out
