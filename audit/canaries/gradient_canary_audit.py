"""The audit of a run's gradient canaries: the claim, the claimed mechanism, the verdict.

:func:`audit_gradient_canaries` scores the canaries of a
:class:`~.gradient_canaries.GradientCanaries` with the per-step likelihood ratio of a
canary sampled as the run was accounted (the rate of each released step), at the noise
measured on the canary block (:mod:`.gradient_canary_scores`; the most powerful test of each
canary's inclusion for the noise that actually ran, and a function of the releases alone),
and hands the scores and the secret coins to :func:`~.score_audit.audit_canary_scores`:
Steinke's bound, the f-DP bound and the test against the claimed mechanism's own trade-off
curve, each at its Bonferroni share of the confidence.

The claim, by default, is the one the run was set up to keep: the subsampled Gaussian with
the noise multiplier the Opacus optimiser had at ``attach``, at the rate the first released
step was accounted at (``make_private``'s ``1 / len(data_loader)`` times the micro-batches
accumulated into a step), over the steps released, accounted by an accountant of the kind
``make_private`` hooked (``accountant=``, an Opacus accountant or ``PrivacyEngine``, picks
another kind). Opacus's own epsilon, which follows whatever the training changed, is
reported beside it, with each change (:mod:`.canary_steps`). ``claimed_epsilon`` replaces
the claim; a plain loop (no optimiser attached) needs it or ``accountant=`` (then its
``get_epsilon``). The claimed mechanism, for the curve test: the one given; otherwise, with
the set-up claim, the set-up mechanism; with a claim given (or read from a plain loop's
``accountant=``), the noise multiplier that ran (when it never changed) unless it would not
give the claimed epsilon (by this package's PLD accountant, more than 1% above the claim):
then the noise multiplier that gives exactly the claimed epsilon, since that is the DP-SGD
the claim describes. Under shuffled batches the mechanism is still the
Poisson one Opacus accounts: the audit then tests the shuffled run against the Poisson claim.

With canary records (``wrap_dataset``) a second test joins, at a tenth of the level
(:class:`SamplingTest`): how often the released steps drew the canary records against the
rates the steps were accounted at. A loader that draws records more often than the
accountant assumes (a larger batch than accounted, a weighted sampler) makes the claimed
mechanism false whatever the noise; the verdict is then a violation.

With a claimed mechanism the releases themselves are also tested for its noise
(:mod:`.noise_check`): a release with far less noise than claimed (none at all, or the
averaged update recorded instead of the noisy sum, where every score ties) is a violation
even though no canary can be told from another. One claim per set of canaries
(:func:`~.canary_verdicts.audit_once`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlap_privacy.audit.bounds.canary_verdicts import audit_once
from fedlap_privacy.audit.bounds.noise_check import NoiseSample
from fedlap_privacy.audit.canaries.canary_steps import describe_change
from fedlap_privacy.audit.canaries.gradient_canary_scores import CanaryRun
from fedlap_privacy.audit.canaries.score_audit import (
    ClaimedMechanism,
    OnScoreAudit,
    ScoreAuditResult,
    audit_canary_scores,
)
from fedlap_privacy.audit.reports.report_folder import ReportFolder
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.state.jsonsafe import json_safe

if TYPE_CHECKING:
    from fedlap_privacy.audit.canaries.gradient_canaries import GradientCanaries
    from fedlap_privacy.audit.reports.privacy_report import Block

__all__ = ["AUDIT_SCORE", "SAMPLING_SHARE", "GradientCanaryAudit", "SamplingTest",
           "audit_gradient_canaries", "described_mechanism", "run_blocks"]

#: the score the verdict is drawn from
AUDIT_SCORE = "likelihood ratio (measured noise)"
#: a claim this much below the optimiser's own mechanism's epsilon is not that mechanism
_SLACK = 1.01
#: the share of the audit's level (1 - confidence) the sampling test of canary records takes
SAMPLING_SHARE = 0.1


@dataclass(frozen=True)
class SamplingTest:
    """How often the run drew its canary records against the rates it was accounted at.

    Under the claimed mechanism each record enters each step independently with the step's
    accounted rate ``q_t``, so the ``k`` canary records' draws ``D`` over the released steps
    are a sum of independent Bernoulli variables with mean ``mu = k sum_t q_t``. The p-value
    of ``draws`` (one-sided: more draws than accounted) is the Chernoff bound
    ``P[D >= (1 + d) mu] <= exp(-mu ((1 + d) ln(1 + d) - d))``, valid for any ``q_t``; a
    shuffled loader, each record once an epoch, draws exactly ``mu``. ``level``: its share of
    the audit's level (:data:`SAMPLING_SHARE`)."""

    draws: int
    accounted: float
    level: float

    @property
    def ratio(self) -> float:
        return self.draws / self.accounted if self.accounted > 0 else math.inf

    @property
    def p_value(self) -> float:
        if self.draws <= self.accounted:
            return 1.0
        if self.accounted <= 0.0:
            return 0.0
        d = self.draws / self.accounted - 1.0
        return math.exp(-self.accounted * ((1.0 + d) * math.log1p(d) - d))

    @property
    def rejected(self) -> bool:
        return self.p_value < self.level

    def to_json(self) -> dict[str, Any]:
        return {"draws": self.draws, "accounted": self.accounted, "ratio": self.ratio,
                "p_value": self.p_value, "level": self.level, "rejected": self.rejected}


