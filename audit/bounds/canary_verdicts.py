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
  under that mechanism's own trade-off curve (:mod:`.claim_curve`);
* ``noise`` (when the releases themselves are at hand, gradient canaries): whether they carry
  the claimed noise at all (:mod:`.noise_check`; it can only reject).

Ties among the scores are broken by the operating system's randomness, once per score, and
every method reads the same guesses (:func:`~.one_run.one_run_order`). Coins whose count is
one fair coins almost never give are refused (:func:`~.one_run.check_coins`).

Bonferroni: each test holds at level ``(1 - confidence) / (n t)`` for ``n`` scores and ``t``
tests per score, plus one for the noise test (:func:`bonferroni_factor`), so that the family
holds at ``confidence``. One rule decides every verdict:

* a test ``violation``: its p-value is below its level (for a bound: the bound exceeds the
  claim, the same event);
* a test ``consistent``: no violation, and before the scores were read it could have given
  one: with the coins actually drawn (``k`` included of ``m``) and the guesses it makes, a
  perfect score would have given a p-value below its level (for a bound: the claim is below
  its ceiling); ``inconclusive`` otherwise;
* the audit's verdict: ``violation`` when any counted test rejects; else ``consistent`` when
  some counted test could have rejected; else ``inconclusive`` (the largest claim it could
  have refuted is then its ceiling). A test that cannot decide (the noise test, an f-DP
  bound whose Gaussian curve does not cover the claim) never makes an audit consistent.

Torch-free.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from fedlap_privacy.audit.bounds.claim_curve import ClaimCurve, ClaimCurveTest, claim_curve_test
from fedlap_privacy.audit.bounds.fdp import gaussian_inverse, gdp_mu
from fedlap_privacy.audit.bounds.gdp_estimate import GdpEstimate
from fedlap_privacy.audit.bounds.noise_check import NoiseSample, NoiseTest
from fedlap_privacy.audit.bounds.one_run import (
    OneRunResult,
    check_coins,
    one_run_audit,
    one_run_candidate_counts,
    one_run_order,
    steinke_p_value,
)
from fedlap_privacy.audit.canaries.canary_clients import CanaryClientEstimate
from fedlap_privacy.errors import ConfigError

__all__ = ["VERDICT_RANK", "CanaryAudit", "audit_once", "audit_scores", "bonferroni_factor",
           "fdp_covers_claim", "strongest_audit"]

T = TypeVar("T")
#: the claim each set of canaries (a GradientCanaries, RecordCanaries, ...) was audited against
_CLAIMS: weakref.WeakKeyDictionary[Any, tuple[float, float]] = weakref.WeakKeyDictionary()

#: verdicts from the strongest to the weakest evidence against a claim
VERDICT_RANK = {"violation": 2, "consistent": 1, "inconclusive": 0}


