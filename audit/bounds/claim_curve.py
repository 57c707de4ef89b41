"""The claimed mechanism's own trade-off curve, and the one-run test of canary counts against it.

A ledger describes its mechanism exactly: compositions of Poisson-subsampled Gaussian steps
(``(sigma, q) -> number of steps``). Its privacy profile ``delta(eps)`` (the larger of the
remove and add directions) comes from the accountant's pessimistic privacy-loss
distribution (:func:`fedlap_privacy.accountant.pld_sgm.sgm_pld` composed by
:func:`fedlap_privacy.accountant.pld_fft.compose`). A mechanism that is ``(eps,
delta(eps))``-DP for every eps is ``f``-DP with ``f = sup_eps f_{eps, delta(eps)}``, where
``f_{eps,delta}(x) = max(0, 1 - delta - e^eps x, e^-eps (1 - delta - x))`` (Dong, Roth, Su
2022, Proposition 2.12). Its ``fbar^-1(r)``, the smallest false-positive rate at which a test
reaches power ``r``, is then ``max(0, max_eps (r - delta(eps)) e^-eps,
max_eps 1 - delta(eps) - e^eps (1 - r))``.

The counts of a one-run audit are tested against this curve with the f-DP recursion of
Mahloujifar, Melis, Chaudhuri (ICML 2025; :func:`fedlap_privacy.audit.bounds.fdp.curve_p_value`),
which gives a p-value of "the run is the mechanism its ledger describes". Every
approximation errs towards the claim (a pessimistic PLD, a subset of eps values, a curve
tabulated on a grid and read at the grid point below), so a small p-value is a valid
rejection.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy.signal import lfilter
from scipy.special import expit

from fedlap_privacy.accountant.pld_fft import ComposedPLD, compose
from fedlap_privacy.accountant.pld_sgm import sgm_pld
from fedlap_privacy.audit.bounds.fdp import Inverse, curve_p_value
from fedlap_privacy.audit.bounds.one_run import perfect_counts
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.vocabulary import Notion, ThreatModel

__all__ = ["ClaimCurve", "ClaimCurveTest", "beyond_pld", "claim_curve_test", "ledger_steps"]

Steps = Mapping[tuple[float, float], int]

#: Loss grid of the curve's PLD (coarser than the accountant's 1e-4: still pessimistic).
CURVE_INTERVAL = 2e-3
#: Most eps values the profile keeps (evenly thinned: fewer eps only weaken the curve).
MAX_EPSILONS = 1500
#: Power values r where fbar^-1 is tabulated: logit(r) evenly from -LOGIT to +LOGIT.
LOGIT = 40.0
TABLE_POINTS = 8001


def beyond_pld(steps: Steps) -> str:
    """The line for a claimed mechanism beyond the PLD accountant's memory budget (what an
    audit can do instead: it takes no other accountant)."""
    described = ", ".join(f"{n} steps of sigma {s:g} at rate {q:g}"
                          for (s, q), n in sorted(steps.items()))
    return (f"the claimed mechanism ({described}) is beyond what the PLD accountant can "
            "discretise within its memory budget, so the audit cannot form its trade-off "
            "curve or its epsilon: audit the claimed epsilon alone, without describing the "
            "mechanism")


def _profile(pld: ComposedPLD) -> tuple[np.ndarray, np.ndarray]:
    """Grid indices ``j >= max(lower, 0)`` and ``delta`` at loss ``j h``:
    ``inf + sum_{i > j} p_i (1 - e^{(j - i) h})``, by suffix sums (the weighted one by a
    first-order recursion ``H_j = p_j + e^-h H_{j+1}``, all terms positive)."""
    p = pld.probs
    h = pld.interval
    tail = np.append(np.cumsum(p[::-1])[::-1][1:], 0.0)  # sum_{i > j} p_i
    weighted = lfilter([1.0], [1.0, -math.exp(-h)], p[::-1])[::-1]  # sum_{i >= j} p_i e^..
    g = math.exp(-h) * np.append(weighted[1:], 0.0)  # sum_{i > j} p_i e^{-(i - j) h}
    delta = np.clip(pld.infinity + tail - g, 0.0, 1.0)
    index = pld.lower + np.arange(len(p))
    keep = index >= 0
    return index[keep], delta[keep]


@dataclass(frozen=True)
class ClaimCurve:
    """The ``fbar^-1`` of a composition of subsampled Gaussian steps, tabulated.

    ``epsilons`` / ``deltas``: the privacy profile used (both directions, the larger);
    ``powers`` / ``rates``: ``fbar^-1`` at each tabulated power (non-decreasing).
    """

    steps: dict[tuple[float, float], int]
    epsilons: np.ndarray = field(repr=False)
    deltas: np.ndarray = field(repr=False)
    powers: list[float] = field(repr=False)
    rates: list[float] = field(repr=False)

    @classmethod
    def from_steps(cls, steps: Steps, delta: float = 1e-5) -> ClaimCurve:
        """The curve of ``steps`` (``(sigma, q) -> count``); ``delta`` only centres the
        FFT window of the composition (as the accountant's)."""
        clean = {(float(s), float(q)): int(n) for (s, q), n in steps.items()
                 if q > 0.0 and n > 0}
        if not clean:
            raise ConfigError("the claimed mechanism has no noisy step: no curve to test")
        if any(not (math.isfinite(s) and s > 0.0) or q > 1.0 for s, q in clean):
            raise ConfigError(f"every step needs sigma > 0 and 0 < q <= 1, got {sorted(clean)}")
        directions = []
        for remove in (True, False):
            try:
                parts = [(sgm_pld(s, q, remove, CURVE_INTERVAL), n)
                         for (s, q), n in clean.items()]
                pld = compose(parts, delta)
            except ConfigError:
                raise ConfigError(beyond_pld(clean)) from None
            directions.append((*_profile(pld), pld.infinity))
        # common eps grid: indices both directions cover (above its window a direction's
        # delta is its mass at infinity)
        start = max(int(index[0]) for index, _, _ in directions)
        stop = max(int(index[-1]) for index, _, _ in directions) + 1
        index = np.arange(start, stop)
        delta_both = np.zeros(len(index))
        for own, values, infinity in directions:
            on = np.full(len(index), infinity)
            pos = index - int(own[0])
            inside = pos < len(own)
            on[inside] = values[pos[inside]]
            delta_both = np.maximum(delta_both, on)
        thin = max(1, len(index) // MAX_EPSILONS)
        eps = index[::thin] * CURVE_INTERVAL
        deltas = delta_both[::thin]
        powers = expit(np.linspace(-LOGIT, LOGIT, TABLE_POINTS))
        rates = _inverse_table(eps, deltas, powers)
        return cls(clean, eps, deltas, powers.tolist(), rates.tolist())

    def inverse(self, r: float) -> float:
        """``fbar^-1(r)`` read at the tabulated power at or below ``r`` (0 below the table):
        never above the true value, so the test errs towards the claim."""
        i = bisect.bisect_right(self.powers, r) - 1
        return 0.0 if i < 0 else self.rates[i]

    def epsilon(self, delta: float) -> float:
        """The smallest tabulated eps whose delta is at most ``delta`` (a check against the
        accountant: never below its epsilon by more than the thinning step)."""
        ok = np.flatnonzero(self.deltas <= delta)
        return math.inf if len(ok) == 0 else float(self.epsilons[ok[0]])


def _inverse_table(eps: np.ndarray, deltas: np.ndarray, powers: np.ndarray) -> np.ndarray:
    """``fbar^-1`` at each power from the profile (module docstring), in row chunks."""
    out = np.empty(len(powers))
    scale_down, scale_up = np.exp(-eps), np.exp(np.minimum(eps, 700.0))
    for start in range(0, len(powers), 512):
        r = powers[start:start + 512, None]
        first = (r - deltas) * scale_down
        second = 1.0 - deltas - scale_up * (1.0 - r)
        out[start:start + 512] = np.maximum(np.maximum(first, second).max(axis=1), 0.0)
    return np.maximum.accumulate(np.minimum(out, 1.0))


def ledger_steps(ledger: Any) -> dict[tuple[float, float], int] | None:
    """The subsampled Gaussian steps of the composition a replayed
    :class:`~fedlap_privacy.state.ledger.PrivacyLedger` reports (its largest-epsilon client under
    the ``server`` threat model, every round at ``(q1, q2)`` otherwise); None for a ledger
    with no Gaussian steps."""
    from fedlap_privacy.accountant import composed_epsilon
    from fedlap_privacy.accountant.schedule import step_counts

    if not Notion(ledger.notion).gaussian or not ledger.entries:
        return None
    sigma, delta = ledger.sigma, ledger.delta
    if ledger.threat_model != ThreatModel.SERVER:
        groups = [[e.rates(selection_hidden=True) for e in ledger.entries]]
    else:
        per_client: dict[int, list[Any]] = {}
        for e in ledger.entries:
            for k in e.participants:
                per_client.setdefault(k, []).append(e.rates(selection_hidden=False))
        groups = list(per_client.values())
    if not groups or not any(groups):
        return None
    worst = max(groups, key=lambda g: composed_epsilon(g, sigma, delta, ledger.accountant))
    counts = step_counts([(rates, 1) for rates in worst])
    return {(float(sigma), q): n for q, n in counts.items()}


@dataclass(frozen=True)
class ClaimCurveTest:
    """Counts of a one-run audit tested against the claimed mechanism's curve.

    ``p_value``: Bonferroni over ``candidates`` (the smallest candidate p-value times their
    number, at most 1); ``floor``: the p-value a perfect score would have given with the
    coins that were drawn (``included`` of ``canaries``; the best this audit could show,
    known before the scores are read: ``inconclusive`` when it is not below the level).
    """

    p_value: float
    floor: float
    verdict: str
    canaries: int
    guesses: int
    correct: int
    k_plus: int
    k_minus: int
    candidates: int
    confidence: float
    included: int
    method: str = "claim-curve"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def claim_curve_test(
    curve: ClaimCurve | Inverse,
    canaries: int,
    counts: list[tuple[int, int, int, int]],
    confidence: float,
    *,
    included: int,
) -> ClaimCurveTest:
    """Test ``(k_plus, k_minus, r, v)`` counts, chosen before the bits were seen (a fixed
    grid, Bonferroni) or on another half (one entry), against ``curve`` at ``confidence``;
    ``included``: how many of the ``canaries`` coins came up included (the floor's perfect
    score, :func:`~fedlap_privacy.audit.bounds.one_run.perfect_counts`)."""
    if not counts:
        raise ConfigError("the claim-curve test needs at least one candidate")
    if not 0 <= included <= canaries:
        raise ConfigError(f"included must lie in 0..{canaries}, got {included}")
    inverse = curve.inverse if isinstance(curve, ClaimCurve) else curve
    n = len(counts)
    best_p, best = math.inf, counts[0]
    for entry in counts:
        _, _, r, v = entry
        p = curve_p_value(inverse, canaries, r, v)
        if p < best_p:
            best_p, best = p, entry
    kp, km, r, v = best
    p_value = min(1.0, best_p * n)
    floor = min(1.0, n * min(curve_p_value(inverse, canaries,
                                           *perfect_counts(a, b, canaries, included))
                             for a, b, _, _ in counts))
    level = 1.0 - confidence
    if p_value < level:
        verdict = "violation"
    elif floor >= level:
        verdict = "inconclusive"
    else:
        verdict = "consistent"
    return ClaimCurveTest(p_value, floor, verdict, canaries, r, v, kp, km, n, confidence,
                          included)
