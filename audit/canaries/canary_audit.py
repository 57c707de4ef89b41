"""Canary audits of a trained run: one-run lower bounds and verdicts against the ledger.

Reads the canaries a run inserted (:class:`fedlap_privacy.state.canary_state.CanaryState`, from its
private state), scores each canary, and runs
:func:`~fedlap_privacy.audit.bounds.one_run.one_run_audit`
(Steinke, Nasr, Jagielski, NeurIPS 2023) on the scores and the secret coins:

* ``white-box``: the score recorded during training (sum of the released noisy sums on the
  canary's coordinate, units of C) — audits every DP step as it ran;
* ``black-box``: minus the canary record's loss under the final model (and, when reference
  models are given, their RMIA / LiRA scores from
  :mod:`~fedlap_privacy.audit.inference.reference_attacks`);
* ``clients``: the cosine of each canary client's direction with the model's total change
  (the final-model statistic), and its maximum over the rounds (all iterates); besides the
  one-run bound, the Andrew et al. (ICLR 2024) epsilon ESTIMATE (not a bound).

White-box audits also carry the Gaussian-DP ESTIMATE of Nasr et al. (2023,
:mod:`~fedlap_privacy.audit.bounds.gdp_estimate`): shown beside the bounds, never a bound, in no
verdict.

The scores become verdicts in :mod:`~fedlap_privacy.audit.bounds.canary_verdicts` (Steinke's bound,
the f-DP bound, the claimed mechanism's own curve, each at its Bonferroni share of the
confidence), shared with the audits of scores from any framework
(:mod:`~fedlap_privacy.audit.canaries.score_audit`). A bound's verdict compares it with the epsilon
the ledger composes to (recomputed, never read from a stored number).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn

from fedlap_privacy.audit.bounds.canary_verdicts import CanaryAudit, audit_scores, fdp_covers_claim
from fedlap_privacy.audit.bounds.claim_curve import ClaimCurve
from fedlap_privacy.audit.bounds.gdp_estimate import gdp_estimate
from fedlap_privacy.audit.canaries.canary_clients import CanaryClientEstimate, canary_client_epsilon
from fedlap_privacy.compute.per_sample import per_sample_losses
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.state.canary_state import CanaryState
from fedlap_privacy.vocabulary import CanaryKind

__all__ = ["CanaryAudit", "canary_scores", "fdp_covers_claim", "run_canary_audits"]


def canary_scores(state: CanaryState, model: nn.Module | None) -> dict[str, np.ndarray]:
    """Every score the canaries of ``state`` have, by audit name (higher = more likely in)."""
    if state.kind == CanaryKind.WHITE_BOX:
        assert state.scores is not None
        return {CanaryKind.WHITE_BOX.value: state.scores.double().numpy()}
    if state.kind == CanaryKind.BLACK_BOX:
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
    curve: ClaimCurve | None = None,
) -> list[CanaryAudit]:
    """One :class:`CanaryAudit` per score of the run's canaries (module docstring);
    ``curve``: the claimed mechanism's trade-off curve for the canaries' unit (a record for
    record-level claims, a client for client-level ones), when known."""
    scores = {**canary_scores(state, model), **(extra_scores or {})}
    audits = audit_scores(scores, state.included.numpy(), claimed_epsilon, delta, confidence,
                          curve)
    included = state.included.numpy().astype(bool)
    out = []
    for audit in audits:
        values = np.asarray(scores[audit.name], dtype=np.float64)
        extra: dict[str, Any] = {}
        if state.kind == CanaryKind.CLIENTS and state.dimension is not None:
            extra = _client_estimate(audit.name, values, included, state.dimension, delta)
        if state.kind == CanaryKind.WHITE_BOX:
            extra["gdp_estimate"] = gdp_estimate(values[included], values[~included], delta)
        out.append(dataclasses.replace(audit, **extra))
    return out


def _client_estimate(name: str, values: np.ndarray, included: np.ndarray, d: int,
                     delta: float) -> dict[str, CanaryClientEstimate | str | None]:
    """The Andrew et al. epsilon ESTIMATE of canary clients' cosines (``clients/final``: the
    closed-form null; ``clients/all-iterates``: a Gaussian fitted to the unobserved
    canaries), or the reason it cannot be formed (too few canaries on a side, all equal):
    an estimate is no bound, so the bounds still run without it."""
    try:
        if name == "clients/final":
            estimate = canary_client_epsilon(values[included], d, delta)
        else:
            estimate = canary_client_epsilon(values[included], d, delta, null="empirical",
                                             unobserved_cosines=values[~included])
    except ConfigError as exc:
        return {"estimate": None, "estimate_skipped": str(exc)}
    return {"estimate": estimate}