@dataclass(frozen=True)
class CanaryAudit:
    """One canary audit: its one-run results by method and verdicts against the claim.

    ``result``: Steinke's bound; ``fdp``: the Gaussian-family f-DP bound (None when delta is
    0); ``claim_test``: the claim-curve test (None without the claimed mechanism's curve);
    ``fdp_valid``: whether the f-DP verdict tests the claim (module docstring);
    ``noise``: the noise test of the releases (None without them); ``level``: each test's
    share of the family's level; ``p_value``: Steinke's p-value at the claim (Bonferroni
    over its candidates; None without a claim).
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
    noise: NoiseTest | None = None
    level: float | None = None
    p_value: float | None = None

    def _bound_verdict(self, result: OneRunResult) -> str:
        if self.claimed_epsilon is None:
            return "inconclusive"
        return result.verdict(self.claimed_epsilon)

    def methods(self) -> dict[str, dict[str, Any]]:
        """Every method's result with its verdict and whether that verdict counts."""
        share = {"level": self.level}
        out = {"steinke": {**self.result.to_json(), "verdict": self._bound_verdict(self.result),
                           "valid": True, "p_value": self.p_value, **share}}
        if self.fdp is not None:
            out["fdp"] = {**self.fdp.to_json(), "verdict": self._bound_verdict(self.fdp),
                          "valid": self.fdp_valid, **share}
        if self.claim_test is not None:
            out["claim-curve"] = {**self.claim_test.to_json(), "valid": True, **share}
        if self.noise is not None:
            out["noise"] = {**self.noise.to_json(), "valid": True}
        return out

    @property
    def strongest(self) -> str:
        """The method that decides the verdict (module docstring): a counted violation, else
        a counted consistent, else Steinke's (ties: the larger bound, then the first)."""
        valid = [(k, v) for k, v in self.methods().items() if v["valid"]]
        return max(valid, key=lambda kv: (VERDICT_RANK[kv[1]["verdict"]],
                                          kv[1].get("epsilon_lower_bound", -1.0),
                                          kv[0] == "steinke"))[0]

    @property
    def verdict(self) -> str:
        return self.methods()[self.strongest]["verdict"]

    @property
    def epsilon_lower_bound(self) -> float:
        """The largest valid ``(eps, delta)`` bound."""
        bounds = [v["epsilon_lower_bound"] for v in self.methods().values()
                  if v["valid"] and "epsilon_lower_bound" in v]
        return max(bounds)

    @property
    def largest_refutable_claim(self) -> float:
        """The largest epsilon this audit could have refuted with the coins drawn: the
        largest ceiling of a counted bound."""
        return max(v["ceiling"] for v in self.methods().values()
                   if v["valid"] and "ceiling" in v)

    @property
    def reason(self) -> str:
        """The verdict in words, with the p-value (or bound) and the level that decided it
        (each test's own share of the family's level, as it was compared)."""
        name = self.strongest
        m = self.methods()[name]
        level, claim = _num(m.get("level")), _num(self.claimed_epsilon)
        verdict = self.verdict
        if verdict == "inconclusive":
            return (f"no test could have refuted the claim {claim}: with the coins drawn "
                    f"({self.result.included} of {self.result.canaries} canaries included) "
                    f"the largest claim this audit could refute is epsilon "
                    f"{_num(self.largest_refutable_claim)}")
        if name == "noise":
            return (f"the releases carry less than {_num(m['tested_noise_multiplier'])} noise "
                    f"(measured {_num(m['measured_noise_multiplier'])}, claimed "
                    f"{_num(m['claimed_noise_multiplier'])}): p-value {_num(m['p_value'])}, "
                    f"below its level {_num(m['level'])}")
        if name == "claim-curve":
            if verdict == "violation":
                return (f"under the claimed mechanism's curve the guesses have p-value "
                        f"{_num(m['p_value'])}, below its level {level}")
            return (f"under the claimed mechanism's curve the guesses have p-value "
                    f"{_num(m['p_value'])}, not below its level {level}; a perfect score "
                    f"would have given {_num(m['floor'])}")
        label = "Steinke's" if name == "steinke" else "the f-DP"
        p = "" if m.get("p_value") is None else f" (p-value {_num(m['p_value'])} at the claim)"
        if verdict == "violation":
            return (f"{label} bound {_num(m['epsilon_lower_bound'])} at level {level} exceeds "
                    f"the claim {claim}{p}")
        return (f"{label} bound {_num(m['epsilon_lower_bound'])} at level {level} does not "
                f"exceed the claim {claim}{p}; a perfect score would have reached "
                f"{_num(m['ceiling'])}")

    def to_json(self) -> dict[str, Any]:
        methods = self.methods()
        bound_method = max((k for k, v in methods.items()
                            if v["valid"] and "epsilon_lower_bound" in v),
                           key=lambda k: methods[k]["epsilon_lower_bound"])
        out = {"audit": self.name, **methods[bound_method], "method": bound_method,
               "verdict": self.verdict, "verdict_method": self.strongest,
               "reason": self.reason, "largest_refutable_claim": self.largest_refutable_claim,
               "claimed_epsilon": self.claimed_epsilon, "methods": methods}
        out.pop("valid", None)
        if self.estimate is not None:
            out["epsilon_estimate"] = self.estimate.to_json()
        if self.estimate_skipped is not None:
            out["epsilon_estimate_skipped"] = self.estimate_skipped
        if self.gdp_estimate is not None:
            out["gdp_estimate"] = self.gdp_estimate.to_json()
        return out


def _num(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):.4g}"


def strongest_audit(audits: list[CanaryAudit]) -> CanaryAudit:
    """The audit that decides the family's verdict, by the rule of the module docstring
    (ties: the largest valid bound). Every caller ranks audits here."""
    return max(audits, key=lambda a: (VERDICT_RANK[a.verdict], a.epsilon_lower_bound))