@dataclass(frozen=True)
class GradientCanaryAudit(OnScoreAudit):
    """The audit (``audit``: the score audit's result) and the run the canaries saw
    (``run``); ``mechanism_source`` says where the claimed mechanism came from (``given``,
    ``set up``, ``optimizer``, ``calibrated to the claimed epsilon``, or ``none``),
    ``claim_source`` where the claimed epsilon came from (``given``, ``set up``,
    ``accountant``); ``opacus_epsilon``: what the accountant ``make_private`` hooked
    reports at the audit's delta (None without one)."""

    audit: ScoreAuditResult
    run: CanaryRun
    mechanism_source: str
    claim_source: str = "given"
    opacus_epsilon: float | None = None
    sampling: SamplingTest | None = None

    @property
    def verdict(self) -> str:
        """The score audit's verdict, or ``violation`` when the sampling test rejects the
        accounted rates (the claimed mechanism then does not describe the run)."""
        if self.sampling is not None and self.sampling.rejected:
            return "violation"
        return self.audit.verdict

    def to_json(self) -> dict[str, Any]:
        """The score audit's report with the canaries' run added (``gradient_canaries``);
        ``decided_by`` names the sampling test where it overrode the score audit."""
        decided = None
        if self.sampling is not None and self.sampling.rejected:
            s = self.sampling
            decided = {"test": "sampling", "reason": (
                f"the released steps drew the canary records {s.draws} times, {s.ratio:.3g} "
                f"times the {s.accounted:.4g} the accounted rates give: p-value "
                f"{s.p_value:.3g}, below its level {s.level:.3g}")}
        return {**self.audit.to_json(), "verdict": self.verdict, "violation": self.violation,
                "decided_by": decided,
                "sampling_test": None if self.sampling is None else self.sampling.to_json(),
                "gradient_canaries": {**self.run.to_json(), "score": AUDIT_SCORE,
                                      "mechanism_source": self.mechanism_source,
                                      "claim_source": self.claim_source,
                                      "opacus_epsilon": self.opacus_epsilon}}

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """The score audit's files with the run the canaries saw added to ``report.json``,
        ``report.md`` and ``report.html`` (:func:`run_blocks`), and ``canaries.json``, all
        through the report folder's descriptor (:class:`~.report_folder.ReportFolder`)."""
        from fedlap_privacy.audit.reports.score_report import write_score_report

        report = json_safe(self.to_json())
        paths = write_score_report(report, out_dir, sections=run_blocks(self))
        with ReportFolder(out_dir) as folder:
            path = folder.write_text("canaries.json",
                                     json.dumps(report["gradient_canaries"], indent=2) + "\n")
        return {**paths, "canaries": path}


_ROUTES = {
    "optimizer": "The canaries entered at the optimiser: each included canary was sampled "
                 "at the rate Opacus accounted for the step and added C on its own "
                 "coordinate of the canary block before the noise.",
    "data pipeline": "The canaries were records of the training set: your loader and "
                     "sampler drew them like any record, and the wrapped model routed each "
                     "drawn one to its own coordinate of the canary block (C there after "
                     "clipping).",
    "plain loop": "The canaries entered a DP-SGD loop through add_to_clipped_sum and "
                  "record_release.",
}


