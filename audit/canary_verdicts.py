"""Canary scores to verdicts: the one place where the one-run tests share their level.

Every canary audit of this package (a run's own canaries, :mod:`.canary_audit`; scores
handed over from any framework, :mod:`.score_audit`) ends here: a score per canary (higher
= more likely included), the secret inclusion bits, and the claim. Each score is tested by up
to three methods on the same guesses:

* ``steinke``: the Steinke, Nasr, Jagielski (NeurIPS 2023) ``(eps, delta)`` lower bound
  (:mod:`.one_run`);
* ``fdp``: the f-DP bound of the Gaussian family (Mahloujifar, Melis, Chaudhuri, ICML 2025;
  :mod:`.fdp`); its verdict tests "the run is ``mu``-GDP at the claim's ``(eps, delta)``", a
  valid test of the claim only when the claimed mechanism is itself that private
  (``fdp_valid``: its curve lies above that Gaussian curve, :func:`fdp_covers_claim`);
* ``claim-curve`` (when the claimed mechanism's curve is given): the p-value of the counts
  under that mechanism's own trade-off curve (:mod:`.claim_curve`).

Bonferroni: each test holds at level ``(1 - confidence) / (n t)`` for ``n`` scores and ``t``
tests (:func:`bonferroni_factor`), so that the family holds at ``confidence``. A bound's
verdict compares it with the claimed epsilon: ``violation`` (bound above the claim),
``inconclusive`` (the claim is at or above the largest bound this audit could reach, its
ceiling) or ``consistent``; the claim-curve test's: ``violation`` when its p-value is below
its level. An audit's ``verdict`` is the strongest valid one (a violation over a consistent
over an inconclusive). Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlap_privacy.audit.canary_clients import CanaryClientEstimate
from fedlap_privacy.audit.claim_curve import ClaimCurve, ClaimCurveTest, claim_curve_test
from fedlap_privacy.audit.fdp import gaussian_inverse, gdp_mu
from fedlap_privacy.audit.gdp_estimate import GdpEstimate
from fedlap_privacy.audit.one_run import OneRunResult, one_run_audit, one_run_candidate_counts

__all__ = ["VERDICT_RANK", "CanaryAudit", "audit_scores", "bonferroni_factor",
           "fdp_covers_claim", "strongest_audit"]

#: verdicts from the strongest to the weakest evidence against a claim
VERDICT_RANK = {"violation": 2, "consistent": 1, "inconclusive": 0}


@dataclass(frozen=True)
class CanaryAudit:
    """One canary audit: its one-run results by method and verdicts against the claim.

    ``result``: Steinke's bound; ``fdp``: the Gaussian-family f-DP bound (None when delta is
    0); ``claim_test``: the claim-curve test (None without the claimed mechanism's curve);
    ``fdp_valid``: whether the f-DP verdict tests the claim (module docstring).
    ``estimate`` / ``gdp_estimate``: epsilon ESTIMATES shown beside the bounds, in no verdict.
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
    estimate_skipped: str | None = None

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
        return max(valid, key=lambda kv: (VERDICT_RANK[kv[1]["verdict"]],
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
        if self.estimate_skipped is not None:
            out["epsilon_estimate_skipped"] = self.estimate_skipped
        if self.gdp_estimate is not None:
            out["gdp_estimate"] = self.gdp_estimate.to_json()
        return out


def strongest_audit(audits: list[CanaryAudit]) -> CanaryAudit:
    """The audit with the strongest verdict (ties: the largest valid bound)."""
    return max(audits, key=lambda a: (VERDICT_RANK[a.verdict], a.epsilon_lower_bound))


def fdp_covers_claim(curve: ClaimCurve, claimed_epsilon: float, delta: float) -> bool:
    """True when the claimed mechanism is ``mu``-GDP for the ``mu`` whose epsilon at
    ``delta`` is the claim: its ``fbar^-1`` is nowhere below the Gaussian one (checked at
    the curve's tabulated powers), so a rejection of that ``mu`` rejects the claim."""
    if not (math.isfinite(claimed_epsilon) and 0.0 < delta < 1.0):
        return False
    gaussian = gaussian_inverse(gdp_mu(claimed_epsilon, delta))
    return all(rate >= gaussian(r) - 1e-12
               for r, rate in zip(curve.powers, curve.rates, strict=True))


def bonferroni_factor(scores: int, delta: float, claim_curve: bool) -> int:
    """``n t``: the number of tests that share ``1 - confidence`` (``n`` scores, ``t``
    methods: Steinke's always, the f-DP bound when ``delta > 0``, the claim curve when
    given)."""
    return scores * (1 + (delta > 0.0) + claim_curve)


def audit_scores(
    scores: Mapping[str, np.ndarray],
    included: np.ndarray,
    claimed_epsilon: float | None,
    delta: float,
    confidence: float = 0.95,
    curve: ClaimCurve | None = None,
) -> list[CanaryAudit]:
    """One :class:`CanaryAudit` per score of ``scores`` (name -> one float per canary, higher
    = more likely in), each method at its Bonferroni share of ``1 - confidence`` (module
    docstring). ``curve``: the claimed mechanism's trade-off curve for the canaries' unit,
    when known. The inputs are checked by :func:`~.one_run.one_run_audit`."""
    if not scores:
        return []
    included = np.asarray(included).astype(bool)
    level = (1.0 - confidence) / bonferroni_factor(len(scores), delta, curve is not None)
    fdp_valid = (curve is not None and claimed_epsilon is not None
                 and fdp_covers_claim(curve, claimed_epsilon, delta))
    audits = []
    for name, raw in scores.items():
        values = np.asarray(raw, dtype=np.float64)
        result = one_run_audit(values, included, delta, confidence=1.0 - level)
        fdp = (one_run_audit(values, included, delta, confidence=1.0 - level, method="fdp")
               if delta > 0.0 else None)
        claim = None
        if curve is not None:
            counts = one_run_candidate_counts(values, included)
            claim = claim_curve_test(curve, len(values), counts, 1.0 - level)
        audits.append(CanaryAudit(
            name, result, claimed_epsilon, values[included].tolist(),
            values[~included].tolist(), fdp=fdp, claim_test=claim, fdp_valid=fdp_valid,
        ))
    return audits
