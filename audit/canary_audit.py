"""Canary audits of a trained run: one-run lower bounds and verdicts against the ledger.

Reads the canaries a run inserted (:class:`fedlap_privacy.canary_state.CanaryState`, from its
private state), scores each canary, and runs :func:`~fedlap_privacy.audit.one_run.one_run_audit`
(Steinke, Nasr, Jagielski, NeurIPS 2023) on the scores and the secret coins:

* ``white-box``: the score recorded during training (sum of the released noisy sums on the
  canary's coordinate, units of C) — audits every DP step as it ran;
* ``black-box``: minus the canary record's loss under the final model (and, when reference
  models are given, their RMIA / LiRA scores from
  :mod:`~fedlap_privacy.audit.reference_attacks`);
* ``clients``: the cosine of each canary client's direction with the model's total change
  (the final-model statistic), and its maximum over the rounds (all iterates); besides the
  one-run bound, the Andrew et al. (ICLR 2024) epsilon ESTIMATE (not a bound).

Each audit's bound holds with probability ``1 - (1 - confidence) / n`` for ``n`` audits of
the run, so that the family holds at ``confidence``. The verdict compares the bound with the
epsilon the ledger composes to (recomputed, never read from a stored number): ``violation``
(bound above the claim), ``inconclusive`` (the claim is at or above the largest bound this
audit could reach, its ceiling) or ``consistent``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedlap_privacy.audit.canary_clients import CanaryClientEstimate, canary_client_epsilon
from fedlap_privacy.audit.one_run import OneRunResult, one_run_audit
from fedlap_privacy.canary_state import CanaryState
from fedlap_privacy.per_sample import per_sample_losses

__all__ = ["CanaryAudit", "canary_scores", "run_canary_audits"]


@dataclass(frozen=True)
class CanaryAudit:
    """One canary audit: its one-run result and verdict against the claimed epsilon."""

    name: str
    result: OneRunResult
    claimed_epsilon: float | None
    scores_in: list[float]
    scores_out: list[float]
    estimate: CanaryClientEstimate | None = None

    @property
    def verdict(self) -> str:
        if self.claimed_epsilon is None:
            return "inconclusive"
        return self.result.verdict(self.claimed_epsilon)

    def to_json(self) -> dict[str, Any]:
        out = {"audit": self.name, **self.result.to_json(), "verdict": self.verdict,
               "claimed_epsilon": self.claimed_epsilon}
        if self.estimate is not None:
            out["epsilon_estimate"] = self.estimate.to_json()
        return out


def canary_scores(state: CanaryState, model: nn.Module | None) -> dict[str, np.ndarray]:
    """Every score the canaries of ``state`` have, by audit name (higher = more likely in)."""
    if state.kind == "white-box":
        assert state.scores is not None
        return {"white-box": state.scores.double().numpy()}
    if state.kind == "black-box":
        assert state.images is not None and state.labels is not None and model is not None
        model.eval()
        losses = per_sample_losses(model, state.images.float(), state.labels.long())
        return {"black-box/loss": -losses.double().cpu().numpy()}
    if state.total_delta is None or not state.cosines:
        return {}
    final = state.cosines_with(state.total_delta)
    every = torch.stack([c.double() for c in state.cosines]).max(0).values
    return {"clients/final": final.numpy(), "clients/all-iterates": every.numpy()}


def run_canary_audits(
    state: CanaryState,
    model: nn.Module | None,
    claimed_epsilon: float | None,
    delta: float,
    confidence: float = 0.95,
    extra_scores: dict[str, np.ndarray] | None = None,
) -> list[CanaryAudit]:
    """One :class:`CanaryAudit` per score of the run's canaries (module docstring)."""
    scores = {**canary_scores(state, model), **(extra_scores or {})}
    if not scores:
        return []
    included = state.included.numpy().astype(bool)
    level = (1.0 - confidence) / len(scores)
    audits = []
    for name, values in scores.items():
        result = one_run_audit(values, included, delta, confidence=1.0 - level)
        estimate = None
        if state.kind == "clients" and state.dimension is not None:
            d = state.dimension
            if name == "clients/final":
                estimate = canary_client_epsilon(values[included], d, delta)
            else:
                estimate = canary_client_epsilon(values[included], d, delta, null="empirical",
                                                 unobserved_cosines=values[~included])
        audits.append(CanaryAudit(
            name, result, claimed_epsilon, values[included].tolist(),
            values[~included].tolist(), estimate,
        ))
    return audits
