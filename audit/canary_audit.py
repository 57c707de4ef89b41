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

White-box audits also carry the Gaussian-DP ESTIMATE of Nasr et al. (2023,
:mod:`~fedlap_privacy.audit.gdp_estimate`): shown beside the bounds, never a bound, in no
verdict.

Every score is tested by up to three methods on the same guesses:

* ``steinke``: the Steinke et al. ``(eps, delta)`` lower bound;
* ``fdp``: the f-DP bound of the Gaussian family (Mahloujifar, Melis, Chaudhuri, ICML 2025;
  :mod:`~fedlap_privacy.audit.fdp`); its verdict tests "the run is ``mu``-GDP at the
  claim's ``(eps, delta)``", a valid test of the claim only when the claimed mechanism is
  itself that private (``fdp_valid``: its curve, below, lies above that Gaussian curve);
* ``claim-curve`` (when the ledger's curve is given): the p-value of the counts under the
  claimed mechanism's own trade-off curve (:mod:`~fedlap_privacy.audit.claim_curve`).

Each test holds at level ``(1 - confidence) / (n t)`` for ``n`` scores and ``t`` tests, so
that the family holds at ``confidence``. A bound's verdict compares it with the epsilon the
ledger composes to (recomputed, never read from a stored number): ``violation`` (bound above
the claim), ``inconclusive`` (the claim is at or above the largest bound this audit could
reach, its ceiling) or ``consistent``; the claim-curve test's: ``violation`` when its
p-value is below its level. An audit's ``verdict`` is the strongest valid one (a violation
over a consistent over an inconclusive).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedlap_privacy.audit.canary_clients import CanaryClientEstimate, canary_client_epsilon
from fedlap_privacy.audit.claim_curve import ClaimCurve, ClaimCurveTest, claim_curve_test
from fedlap_privacy.audit.fdp import gaussian_inverse, gdp_mu
from fedlap_privacy.audit.gdp_estimate import GdpEstimate, gdp_estimate
from fedlap_privacy.audit.one_run import OneRunResult, one_run_audit, one_run_candidate_counts
from fedlap_privacy.canary_state import CanaryState
from fedlap_privacy.per_sample import per_sample_losses
from fedlap_privacy.vocabulary import CanaryKind

__all__ = ["CanaryAudit", "canary_scores", "fdp_covers_claim", "run_canary_audits"]


_RANK = {"violation": 2, "consistent": 1, "inconclusive": 0}


@dataclass(frozen=True)
class CanaryAudit:
    """One canary audit: its one-run results by method and verdicts against the claim.

    ``result``: Steinke's bound; ``fdp``: the Gaussian-family f-DP bound (None when delta is
    0); ``claim_test``: the claim-curve test (None without the ledger's curve);
    ``fdp_valid``: whether the f-DP verdict tests the claim (module docstring).
    """

    name: str
    result: OneRunResult
    claimed_epsilon: float | None
    scores_in: list[float]
    scores_out: list[float]
    estimate: CanaryClientEstimate | None = None
    fdp: OneRunResult | None = None
    claim_test: ClaimCurveTest | None = None
    fdp_valid: bool = False
    gdp_estimate: GdpEstimate | None = None

    def _bound_verdict(self, result: OneRunResult) -> str:
        if self.claimed_epsilon is None:
            return "inconclusive"
        return result.verdict(self.claimed_epsilon)

    def methods(self) -> dict[str, dict[str, Any]]:
        """Every method's result with its verdict and whether that verdict counts."""
        out = {"steinke": {**self.result.to_json(), "verdict": self._bound_verdict(self.result),
                           "valid": True}}
        if self.fdp is not None:
            out["fdp"] = {**self.fdp.to_json(), "verdict": self._bound_verdict(self.fdp),
                          "valid": self.fdp_valid}
        if self.claim_test is not None:
            out["claim-curve"] = {**self.claim_test.to_json(), "valid": True}
        return out

    @property
    def strongest(self) -> str:
        """The method whose valid verdict is strongest (ties: the larger bound, then
        Steinke's)."""
        valid = [(k, v) for k, v in self.methods().items() if v["valid"]]
        return max(valid, key=lambda kv: (_RANK[kv[1]["verdict"]],
                                          kv[1].get("epsilon_lower_bound", -1.0)))[0]

    @property
    def verdict(self) -> str:
        return self.methods()[self.strongest]["verdict"]

    @property
    def epsilon_lower_bound(self) -> float:
        """The largest valid ``(eps, delta)`` bound."""
        bounds = [v["epsilon_lower_bound"] for v in self.methods().values()
                  if v["valid"] and "epsilon_lower_bound" in v]
        return max(bounds)

    def to_json(self) -> dict[str, Any]:
        methods = self.methods()
        bound_method = max((k for k, v in methods.items()
                            if v["valid"] and "epsilon_lower_bound" in v),
                           key=lambda k: methods[k]["epsilon_lower_bound"])
        out = {"audit": self.name, **methods[bound_method], "method": bound_method,
               "verdict": self.verdict, "verdict_method": self.strongest,
               "claimed_epsilon": self.claimed_epsilon, "methods": methods}
        out.pop("valid", None)
        if self.estimate is not None:
            out["epsilon_estimate"] = self.estimate.to_json()
        if self.gdp_estimate is not None:
            out["gdp_estimate"] = self.gdp_estimate.to_json()
        return out


def fdp_covers_claim(curve: ClaimCurve, claimed_epsilon: float, delta: float) -> bool:
    """True when the claimed mechanism is ``mu``-GDP for the ``mu`` whose epsilon at
    ``delta`` is the claim: its ``fbar^-1`` is nowhere below the Gaussian one (checked at
    the curve's tabulated powers), so a rejection of that ``mu`` rejects the claim."""
    if not (math.isfinite(claimed_epsilon) and 0.0 < delta < 1.0):
        return False
    gaussian = gaussian_inverse(gdp_mu(claimed_epsilon, delta))
    return all(rate >= gaussian(r) - 1e-12
               for r, rate in zip(curve.powers, curve.rates, strict=True))


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
    if not scores:
        return []
    included = state.included.numpy().astype(bool)
    tests = 1 + (delta > 0.0) + (curve is not None)
    level = (1.0 - confidence) / (len(scores) * tests)
    fdp_valid = (curve is not None and claimed_epsilon is not None
                 and fdp_covers_claim(curve, claimed_epsilon, delta))
    audits = []
    for name, values in scores.items():
        result = one_run_audit(values, included, delta, confidence=1.0 - level)
        fdp = (one_run_audit(values, included, delta, confidence=1.0 - level, method="fdp")
               if delta > 0.0 else None)
        claim = None
        if curve is not None:
            counts = one_run_candidate_counts(values, included)
            claim = claim_curve_test(curve, len(values), counts, 1.0 - level)
        estimate = None
        if state.kind == CanaryKind.CLIENTS and state.dimension is not None:
            d = state.dimension
            if name == "clients/final":
                estimate = canary_client_epsilon(values[included], d, delta)
            else:
                estimate = canary_client_epsilon(values[included], d, delta, null="empirical",
                                                 unobserved_cosines=values[~included])
        gdp = (gdp_estimate(values[included], values[~included], delta)
               if state.kind == CanaryKind.WHITE_BOX else None)
        audits.append(CanaryAudit(
            name, result, claimed_epsilon, values[included].tolist(),
            values[~included].tolist(), estimate, fdp, claim, fdp_valid, gdp,
        ))
    return audits