def run_blocks(result: GradientCanaryAudit) -> list[Block]:
    """The report's section on the run: where the canaries entered, what the optimiser was
    set up with, the claim tested against Opacus's own epsilon, and what changed when."""
    from fedlap_privacy.audit.reports.privacy_report import Block, fmt

    run = result.run
    lines = [_ROUTES.get(run.route, run.route)]
    if run.setup is not None:
        s = run.setup
        lines.append(f"Set up: noise multiplier {fmt(s.noise_multiplier)}, clipping norm "
                     f"{fmt(s.max_grad_norm)}, accounted sample rate {fmt(run.sample_rate)} "
                     f"per step, expected batch size {fmt(s.expected_batch_size)}, "
                     f"{run.steps} steps released.")
    source = {"set up": "the mechanism the optimiser was set up with, accounted as Opacus "
                        "does over the steps released",
              "given": "given to the audit",
              "accountant": "reported by the accountant given to the audit"}
    lines.append(f"Claim tested: epsilon {fmt(result.claimed_epsilon)} "
                 f"({source.get(result.claim_source, result.claim_source)}).")
    if result.opacus_epsilon is not None:
        note = ""
        if abs(result.opacus_epsilon - result.claimed_epsilon) > 0.01 * max(
                result.claimed_epsilon, 1e-9):
            note = (" It differs from the claim tested: Opacus's accountant reads the noise "
                    "multiplier and the accumulated micro-batches at every step, so it "
                    "follows what the training changed.")
        lines.append(f"Opacus's own epsilon after training: {fmt(result.opacus_epsilon)}."
                     + note)
    lines.append(f"Noise multiplier measured on the canary block: "
                 f"{fmt(run.measured_noise_multiplier)}.")
    test = result.sampling
    if run.canary_records is not None and test is not None:
        lines.append(f"Canary records in the training set: {run.canary_records}; the "
                     f"released steps drew them {test.draws} times, {fmt(test.ratio)} times "
                     f"the {fmt(test.accounted)} the accounted rates give on average "
                     f"(sampling test: p-value {fmt(test.p_value)}, a violation below "
                     f"{fmt(test.level)}).")
        if test.rejected:
            lines.append("VIOLATION of the accounted sampling: your loader draws records "
                         "more often than the accountant assumes, so the claimed epsilon "
                         "does not hold for this run.")
    if run.changes:
        changed = [describe_change(c, run.steps) + "." for c in run.changes]
        kept = ("the claim tested stays the set-up one" if result.claim_source == "set up"
                else "the claim tested is the one given")
        lines.append(f"Changed during training ({kept}):")
        items = [(x,) for x in lines] + [(f"  {x}",) for x in changed]
    else:
        lines.append("Nothing changed during training: every released step ran with the "
                     + ("set-up values." if run.setup is not None else "first step's values."))
        items = [(x,) for x in lines]
    return [Block("heading", "The run"), Block("bullets", items=tuple(items))]


def _accounted_epsilon(accountant: Any, sigma: float, q: float, steps: int,
                       delta: float) -> float:
    """The epsilon at ``delta`` of ``steps`` steps of the subsampled Gaussian ``(sigma, q)``
    by a fresh accountant of ``accountant``'s kind (Opacus's RDP / PRV / GDP), or by this
    package's PLD accountant when there is none."""
    if accountant is not None:
        try:
            fresh = type(accountant)()
        except TypeError:  # not one that starts empty: this package's accountant instead
            return ClaimedMechanism(sigma, q, steps).epsilon(delta)
        fresh.history = [(float(sigma), float(q), int(steps))]
        return float(fresh.get_epsilon(delta=delta))
    return ClaimedMechanism(sigma, q, steps).epsilon(delta)


def _opacus_accountant(accountant: Any) -> Any | None:
    """An Opacus accountant from ``accountant`` (itself, or a ``PrivacyEngine``'s)."""
    if accountant is None:
        return None
    inner = getattr(accountant, "accountant", None)
    if inner is not None and hasattr(inner, "history"):
        return inner
    if not callable(getattr(accountant, "get_epsilon", None)):
        raise ConfigError(f"accountant must have get_epsilon(delta), got "
                          f"{type(accountant).__name__}")
    return accountant


