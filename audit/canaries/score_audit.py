"""One-run audit of canary scores from any framework (JAX, TensorFlow, Opacus, your own loop).

The auditor of a training this package did not run hands over what a one-run audit needs
(Steinke, Nasr, Jagielski, NeurIPS 2023): ``m`` canaries, each included in training with a
secret fair coin drawn before training (``included``), and a score per canary after training
(``scores``, higher = more likely included: minus a canary record's loss, a gradient
canary's accumulated update, a likelihood ratio). :func:`audit_canary_scores` tests the
claimed ``(epsilon, delta)`` with the same methods, Bonferroni sharing and verdicts as the
audits of this package's own runs (:mod:`.canary_verdicts`): Steinke's bound, the f-DP bound
of the Gaussian family, and, when the claimed mechanism is described
(:class:`ClaimedMechanism`: ``steps`` compositions of the Poisson-subsampled Gaussian), the
test of the guesses against that mechanism's own trade-off curve (:mod:`.claim_curve`).

What it shows: a violation means that, with probability at least ``confidence`` over the
secret coins, the training leaked more about a canary than the claim allows (a bug in the
mechanism or in its accounting, for canaries like the ones scored). What it cannot show: that
the claim holds (a consistent verdict only says this audit found no evidence against it), and
nothing above the audit's ceiling (the bound with every guess right: a claim above it is
``inconclusive``). The bits must be secret coins drawn independently with probability 1/2
before training, and the scores computed without looking at them; otherwise no bound holds.
Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from fedlap_privacy.audit.bounds.canary_verdicts import (
    CanaryAudit,
    audit_scores,
    bonferroni_factor,
    strongest_audit,
)
from fedlap_privacy.audit.bounds.claim_curve import ClaimCurve, beyond_pld
from fedlap_privacy.audit.bounds.noise_check import NoiseSample
from fedlap_privacy.errors import ConfigError

__all__ = ["LISTED_SCORES", "MAX_CANARIES", "MIN_CANARIES", "CanaryClaim", "ClaimedMechanism",
           "OnScoreAudit", "ScoreAuditResult", "audit_canary_scores", "check_bits", "check_claim",
           "check_scores", "score_summary"]

#: fewest canaries an audit of scores accepts (below it no bound can exceed a tiny epsilon)
MIN_CANARIES = 10
#: most canaries an audit of scores accepts (2^20, as many as gradient canaries can be; the
#: published one-run audits use up to 10^6): a few seconds and well under 1 GB, where 10^7
#: took minutes and gigabytes
MAX_CANARIES = 1 << 20
#: most scores report.json lists one by one (beyond it, the histogram alone)
LISTED_SCORES = 10_000
#: bins of the score histograms report.json keeps
HISTOGRAM_BINS = 40


def score_summary(scores_in: list[float], scores_out: list[float]) -> dict[str, Any]:
    """What report.json keeps of one audit's scores: a histogram of the included and the
    other canaries on common bins (``edges``, ``in``, ``out``), and the scores themselves
    (``scores_in`` / ``scores_out``) only up to :data:`LISTED_SCORES` of them, so that the
    file stays small whatever the number of canaries."""
    values_in = np.asarray(scores_in, dtype=np.float64)
    values_out = np.asarray(scores_out, dtype=np.float64)
    both = np.concatenate([values_in, values_out])
    edges = np.histogram_bin_edges(both, bins=HISTOGRAM_BINS) if both.size else \
        np.linspace(0.0, 1.0, HISTOGRAM_BINS + 1)
    out: dict[str, Any] = {"histogram": {
        "edges": edges.tolist(), "in": np.histogram(values_in, edges)[0].tolist(),
        "out": np.histogram(values_out, edges)[0].tolist()}}
    if both.size <= LISTED_SCORES:
        out.update(scores_in=values_in.tolist(), scores_out=values_out.tolist())
    return out


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float | np.integer
                                                      | np.floating)


@lru_cache(maxsize=16)
def _curve(sigma: float, q: float, steps: int, delta: float) -> ClaimCurve:
    return ClaimCurve.from_steps({(sigma, q): steps}, delta)


@dataclass(frozen=True)
class ClaimedMechanism:
    """A claimed DP-SGD-like mechanism: ``steps`` compositions of the Poisson-subsampled
    Gaussian (noise multiplier ``sigma`` = ``noise_multiplier``, sample rate ``q``), under
    add/remove-one neighbours (as Opacus's and this package's accountants).

    :meth:`curve` is its trade-off curve (:class:`~.claim_curve.ClaimCurve`, from the
    accountant's pessimistic privacy-loss distribution); :meth:`validate` refuses non-finite
    or out-of-range values with :class:`~fedlap_privacy.errors.ConfigError`.
    """

    noise_multiplier: float
    sample_rate: float
    steps: int

    def validate(self) -> ClaimedMechanism:
        """``self`` when ``noise_multiplier > 0``, ``0 < sample_rate <= 1`` (finite) and
        ``steps`` a positive integer; a ConfigError naming the value otherwise."""
        sigma, q, steps = self.noise_multiplier, self.sample_rate, self.steps
        if not (_is_number(sigma) and math.isfinite(sigma) and sigma > 0.0):
            raise ConfigError(f"the claimed noise multiplier must be finite and > 0, got "
                              f"{sigma!r}")
        if not (_is_number(q) and math.isfinite(q) and 0.0 < q <= 1.0):
            raise ConfigError(f"the claimed sample rate must lie in (0, 1], got {q!r}")
        if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
            raise ConfigError(f"the claimed number of steps must be an integer >= 1, "
                              f"got {steps!r}")
        return self

    def curve(self, delta: float = 1e-5) -> ClaimCurve:
        """The mechanism's trade-off curve (``delta`` only centres the composition's FFT
        window, as the accountant's); cached."""
        self.validate()
        return _curve(float(self.noise_multiplier), float(self.sample_rate), int(self.steps),
                      float(delta))

    def epsilon(self, delta: float) -> float:
        """The mechanism's epsilon at ``delta`` by the package's PLD accountant."""
        from fedlap_privacy.accountant.pld import pld_epsilons

        self.validate()
        key = (float(self.noise_multiplier), float(self.sample_rate))
        try:
            return pld_epsilons([{key: int(self.steps)}], delta)[0]
        except ConfigError:
            raise ConfigError(beyond_pld({key: int(self.steps)})) from None

    def to_json(self) -> dict[str, Any]:
        return {"noise_multiplier": float(self.noise_multiplier),
                "sample_rate": float(self.sample_rate), "steps": int(self.steps)}


@dataclass(frozen=True)
class CanaryClaim:
    """The promise every canary audit tests (scores, Opacus canaries, Flower canary clients):
    ``(epsilon, delta)``-DP and, when known, the mechanism said to deliver it."""

    epsilon: float
    delta: float
    mechanism: ClaimedMechanism | None = None

    def to_json(self) -> dict[str, Any]:
        return {"epsilon": float(self.epsilon), "delta": float(self.delta),
                "mechanism": None if self.mechanism is None else self.mechanism.to_json()}


@dataclass(frozen=True)
class ScoreAuditResult:
    """What :func:`audit_canary_scores` found: one :class:`~.canary_verdicts.CanaryAudit`
    per score name, the claim and (with a claimed mechanism) that mechanism's accountant
    epsilon at the claim's delta (``mechanism_epsilon``)."""

    audits: list[CanaryAudit]
    claim: CanaryClaim
    confidence: float = 0.95
    title: str = "canary scores"
    mechanism_epsilon: float | None = None

    @property
    def claimed_epsilon(self) -> float:
        return self.claim.epsilon

    @property
    def delta(self) -> float:
        return self.claim.delta

    @property
    def mechanism(self) -> ClaimedMechanism | None:
        return self.claim.mechanism

    def score(self, name: str) -> CanaryAudit:
        """The audit of the score called ``name``; one line naming the scores otherwise."""
        for a in self.audits:
            if a.name == name:
                return a
        raise ConfigError(f"no score named {name!r}: {[a.name for a in self.audits]}")

    @property
    def strongest(self) -> CanaryAudit:
        """The audit with the strongest valid verdict (ties: the largest bound)."""
        return strongest_audit(self.audits)

    @property
    def verdict(self) -> str:
        """``violation``, ``consistent`` or ``inconclusive``: the strongest valid verdict of
        every method of every score (a violation over a consistent over an inconclusive)."""
        return self.strongest.verdict

    @property
    def violation(self) -> bool:
        return self.verdict == "violation"

    @property
    def epsilon_lower_bound(self) -> float:
        """The largest valid ``(eps, delta)`` lower bound over the scores (each already at its
        Bonferroni share, so it holds at ``confidence``)."""
        return max(a.epsilon_lower_bound for a in self.audits)

    @property
    def claim_curve_p_value(self) -> float | None:
        """The p-value of "the training is the claimed mechanism", adjusted for the family
        (the smallest claim-curve p-value over the scores times the Bonferroni factor, at most
        1): a violation by that test exactly when it is below ``1 - confidence``. None
        without a mechanism."""
        tests = [a.claim_test for a in self.audits if a.claim_test is not None]
        if not tests:
            return None
        factor = bonferroni_factor(len(self.audits), self.delta, claim_curve=True)
        return min(1.0, min(t.p_value for t in tests) * factor)

    @property
    def ceiling(self) -> float:
        """The largest bound the strongest audit could have reached (every guess right)."""
        return float(self.strongest.to_json()["ceiling"])

    def to_json(self) -> dict[str, Any]:
        """``report.json``: the claim, the verdict, and every audit with its scores in / out
        (``one_run``, the shape of ``audit --json``'s canary audits)."""
        entries = [{**a.to_json(), **score_summary(a.scores_in, a.scores_out)}
                   for a in self.audits]
        best = self.audits.index(self.strongest)
        primary = {k: v for k, v in entries[best].items()
                   if k not in ("scores_in", "scores_out", "histogram")}
        return {
            "source": self.title,
            "claim": {**self.claim.to_json(), "mechanism_epsilon": self.mechanism_epsilon},
            "confidence": self.confidence,
            "verdict": self.verdict,
            "violation": self.violation,
            "epsilon_lower_bound": self.epsilon_lower_bound,
            "claim_curve_p_value": self.claim_curve_p_value,
            "one_run": {**primary, "kind": "scores", "audits": entries},
        }

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """Write ``report.json``, ``scores.png``, ``report.md`` and ``report.html`` into
        ``out_dir`` (:mod:`.score_report`); the paths by kind."""
        from fedlap_privacy.audit.reports.score_report import write_score_report

        return write_score_report(self.to_json(), out_dir)


def check_scores(values: Any, name: str = "scores") -> np.ndarray:
    """``values`` as a 1-D float64 array of finite real numbers, or a ConfigError."""
    arr = np.asarray(values)
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.floating)
                                 or np.issubdtype(arr.dtype, np.integer)):
        raise ConfigError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ConfigError(f"{name} must be 1-D (one score per canary), got shape {arr.shape}")
    out = arr.astype(np.float64)
    if not np.all(np.isfinite(out)):
        bad = int((~np.isfinite(out)).sum())
        raise ConfigError(f"{name} must be finite: {bad} of {out.size} are NaN or infinite")
    return out


