"""The audit of a run's gradient canaries: the claim, the claimed mechanism, the verdict.

:func:`audit_gradient_canaries` scores the canaries of a
:class:`~.gradient_canaries.GradientCanaries` with the per-step likelihood ratio of a
canary sampled as the run sampled it, at the noise measured on the canary block
(:mod:`.gradient_canary_scores`; the most powerful test of each canary's inclusion for the
noise that actually ran, and a function of the releases alone), and hands the scores and the
secret coins to :func:`~.score_audit.audit_canary_scores`: Steinke's bound, the f-DP bound
and the test against the claimed mechanism's own trade-off curve, each at its Bonferroni
share of the confidence.

The claim: ``claimed_epsilon`` at ``delta``, or what an Opacus accountant (or
``PrivacyEngine``) passed as ``accountant`` reports at ``delta``, or, with neither, what the
accountant ``make_private`` hooked to the attached optimiser reports. The claimed mechanism, for
the curve test: the one given; otherwise the subsampled Gaussian at the run's sample rate and
number of steps, with the optimiser's noise multiplier; when that noise would not give the
claimed epsilon (by this package's PLD accountant, more than 1% above the claim: the
optimiser was set up with less noise than the claim needs), with the noise multiplier that
gives exactly the claimed epsilon instead, since that is the DP-SGD the claim describes.
Under shuffled batches the mechanism is still the Poisson one Opacus accounts: the audit
then tests the shuffled run against the Poisson claim.

With a claimed mechanism the releases themselves are also tested for its noise
(:mod:`.noise_check`): a release with far less noise than claimed (none at all, or the
averaged update recorded instead of the noisy sum, where every score ties) is a violation
even though no canary can be told from another.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlap_privacy.audit.canary_verdicts import audit_once
from fedlap_privacy.audit.gradient_canary_scores import CanaryRun
from fedlap_privacy.audit.noise_check import NoiseSample
from fedlap_privacy.audit.report_folder import ReportFolder
from fedlap_privacy.audit.score_audit import (
    ClaimedMechanism,
    ScoreAuditResult,
    audit_canary_scores,
)
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.jsonsafe import json_safe

if TYPE_CHECKING:
    from fedlap_privacy.audit.gradient_canaries import GradientCanaries

__all__ = ["AUDIT_SCORE", "GradientCanaryAudit", "audit_gradient_canaries",
           "described_mechanism"]

#: the score the verdict is drawn from
AUDIT_SCORE = "likelihood ratio (measured noise)"
#: a claim this much below the optimiser's own mechanism's epsilon is not that mechanism
_SLACK = 1.01


@dataclass(frozen=True)
class GradientCanaryAudit:
    """The audit (``audit``: the score audit's result) and the run the canaries saw
    (``run``); ``mechanism_source`` says where the claimed mechanism came from (``given``,
    ``optimizer``, ``calibrated to the claimed epsilon``, or ``none``)."""

    audit: ScoreAuditResult
    run: CanaryRun
    mechanism_source: str

    @property
    def verdict(self) -> str:
        return self.audit.verdict

    @property
    def violation(self) -> bool:
        return self.audit.violation

    @property
    def epsilon_lower_bound(self) -> float:
        return self.audit.epsilon_lower_bound

    @property
    def claim_curve_p_value(self) -> float | None:
        return self.audit.claim_curve_p_value

    @property
    def claimed_epsilon(self) -> float:
        return self.audit.claimed_epsilon

    @property
    def mechanism(self) -> ClaimedMechanism | None:
        return self.audit.mechanism

    def to_json(self) -> dict[str, Any]:
        """The score audit's report with the canaries' run added (``gradient_canaries``)."""
        return {**self.audit.to_json(),
                "gradient_canaries": {**self.run.to_json(), "score": AUDIT_SCORE,
                                      "mechanism_source": self.mechanism_source}}

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """The score audit's files, and ``canaries.json`` (the run the canaries saw)."""
        paths = self.audit.write(out_dir)
        with ReportFolder(out_dir) as folder:
            path = folder.write_text("canaries.json", json.dumps(
                json_safe(self.to_json()["gradient_canaries"]), indent=2) + "\n")
        return {**paths, "canaries": path}


def _claimed_epsilon(claimed_epsilon: float | None, delta: float, accountant: Any) -> float:
    if claimed_epsilon is not None:
        return claimed_epsilon
    if accountant is None:
        raise ConfigError("give claimed_epsilon=, or accountant= (an Opacus accountant or "
                          "PrivacyEngine) to take it from")
    get = getattr(accountant, "get_epsilon", None)
    if not callable(get):
        raise ConfigError(f"accountant must have get_epsilon(delta), got "
                          f"{type(accountant).__name__}")
    return float(get(delta=delta))


def _calibrated(claimed_epsilon: float, delta: float, q: float, steps: int,
                above: float) -> float:
    """The noise multiplier (> ``above``) whose mechanism spends ``claimed_epsilon``:
    bisection on log sigma (epsilon decreases as sigma grows)."""
    lo, hi = max(above, 1e-3), max(2.0 * above, 1.0)
    while ClaimedMechanism(hi, q, steps).epsilon(delta) > claimed_epsilon:
        lo, hi = hi, 2.0 * hi
        if hi > 1e4:
            raise ConfigError(f"no noise multiplier gives epsilon {claimed_epsilon} at rate "
                              f"{q} over {steps} steps")
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if ClaimedMechanism(mid, q, steps).epsilon(delta) > claimed_epsilon:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.001:
            break
    return hi


def described_mechanism(run: CanaryRun, claimed_epsilon: float,
                        delta: float) -> tuple[ClaimedMechanism | None, str]:
    """The claimed mechanism of a run when none is given (module docstring) and where it
    came from; ``(None, "none")`` when the run's noise multiplier or rate changed."""
    sigma, q, steps = run.noise_multiplier, run.sample_rate, run.steps
    if sigma is None:
        return None, "none"
    if claimed_epsilon <= 0.0:
        return (ClaimedMechanism(sigma, q, steps), "optimizer") if sigma > 0 else (None, "none")
    if sigma > 0.0 and ClaimedMechanism(sigma, q, steps).epsilon(delta) <= \
            claimed_epsilon * _SLACK:
        return ClaimedMechanism(sigma, q, steps), "optimizer"
    return (ClaimedMechanism(_calibrated(claimed_epsilon, delta, q, steps, sigma), q, steps),
            "calibrated to the claimed epsilon")


def audit_gradient_canaries(
    canaries: GradientCanaries,
    claimed_epsilon: float | None,
    delta: float,
    *,
    accountant: Any = None,
    mechanism: ClaimedMechanism | None = None,
    confidence: float = 0.95,
    out: str | Path | None = None,
) -> GradientCanaryAudit:
    """Audit the claim from ``canaries`` after training (module docstring); ``out``: a
    folder for ``report.json`` / ``report.md`` / ``report.html`` / ``scores.png`` and
    ``canaries.json``."""
    run = canaries.run()
    if claimed_epsilon is None and accountant is None:
        accountant = canaries.accountant()  # the one make_private attached, if any
    claim = _claimed_epsilon(claimed_epsilon, delta, accountant)
    if not (isinstance(claim, int | float) and math.isfinite(claim) and claim >= 0.0):
        raise ConfigError(f"the claimed epsilon must be finite and >= 0, got {claim!r}")
    if not (isinstance(delta, int | float) and 0.0 < delta < 1.0):
        raise ConfigError(f"delta must lie in (0, 1), got {delta!r}")
    if mechanism is not None:
        source = "given"
    else:
        mechanism, source = described_mechanism(run, float(claim), float(delta))
    scores = canaries.scores()
    title = (f"{run.canaries} gradient canaries on a dedicated block, {run.steps} steps, "
             f"{run.sampling} sampling at rate {run.sample_rate:.4g}; noise multiplier "
             f"measured on the block {run.measured_noise_multiplier:.3g}"
             + ("" if run.noise_multiplier is None
                else f" (the optimiser's {run.noise_multiplier:.3g})"))
    noise = None if mechanism is None else NoiseSample.from_releases(
        canaries.releases(), mechanism.validate().noise_multiplier,
        run.measured_noise_multiplier)
    result = audit_once(canaries, float(claim), float(delta), lambda: audit_canary_scores(
        {AUDIT_SCORE: scores[AUDIT_SCORE]}, canaries.included, claimed_epsilon=float(claim),
        delta=float(delta), mechanism=mechanism, confidence=confidence, title=title,
        noise=noise))
    audit = GradientCanaryAudit(result, run, source)
    if out is not None:
        audit.write(out)
    return audit