def _claim(canaries: GradientCanaries, run: CanaryRun, claimed_epsilon: float | None,
           delta: float, accountant: Any) -> tuple[float, str]:
    """The claimed epsilon and where it came from (module docstring)."""
    if claimed_epsilon is not None:
        return claimed_epsilon, "given"
    given = _opacus_accountant(accountant)
    if run.setup is None:
        if given is None:
            raise ConfigError("give claimed_epsilon=, or accountant= (an Opacus accountant "
                              "or PrivacyEngine) to take it from")
        return float(given.get_epsilon(delta=delta)), "accountant"
    sigma = run.setup.noise_multiplier
    if not sigma > 0.0:
        raise ConfigError(f"the optimiser was set up with noise multiplier {sigma}: it "
                          f"claims no epsilon; pass claimed_epsilon=")
    kind = given if given is not None and hasattr(given, "history") else \
        canaries.accountant()
    return _accounted_epsilon(kind, sigma, run.sample_rate, run.steps, delta), "set up"


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


def described_mechanism(run: CanaryRun, claimed_epsilon: float, delta: float,
                        set_up: bool = False) -> tuple[ClaimedMechanism | None, str]:
    """The claimed mechanism of a run when none is given (module docstring) and where it
    came from. ``set_up``: the claim is the set-up one, whose mechanism it is. Otherwise the
    noise multiplier that ran, unless it spends more than the claim (then the one calibrated
    to it); ``(None, "none")`` when that noise multiplier changed during the run."""
    q, steps = run.sample_rate, run.steps
    if set_up and run.setup is not None:
        return ClaimedMechanism(run.setup.noise_multiplier, q, steps), "set up"
    sigma = run.noise_multiplier
    if sigma is None:
        return None, "none"
    if claimed_epsilon <= 0.0:
        return (ClaimedMechanism(sigma, q, steps), "optimizer") if sigma > 0 \
            else (None, "none")
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
    if not (isinstance(delta, int | float) and 0.0 < delta < 1.0):
        raise ConfigError(f"delta must lie in (0, 1), got {delta!r}")
    canaries.check_modelled()
    run = canaries.run()
    claim, claim_source = _claim(canaries, run, claimed_epsilon, float(delta), accountant)
    if not (isinstance(claim, int | float) and math.isfinite(claim) and claim >= 0.0):
        raise ConfigError(f"the claimed epsilon must be finite and >= 0, got {claim!r}")
    hooked = canaries.accountant()
    opacus_epsilon = None
    if hooked is not None and len(getattr(hooked, "history", [])) > 0:
        opacus_epsilon = float(hooked.get_epsilon(delta=delta))
    if mechanism is not None:
        source = "given"
    else:
        mechanism, source = described_mechanism(run, float(claim), float(delta),
                                                set_up=claim_source == "set up")
    if not (isinstance(confidence, int | float) and 0.0 < confidence < 1.0):
        raise ConfigError(f"confidence must lie in (0, 1), got {confidence!r}")
    sampling = None
    if run.canary_draws is not None and run.accounted_draws is not None:
        level = (1.0 - confidence) * SAMPLING_SHARE
        sampling = SamplingTest(run.canary_draws, run.accounted_draws, level)
        confidence = 1.0 - (1.0 - confidence) * (1.0 - SAMPLING_SHARE)
    scores = canaries.scores()
    title = (f"{run.canaries} gradient canaries ({run.route}), {run.steps} steps, "
             f"{run.sampling} sampling at rate {run.sample_rate:.4g}")
    noise = None if mechanism is None else NoiseSample.from_releases(
        canaries.releases(), mechanism.validate().noise_multiplier,
        run.measured_noise_multiplier)
    result = audit_once(canaries, float(claim), float(delta), lambda: audit_canary_scores(
        {AUDIT_SCORE: scores[AUDIT_SCORE]}, canaries.included, claimed_epsilon=float(claim),
        delta=float(delta), mechanism=mechanism, confidence=confidence, title=title,
        noise=noise))
    audit = GradientCanaryAudit(result, run, source, claim_source, opacus_epsilon, sampling)
    if out is not None:
        audit.write(out)
    return audit