def audit_once(canaries: Any, claimed_epsilon: float, delta: float, run: Callable[[], T]) -> T:
    """``run()``, the audit of ``canaries`` against ``(claimed_epsilon, delta)``, unless these
    canaries were already audited against another claim (a one-line ConfigError then): each
    further claim tested on the same coins would be one more test at the full level, and
    trying claims until one verdict suits is how a reader of a report gets misled. The same
    claim may be audited again (a report rewritten, another description of the mechanism);
    a claim is recorded once its audit has run."""
    claim = (float(claimed_epsilon), float(delta))
    first = _CLAIMS.get(canaries)
    if first is not None and first != claim:
        raise ConfigError(
            f"these canaries were already audited against epsilon {first[0]:g} at delta "
            f"{first[1]:g}: one claim per set of canaries (audit another claim with new "
            "canaries and a new training run)")
    result = run()
    _CLAIMS[canaries] = claim
    return result


def fdp_covers_claim(curve: ClaimCurve, claimed_epsilon: float, delta: float) -> bool:
    """True when the claimed mechanism is ``mu``-GDP for the ``mu`` whose epsilon at
    ``delta`` is the claim: its ``fbar^-1`` is nowhere below the Gaussian one (checked at
    the curve's tabulated powers), so a rejection of that ``mu`` rejects the claim."""
    if not (math.isfinite(claimed_epsilon) and 0.0 < delta < 1.0):
        return False
    gaussian = gaussian_inverse(gdp_mu(claimed_epsilon, delta))
    return all(rate >= gaussian(r) - 1e-12
               for r, rate in zip(curve.powers, curve.rates, strict=True))


def bonferroni_factor(scores: int, delta: float, claim_curve: bool, noise: bool = False) -> int:
    """``n t (+ 1)``: the number of tests that share ``1 - confidence`` (``n`` scores, ``t``
    methods: Steinke's always, the f-DP bound when ``delta > 0``, the claim curve when
    given; plus the noise test of the releases when they are given)."""
    return scores * (1 + (delta > 0.0) + claim_curve) + noise


def audit_scores(
    scores: Mapping[str, np.ndarray],
    included: np.ndarray,
    claimed_epsilon: float | None,
    delta: float,
    confidence: float = 0.95,
    curve: ClaimCurve | None = None,
    noise: NoiseSample | None = None,
) -> list[CanaryAudit]:
    """One :class:`CanaryAudit` per score of ``scores`` (name -> one float per canary, higher
    = more likely in), each method at its Bonferroni share of ``1 - confidence`` (module
    docstring). ``curve``: the claimed mechanism's trade-off curve for the canaries' unit,
    when known; ``noise``: the releases' noise against the claimed noise multiplier, when
    the releases are known. The inputs are checked by :func:`~.one_run.one_run_audit`
    (and the coins first, by :func:`~.one_run.check_coins`)."""
    if not scores:
        return []
    included = np.asarray(included).astype(bool)
    check_coins(included)
    level = (1.0 - confidence) / bonferroni_factor(len(scores), delta, curve is not None,
                                                   noise is not None)
    fdp_valid = (curve is not None and claimed_epsilon is not None
                 and fdp_covers_claim(curve, claimed_epsilon, delta))
    noise_test = None if noise is None else noise.test(level)
    audits = []
    for name, raw in scores.items():
        values = np.asarray(raw, dtype=np.float64)
        order = one_run_order(values)
        result = one_run_audit(values, included, delta, confidence=1.0 - level, order=order)
        fdp = (one_run_audit(values, included, delta, confidence=1.0 - level, method="fdp",
                             order=order) if delta > 0.0 else None)
        counts = one_run_candidate_counts(values, included, order)
        claim = None
        if curve is not None:
            claim = claim_curve_test(curve, len(values), counts, 1.0 - level,
                                     included=int(included.sum()))
        p_value = (None if claimed_epsilon is None
                   else steinke_p_value(claimed_epsilon, delta, len(values), counts))
        audits.append(CanaryAudit(
            name, result, claimed_epsilon, values[included].tolist(),
            values[~included].tolist(), fdp=fdp, claim_test=claim, fdp_valid=fdp_valid,
            noise=noise_test, level=level, p_value=p_value,
        ))
    return audits
