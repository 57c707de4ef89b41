"""audit_canary_scores: the one-run audit of canary scores from any framework."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedlap_privacy.accountant.pld import pld_epsilons
from fedlap_privacy.audit import ClaimedMechanism, ScoreAuditResult, audit_canary_scores
from fedlap_privacy.audit.bounds.one_run import one_run_audit
from fedlap_privacy.errors import ConfigError

M, DELTA = 1000, 1e-5


def _bits(seed: int, m: int = M) -> np.ndarray:
    return np.random.default_rng(seed).random(m) < 0.5


def _dp_sgd_scores(bits: np.ndarray, sigma_true: float, mech: ClaimedMechanism,
                   seed: int) -> np.ndarray:
    """Per-step likelihood-ratio scores of gradient canaries (clip 1, own coordinate) in a
    DP-SGD run whose noise is ``sigma_true`` while ``mech`` is what was claimed:
    ``sum_t log(1 - q + q exp((u_t - 1/2) / sigma^2))`` with the claimed ``sigma``."""
    rng = np.random.default_rng(seed)
    q, sigma, steps = mech.sample_rate, mech.noise_multiplier, mech.steps
    total = np.zeros(len(bits))
    for _ in range(steps):
        sampled = bits & (rng.random(len(bits)) < q)
        u = sampled + sigma_true * rng.standard_normal(len(bits))
        total += np.logaddexp(math.log1p(-q), math.log(q) + (u - 0.5) / sigma**2)
    return total


def test_null_scores_are_consistent() -> None:
    rng = np.random.default_rng(0)
    result = audit_canary_scores(rng.standard_normal(M), _bits(1), claimed_epsilon=1.0,
                                 delta=DELTA)
    assert isinstance(result, ScoreAuditResult)
    assert result.verdict == "consistent" and not result.violation
    assert result.epsilon_lower_bound < 0.5
    assert result.claim_curve_p_value is None  # no mechanism described


def test_separating_scores_violate_a_claim_of_one() -> None:
    bits = _bits(2)
    result = audit_canary_scores(bits.astype(float), bits, claimed_epsilon=1.0, delta=DELTA)
    assert result.violation and result.verdict == "violation"
    # Steinke's bound with every one of the 1000 guesses right at the shared level
    # (2 methods, no mechanism): the same number the one-run audit gives at 97.5%
    steinke = one_run_audit(bits.astype(float), bits, DELTA, confidence=1 - 0.05 / 2)
    assert result.audits[0].result.epsilon_lower_bound == pytest.approx(
        steinke.epsilon_lower_bound)
    assert result.epsilon_lower_bound >= steinke.epsilon_lower_bound > 4.0
    # a claim above what a perfect audit of 1000 canaries can show is inconclusive
    assert audit_canary_scores(bits.astype(float), bits, claimed_epsilon=30.0,
                               delta=DELTA).verdict == "inconclusive"


def test_mechanism_curve_matches_the_accountant() -> None:
    mech = ClaimedMechanism(1.0, 0.01, 1000)
    curve = mech.curve(DELTA)
    step = float(np.diff(curve.epsilons).max())
    accountant = pld_epsilons([{(1.0, 0.01): 1000}], DELTA)[0]
    assert mech.epsilon(DELTA) == pytest.approx(accountant)
    assert abs(curve.epsilon(DELTA) - accountant) <= step + 1e-9, (curve.epsilon(DELTA),
                                                                     accountant, step)
    assert mech.curve(DELTA) is curve  # cached


def test_claim_curve_catches_noise_at_a_third_and_passes_correct_noise() -> None:
    """Gradient canaries of a simulated DP-SGD run (sigma 1, q 0.01, 1000 steps; epsilon
    1.83 at 1e-5): the correct run is consistent, noise at 0.3x the claimed is caught."""
    mech = ClaimedMechanism(1.0, 0.01, 1000)
    claim = mech.epsilon(DELTA)
    bits = _bits(3)
    good = audit_canary_scores(_dp_sgd_scores(bits, 1.0, mech, 4), bits,
                               claimed_epsilon=claim, delta=DELTA, mechanism=mech)
    assert not good.violation and good.verdict == "consistent"
    assert good.claim_curve_p_value is not None and good.claim_curve_p_value > 0.05
    bad = audit_canary_scores(_dp_sgd_scores(bits, 0.3, mech, 5), bits,
                              claimed_epsilon=claim, delta=DELTA, mechanism=mech)
    assert bad.violation
    assert bad.claim_curve_p_value is not None and bad.claim_curve_p_value < 0.05
    assert bad.audits[0].methods()["claim-curve"]["verdict"] == "violation"
    assert bad.mechanism_epsilon == pytest.approx(claim)


def test_several_scores_share_the_level() -> None:
    bits = _bits(6)
    rng = np.random.default_rng(7)
    result = audit_canary_scores({"a": rng.standard_normal(M), "b": bits + 0.0}, bits,
                                 claimed_epsilon=1.0, delta=DELTA)
    assert [a.name for a in result.audits] == ["a", "b"]
    assert result.audits[0].result.confidence == pytest.approx(1 - 0.05 / 4)
    assert result.violation and result.strongest.name == "b"


def test_report_files_hold_the_result(tmp_path: Path) -> None:
    bits = _bits(8)
    result = audit_canary_scores(bits + 0.0, bits, claimed_epsilon=1.0, delta=DELTA,
                                 out=tmp_path / "r", title="my JAX run")
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["verdict"] == "violation" and report["violation"] is True
    assert report["epsilon_lower_bound"] == pytest.approx(result.epsilon_lower_bound)
    assert report["one_run"]["canaries"] == M
    md = (tmp_path / "r" / "report.md").read_text()
    assert "my JAX run" in md and "VIOLATION" in md
    html = (tmp_path / "r" / "report.html").read_text()
    assert "data:image/png;base64," in html and "http" not in html.split("<body>")[1]


BAD = {
    "NaN score": (np.array([np.nan] + [0.0] * 19), np.zeros(20, bool)),
    "inf score": (np.array([np.inf] + [0.0] * 19), np.zeros(20, bool)),
    "lengths differ": (np.zeros(20), np.zeros(21, bool)),
    "bits are 2": (np.zeros(20), np.array([2] + [0] * 19)),
    "bits are floats": (np.zeros(20), np.zeros(20)),
    "2-D scores": (np.zeros((20, 2)), np.zeros(20, bool)),
    "object scores": (np.array([0.0] * 20, dtype=object), np.zeros(20, bool)),
    "too few canaries": (np.zeros(3), np.zeros(3, bool)),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_scores_or_bits_are_refused(case: str) -> None:
    scores, bits = BAD[case]
    with pytest.raises(ConfigError):
        audit_canary_scores(scores, bits, claimed_epsilon=1.0, delta=DELTA)


@pytest.mark.parametrize("kw", [
    {"claimed_epsilon": math.nan}, {"claimed_epsilon": -1.0}, {"delta": 0.0}, {"delta": 1.0},
    {"confidence": 1.0}, {"mechanism": ClaimedMechanism(0.0, 0.01, 10)},
    {"mechanism": ClaimedMechanism(1.0, 1.5, 10)}, {"mechanism": ClaimedMechanism(1.0, 0.1, 0)},
    {"mechanism": ClaimedMechanism(math.inf, 0.1, 10)},
])
def test_bad_claims_are_refused(kw: dict) -> None:
    args = {"claimed_epsilon": 1.0, "delta": DELTA, **kw}
    with pytest.raises(ConfigError):
        audit_canary_scores(np.zeros(20), np.zeros(20, bool), **args)