def check_bits(values: Any, m: int) -> np.ndarray:
    """The secret inclusion bits as a boolean array of length ``m`` (booleans, or integers 0
    and 1 only), or a ConfigError."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ConfigError(f"included must be 1-D (one bit per canary), got shape {arr.shape}")
    if arr.dtype != bool:
        if not np.issubdtype(arr.dtype, np.integer):
            raise ConfigError(f"included must hold booleans or the integers 0 and 1, got "
                              f"dtype {arr.dtype}")
        if not np.all((arr == 0) | (arr == 1)):
            raise ConfigError("included must hold only 0 and 1")
    if arr.size != m:
        raise ConfigError(f"scores and included differ in length: {m} scores, "
                          f"{arr.size} bits")
    return arr.astype(bool)


def check_claim(claimed_epsilon: float, delta: float, confidence: float) -> None:
    """A ConfigError unless the claim is finite epsilon >= 0, 0 < delta < 1 and
    0 < confidence < 1."""
    for name, value in (("claimed epsilon", claimed_epsilon), ("delta", delta),
                        ("confidence", confidence)):
        if not _is_number(value):
            raise ConfigError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(claimed_epsilon) and claimed_epsilon >= 0.0):
        raise ConfigError(f"the claimed epsilon must be finite and >= 0, got {claimed_epsilon}")
    if not (math.isfinite(delta) and 0.0 < delta < 1.0):
        raise ConfigError(f"delta must lie in (0, 1), got {delta}")
    if not (math.isfinite(confidence) and 0.0 < confidence < 1.0):
        raise ConfigError(f"confidence must lie in (0, 1), got {confidence}")


class OnScoreAudit:
    """What a framework's audit record (the score audit ``audit`` and what its canaries saw:
    :class:`~.gradient_canary_audit.GradientCanaryAudit`,
    :class:`~fedlap_privacy.audit.flower.flower_canaries.FlowerAudit`) reads from the score
    audit; a record overrides ``verdict`` where its own test can decide."""

    audit: ScoreAuditResult

    @property
    def claim(self) -> CanaryClaim:
        return self.audit.claim

    @property
    def claimed_epsilon(self) -> float:
        return self.audit.claimed_epsilon

    @property
    def mechanism(self) -> ClaimedMechanism | None:
        return self.audit.mechanism

    @property
    def audits(self) -> list[CanaryAudit]:
        return self.audit.audits

    @property
    def verdict(self) -> str:
        return self.audit.verdict

    @property
    def violation(self) -> bool:
        return self.verdict == "violation"

    @property
    def epsilon_lower_bound(self) -> float:
        """The largest valid bound over the scores and methods."""
        return self.audit.epsilon_lower_bound

    @property
    def claim_curve_p_value(self) -> float | None:
        return self.audit.claim_curve_p_value


def audit_canary_scores(
    scores: np.ndarray | Mapping[str, np.ndarray],
    included: np.ndarray,
    *,
    claimed_epsilon: float,
    delta: float,
    mechanism: ClaimedMechanism | None = None,
    confidence: float = 0.95,
    out: str | Path | None = None,
    title: str = "canary scores",
    noise: NoiseSample | None = None,
) -> ScoreAuditResult:
    """Audit a claimed ``(claimed_epsilon, delta)`` from canary scores (module docstring).

    ``scores``: one float per canary (higher = more likely included), or several such
    arrays by name (each is an audit; the level is shared among them). ``included``: the
    secret bits (booleans or 0/1), one per canary. ``mechanism``: the claimed mechanism, for
    the claim-curve test. ``out``: a folder for ``report.json`` / ``report.md`` /
    ``report.html`` / ``scores.png``. ``noise``: the releases the scores came from against
    the claimed noise multiplier (:mod:`.noise_check`), when the caller has them. Bad input
    is a one-line ConfigError.
    """
    check_claim(claimed_epsilon, delta, confidence)
    named = dict(scores) if isinstance(scores, Mapping) else {"scores": scores}
    if not named:
        raise ConfigError("no scores given")
    checked: dict[str, np.ndarray] = {}
    for name, values in named.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"every score needs a non-empty name, got {name!r}")
        checked[name] = check_scores(values, name if len(named) > 1 else "scores")
    m = len(next(iter(checked.values())))
    if any(len(v) != m for v in checked.values()):
        raise ConfigError("every score array needs one value per canary (lengths differ)")
    bits = check_bits(included, m)
    if m < MIN_CANARIES:
        raise ConfigError(f"the audit needs at least {MIN_CANARIES} canaries, got {m}")
    if m > MAX_CANARIES:
        raise ConfigError(f"the audit takes at most {MAX_CANARIES:,} canaries, got {m:,}")
    curve = mechanism_eps = None
    if mechanism is not None:
        if not isinstance(mechanism, ClaimedMechanism):
            raise ConfigError(f"mechanism must be a ClaimedMechanism, got {type(mechanism)}")
        curve = mechanism.validate().curve(delta)
        mechanism_eps = mechanism.epsilon(delta)
    audits = audit_scores(checked, bits, float(claimed_epsilon), float(delta),
                          float(confidence), curve, noise)
    result = ScoreAuditResult(audits, CanaryClaim(float(claimed_epsilon), float(delta), mechanism),
                              float(confidence), title, mechanism_eps)
    if out is not None:
        result.write(out)
    return result
