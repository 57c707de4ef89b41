"""One-run privacy audit with canaries (Steinke, Nasr, Jagielski, NeurIPS 2023).

T. Steinke, M. Nasr, M. Jagielski, "Privacy auditing with one (1) training run",
NeurIPS 2023 (arXiv:2305.08846). ``m`` canaries are each included in the training data
independently with probability 1/2 (secret bits ``S_i``); the model is trained once, every
canary is scored, and the auditor guesses "in" for the ``k+`` highest scores, "out" for the
``k-`` lowest and abstains on the rest: ``r = k+ + k-`` guesses, ``v`` of them correct.

If the training algorithm is ``(eps, delta)``-DP with respect to each canary, the number of
correct guesses is controlled by the paper's approximate-DP (``delta > 0``) analysis, which
gives the following p-value. For a candidate ``eps`` let
``p = e^eps / (1 + e^eps)``,

* ``beta  = P[Binomial(r, p) >= v]``,
* ``alpha = max_{i=1..v} P[v - i <= Binomial(r, p) < v] / i``,
* ``p-value(eps, delta) = min(1, beta + 2 m delta alpha)``.

The audit rejects ``eps`` at level ``1 - confidence`` when ``p-value < 1 - confidence``; the
lower bound is the first ``eps`` at which the p-value reaches ``1 - confidence`` (the
p-value increases with ``eps``, so this is "the largest rejected ``eps``").

Choosing ``k+`` / ``k-`` after looking at the scores *and* the secret bits would make the
bound invalid. :func:`one_run_audit` therefore either takes them fixed, or searches a
data-independent grid of candidates with a Bonferroni correction (the level is split over
the grid), or chooses them on a random half of the canaries and reports the bound computed
on the other half only (the chosen half is then public, non-random data and ``m`` is the
size of the reporting half).

``method="fdp"`` replaces the p-value by the f-DP test of Mahloujifar, Melis, Chaudhuri
(ICML 2025) for the Gaussian trade-off family (:mod:`fedlap_privacy.audit.bounds.fdp`): the bound is
the epsilon at ``delta`` of the largest ``mu``-GDP the counts reject, with the same threshold
selection and its own ceiling. Only numpy / scipy are used (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, Literal

import numpy as np
from scipy.optimize import brentq
from scipy.special import bdtr, bdtrc, gammaln, log_expit

from fedlap_privacy.audit.bounds.fdp import fdp_lower_bound
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.secret_random import os_generator
from fedlap_privacy.state.canary_state import MIN_AUDIT_CANARIES

__all__ = [
    "COIN_TAIL",
    "METHODS",
    "OneRunResult",
    "check_coins",
    "one_run_audit",
    "one_run_candidate_counts",
    "one_run_candidate_grid",
    "one_run_ceiling",
    "one_run_lower_bound",
    "one_run_order",
    "one_run_p_value",
    "perfect_counts",
    "steinke_p_value",
]

Selection = Literal["bonferroni", "split"]
Method = Literal["steinke", "fdp"]
#: Bound methods: Steinke et al.'s (eps, delta) p-value, or the f-DP test of the Gaussian family.
METHODS: tuple[str, ...] = ("steinke", "fdp")

_EPS_MAX = 500.0  # far beyond any bound a finite audit can report (log of ~1e217)
_MIN_GUESSES = 16  # smallest r in the automatic grid (fewer guesses give tiny bounds)
#: Coin vectors whose count of included canaries is this improbable under fair coins (two
#: sides) are refused: the audit's guarantee is over fair coins, and a one-sided guess
#: scores the imbalance itself as evidence.
COIN_TAIL = 1e-6


def _check_counts(m: int, r: int, v: int) -> None:
    if not (isinstance(m, int | np.integer) and isinstance(r, int | np.integer)):
        raise ConfigError(f"m and r must be integers, got m={m!r}, r={r!r}")
    if not isinstance(v, int | np.integer):
        raise ConfigError(f"v must be an integer, got {v!r}")
    if m < 1:
        raise ConfigError(f"the audit needs at least one canary, got m={m}")
    if not 0 <= r <= m:
        raise ConfigError(f"the number of guesses r must lie in 0..m={m}, got r={r}")
    if not 0 <= v <= r:
        raise ConfigError(f"the number of correct guesses v must lie in 0..r={r}, got v={v}")


def _check_delta(delta: float) -> None:
    if not (math.isfinite(delta) and 0.0 <= delta < 1.0):
        raise ConfigError(f"delta must lie in [0, 1), got {delta}")


def _check_confidence(confidence: float) -> None:
    if not (math.isfinite(confidence) and 0.0 < confidence < 1.0):
        raise ConfigError(f"confidence must lie in (0, 1), got {confidence}")


def _check_method(method: str, delta: float) -> None:
    if method not in METHODS:
        raise ConfigError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "fdp" and delta <= 0.0:
        raise ConfigError(f"method 'fdp' needs delta > 0 (mu-GDP is never (eps, 0)-DP), "
                          f"got {delta}")


def _p_value(eps: float, delta: float, m: int, r: int, v: int) -> float:
    """Unchecked p-value (Steinke et al. 2023, ``delta > 0``); see :func:`one_run_p_value`."""
    if v == 0:
        return 1.0
    log_p = float(log_expit(eps))  # log(e^eps / (1 + e^eps)), stable for any eps
    log_q = float(log_expit(-eps))  # log(1 / (1 + e^eps))
    p = math.exp(log_p)
    # beta = P[B >= v] = P[B > v - 1]: the binomial survival function (scipy's bdtrc).
    beta_tail = float(bdtrc(v - 1, r, p))
    if delta == 0.0:
        return min(1.0, beta_tail)
    # alpha = max_i P[v-i <= B <= v-1] / i. The window sums are cumulative sums of the
    # pmf from k = v-1 downwards; the log-pmf is exact (gammaln) and the sum is taken
    # relative to its largest term, so nothing cancels and nothing underflows.
    k = np.arange(v - 1, -1, -1, dtype=np.float64)  # v-1, v-2, ..., 0
    log_pmf = gammaln(r + 1.0) - gammaln(k + 1.0) - gammaln(r - k + 1.0)
    log_pmf += k * log_p + (r - k) * log_q
    top = float(log_pmf.max())
    windows = np.cumsum(np.exp(log_pmf - top)) / np.arange(1, v + 1)
    alpha_tail = math.exp(top) * float(windows.max())
    return min(1.0, beta_tail + 2.0 * m * delta * alpha_tail)


def one_run_p_value(eps: float, delta: float, m: int, r: int, v: int) -> float:
    """p-value of "the mechanism is ``(eps, delta)``-DP" given ``v`` of ``r`` guesses right.

    Steinke, Nasr, Jagielski (NeurIPS 2023), the approximate-DP (``delta > 0``) p-value:
    with ``p = e^eps / (1 + e^eps)``, ``beta = P[Binomial(r, p) >= v]`` and
    ``alpha = max_{i=1..v} P[v - i <= Binomial(r, p) < v] / i``, the p-value is
    ``min(1, beta + 2 m delta alpha)``. ``m`` is the number of canaries whose inclusion was
    randomised (guessed or not). Increasing in ``eps``, decreasing in ``v``.
    """
    _check_counts(m, r, v)
    _check_delta(delta)
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ConfigError(f"eps must be finite and >= 0, got {eps}")
    return _p_value(float(eps), float(delta), int(m), int(r), int(v))


def _lower_bound(
    m: int, r: int, v: int, delta: float, level: float, at_least: float = 0.0
) -> float:
    """First ``eps`` where the p-value reaches ``level``; ``at_least`` is a shortcut.

    Returns 0 when ``eps = 0`` is not rejected. If the p-value at ``at_least`` already
    reaches ``level`` the bound is <= ``at_least`` and ``at_least`` itself is returned
    (callers that only want a maximum over candidates use this to skip work).
    """
    if v == 0 or _p_value(0.0, delta, m, r, v) >= level:
        return 0.0
    if at_least > 0.0 and _p_value(at_least, delta, m, r, v) >= level:
        return at_least
    lo, hi = max(0.0, at_least), max(1.0, 2.0 * at_least)
    while _p_value(hi, delta, m, r, v) < level:
        lo, hi = hi, 2.0 * hi
        if hi > _EPS_MAX:  # only reachable with delta = 0 and astronomically many guesses
            return _EPS_MAX
    return float(
        brentq(lambda e: _p_value(e, delta, m, r, v) - level, lo, hi, xtol=1e-9, rtol=1e-10)
    )


def _bound(
    method: str, m: int, r: int, v: int, delta: float, level: float, at_least: float = 0.0
) -> float:
    """The lower bound of ``method`` (``at_least`` only shortcuts Steinke's search)."""
    if method == "fdp":
        return fdp_lower_bound(m, r, v, delta, level)
    return _lower_bound(m, r, v, delta, level, at_least)


def one_run_lower_bound(
    m: int, r: int, v: int, delta: float, confidence: float = 0.95, method: Method = "steinke"
) -> float:
    """Empirical lower bound on epsilon from one run (Steinke, Nasr, Jagielski 2023).

    ``method="fdp"``: the f-DP bound of the Gaussian family instead
    (:func:`fedlap_privacy.audit.bounds.fdp.fdp_lower_bound`; Mahloujifar, Melis, Chaudhuri 2025).
    Steinke's (the default): the largest ``eps`` rejected at level ``1 - confidence``, i.e.
    the ``eps`` at which :func:`one_run_p_value` first reaches ``1 - confidence`` (found by
    bracketing then Brent's method); 0 when even ``eps = 0`` is not rejected. If the mechanism is
    ``(eps, delta)``-DP, the bound exceeds ``eps`` with probability at most
    ``1 - confidence`` over the canaries' secret inclusion bits.
    """
    _check_counts(m, r, v)
    _check_delta(delta)
    _check_confidence(confidence)
    _check_method(method, delta)
    return _bound(method, int(m), int(r), int(v), float(delta), 1.0 - confidence)


@lru_cache(maxsize=8192)
def _reach(m: int, r: int, v: int, delta: float, level: float, method: str = "steinke") -> float:
    """The bound of ``v`` correct among ``r`` guesses (cached: the ceilings ask often)."""
    return _bound(method, m, r, v, delta, level)


def _ceiling(m: int, r: int, delta: float, level: float, method: str = "steinke") -> float:
    return _reach(m, r, r, delta, level, method)


def one_run_ceiling(
    m: int, r: int, delta: float, confidence: float = 0.95, method: Method = "steinke"
) -> float:
    """The bound reported when all ``r`` guesses are right: the most ``r`` guesses can show
    whatever the coins (an audit's own ceiling also depends on the coins drawn:
    :attr:`OneRunResult.ceiling`).

    A claimed epsilon at or above it can never be refuted with these
    ``(m, r, delta, confidence)``. Reference values (Steinke et al. 2023 setting, 95%,
    delta 1e-5): ``m = 1000`` with ``r = 1000`` gives 5.78; with ``r = 100``, 3.47
    (``method="fdp"``: 12.34 and 5.55).
    """
    _check_counts(m, r, r)
    _check_delta(delta)
    _check_confidence(confidence)
    _check_method(method, delta)
    return _ceiling(int(m), int(r), float(delta), 1.0 - confidence, method)


def perfect_counts(k_plus: int, k_minus: int, m: int, included: int) -> tuple[int, int]:
    """``(r, v)`` of the guesses ``(k_plus, k_minus)`` under a perfect score (the
    ``included`` canaries scored above the others): every "in" guess is right while
    included canaries last, every "out" guess while the others last. With unbalanced coins
    a perfect score cannot make every guess right."""
    return k_plus + k_minus, min(k_plus, included) + min(k_minus, m - included)


def check_coins(included: np.ndarray) -> None:
    """A one-line ConfigError when the count of included canaries is one that fair coins
    give with probability below :data:`COIN_TAIL` (both sides): such bits were not drawn
    as the audit assumes (each included independently with probability 1/2), and nothing
    it could report would hold."""
    m = len(included)
    k = int(np.count_nonzero(included))
    tail = min(1.0, 2.0 * float(bdtr(min(k, m - k), m, 0.5)))
    if tail < COIN_TAIL:
        raise ConfigError(
            f"the inclusion bits are not fair coins: {k} of {m} canaries included, a count "
            f"fair coins give with probability {tail:.1g}; draw each bit independently with "
            "probability 1/2 from the operating system's randomness (e.g. secrets) before "
            "training")


def one_run_order(scores: np.ndarray) -> np.ndarray:
    """Indices of ``scores`` in ascending order, tied scores in an order drawn from the
    operating system's randomness. Tied canaries are exchangeable to the auditor: an order
    from a fixed seed could repeat the generator that drew the coins (``default_rng(0)``
    drawing both is the common idiom) and so guess the coins themselves."""
    scores = np.asarray(scores, dtype=np.float64)
    return np.lexsort((os_generator().random(len(scores)), scores))


def one_run_candidate_grid(m: int) -> list[tuple[int, int]]:
    """The fixed, data-independent ``(k+, k-)`` candidates searched by the audit.

    Total guesses ``r`` on the geometric grid ``m, m/2, m/4, ...`` down to 16 (or ``m``
    if smaller), each made even and split evenly, ``(r/2, r/2)``: as many "in" as "out"
    guesses. Balanced guesses are what makes the test hold for the coins actually drawn:
    when the scores tell nothing (all tied, or unrelated to the coins) the expected number
    of right guesses is ``r/2`` whatever the count ``k`` of included canaries, and its
    spread at most the fair binomial's, while a one-sided guess of ``r`` "in" is right
    ``r k / m`` times on average and so scores the coins' imbalance as evidence (527 of
    1,000 included gave bounds above 0 in 4% of audits of tied scores at 95%). Depends on
    ``m`` only: 6 candidates for ``m = 1000``, 13 for ``m = 10^5``.
    """
    if m < 2:
        raise ConfigError(f"the audit needs at least two canaries, got m={m}")
    grid: list[tuple[int, int]] = []
    r = m
    while r >= min(_MIN_GUESSES, m):
        half = r // 2
        if not grid or (half, half) != grid[-1]:
            grid.append((half, half))
        r //= 2
    return grid


@dataclass(frozen=True)
class OneRunResult:
    """Outcome of :func:`one_run_audit`.

    ``epsilon_lower_bound`` holds with probability >= ``confidence``; ``ceiling`` is the
    largest bound this audit could have reported with the coins that were drawn
    (``included`` of ``canaries``): the best candidate under a perfect score
    (:func:`perfect_counts`), at the same confidence correction, computed from the coins
    alone. ``canaries`` is the ``m`` of the p-value (for ``selection="split"``, the size of
    the reporting half); ``candidates`` is the number of ``(k+, k-)`` pairs the level was
    split over (1 when fixed or split).
    """

    epsilon_lower_bound: float
    ceiling: float
    canaries: int
    guesses: int
    correct: int
    confidence: float
    k_plus: int
    k_minus: int
    selection: str
    delta: float
    candidates: int
    method: str = "steinke"
    included: int | None = None

    def to_json(self) -> dict[str, Any]:
        """A plain dict (JSON-serialisable) with every field."""
        return asdict(self)

    def verdict(self, claimed_epsilon: float) -> str:
        """``"violation"``, ``"inconclusive"`` or ``"consistent"`` for a claimed epsilon.

        Violation: the lower bound exceeds the claim. Inconclusive: no violation and the
        claim is at or above the ceiling (with these coins this audit could never have
        refuted it). Consistent: otherwise (it could have refuted the claim and did not).
        """
        if not math.isfinite(claimed_epsilon) or claimed_epsilon < 0:
            raise ConfigError(f"claimed epsilon must be finite and >= 0, got {claimed_epsilon}")
        if self.epsilon_lower_bound > claimed_epsilon:
            return "violation"
        if claimed_epsilon >= self.ceiling:
            return "inconclusive"
        return "consistent"


def _guess_counts(
    order: np.ndarray, included: np.ndarray, k_plus: int, k_minus: int
) -> tuple[int, int]:
    """``(r, v)`` for guesses "in" on the last ``k_plus`` and "out" on the first ``k_minus``."""
    n = len(order)
    correct_in = int(included[order[n - k_plus :]].sum()) if k_plus else 0
    correct_out = int((~included[order[:k_minus]]).sum()) if k_minus else 0
    return k_plus + k_minus, correct_in + correct_out


def _best_over_grid(
    order: np.ndarray,
    included: np.ndarray,
    grid: list[tuple[int, int]],
    delta: float,
    level: float,
    method: str = "steinke",
) -> tuple[float, tuple[int, int], int, int]:
    """Best bound of ``method`` over ``grid`` (same ``m``, same level); ties keep the earliest
    candidate. When every bound is 0 the candidate with the smallest Steinke p-value at
    ``eps = 0`` is kept.
    """
    m = len(order)
    best, best_pair, best_rv = 0.0, grid[0], _guess_counts(order, included, *grid[0])
    best_p0 = math.inf
    for pair in grid:
        r, v = _guess_counts(order, included, *pair)
        if best > 0.0:
            if _ceiling(m, r, delta, level, method) <= best:  # cannot beat the best so far
                continue
            bound = _bound(method, m, r, v, delta, level, at_least=best)
            if bound > best:
                best, best_pair, best_rv = bound, pair, (r, v)
            continue
        bound = _bound(method, m, r, v, delta, level)
        if bound > 0.0:
            best, best_pair, best_rv = bound, pair, (r, v)
            continue
        p0 = _p_value(0.0, delta, m, r, v)
        if p0 < best_p0:
            best_p0, best_pair, best_rv = p0, pair, (r, v)
    return best, best_pair, best_rv[0], best_rv[1]


def _grid_ceiling(m: int, included: int, grid: Sequence[tuple[int, int]], delta: float,
                  level: float, method: str) -> float:
    """The largest bound any pair of ``grid`` reaches under a perfect score."""
    return max(_reach(m, *perfect_counts(a, b, m, included), delta, level, method)
               for a, b in grid)


def one_run_candidate_counts(
    scores: np.ndarray, included: np.ndarray, order: np.ndarray | None = None,
    grid: Sequence[tuple[int, int]] | None = None,
) -> list[tuple[int, int, int, int]]:
    """``(k_plus, k_minus, r, v)`` at every pair of ``grid`` (default
    :func:`one_run_candidate_grid`), the canaries in ``order`` (from :func:`one_run_order`;
    a fresh one when None): the counts the ``"bonferroni"`` selection of
    :func:`one_run_audit` chooses from when given the same order, for other tests of the
    same guesses (:mod:`fedlap_privacy.audit.bounds.claim_curve`)."""
    scores = np.asarray(scores, dtype=np.float64)
    included_arr = np.asarray(included).astype(bool)
    if scores.ndim != 1 or included_arr.shape != scores.shape or len(scores) < 2:
        raise ConfigError("scores and included must be 1-D arrays of the same length >= 2")
    m = len(scores)
    if order is None:
        order = one_run_order(scores)
    pairs = one_run_candidate_grid(m) if grid is None else [(int(a), int(b)) for a, b in grid]
    return [(a, b, *_guess_counts(order, included_arr, a, b)) for a, b in pairs]


def one_run_audit(
    scores: np.ndarray,
    included: np.ndarray,
    delta: float,
    confidence: float = 0.95,
    k_plus: int | None = None,
    k_minus: int | None = None,
    selection: Selection = "bonferroni",
    grid: Sequence[tuple[int, int]] | None = None,
    method: Method = "steinke",
    order: np.ndarray | None = None,
) -> OneRunResult:
    """One-run audit (Steinke, Nasr, Jagielski, NeurIPS 2023) from canary scores.

    ``scores``: any real-valued score per canary, higher = more likely included.
    ``included``: the secret inclusion bits (each drawn independently with probability
    1/2 before training; a count of included canaries that fair coins would almost never
    give is refused, :func:`check_coins`). Guesses "in" for the ``k_plus`` highest scores
    and "out" for the ``k_minus`` lowest, tied scores in an order from the operating
    system's randomness (:func:`one_run_order`; ``order``: such an order drawn once, to
    share the same guesses with another test). With both ``k_plus`` and ``k_minus`` given
    they are used as is (``selection="fixed"`` in the result). Otherwise:

    * ``"bonferroni"``: every pair of ``grid`` (default :func:`one_run_candidate_grid`;
      a custom grid must be fixed before the scores are seen) is tried and the best bound
      is reported, each computed at level ``(1 - confidence) / len(grid)``;
    * ``"split"``: the canaries are split at random into two halves; the pair with the
      best bound on the first half (over :func:`one_run_candidate_grid` of that half, no
      correction) is turned into score thresholds (its ``k+``-th highest and ``k-``-th
      lowest scores), the second half guesses with those thresholds, and only the second
      half's bound is reported (with ``m`` = its size; ``k_plus`` / ``k_minus`` are then
      the second half's counts, possibly 0 guesses and a bound of 0). Its ceiling is that
      of every guess right, the coins of the second half aside.

    Which to use: the ``2 m delta alpha`` term of the p-value grows with ``m delta``. For
    ``m delta`` well below 1 (e.g. 1000 canaries at ``delta = 1e-5``) the Bonferroni split
    costs little. Near or above 1 (``10^5`` canaries at ``1e-5``) every division of the
    level costs a lot and ``"split"`` (or ``k_plus`` / ``k_minus`` fixed in advance) gives
    much larger bounds; measured on a simulated Gaussian mechanism with sigma 1 and
    ``10^5`` canaries: 1.4 (Bonferroni, 37 candidates) vs 2.7 (split).

    ``method``: ``"steinke"`` (default) or ``"fdp"`` (the Gaussian-family f-DP bound,
    :mod:`fedlap_privacy.audit.bounds.fdp`), with the same selection and its own ceiling.
    """
    _check_delta(delta)
    _check_confidence(confidence)
    _check_method(method, delta)
    scores = np.asarray(scores, dtype=np.float64)
    included_arr = np.asarray(included)
    if scores.ndim != 1 or included_arr.shape != scores.shape:
        raise ConfigError("scores and included must be 1-D arrays of the same length")
    if not np.all(np.isfinite(scores)):
        raise ConfigError("scores must be finite")
    if included_arr.dtype != bool and not np.all(np.isin(included_arr, (0, 1))):
        raise ConfigError("included must hold booleans or 0/1")
    included_arr = included_arr.astype(bool)
    m = len(scores)
    if m < MIN_AUDIT_CANARIES:
        raise ConfigError(f"the audit needs at least {MIN_AUDIT_CANARIES} canaries, got {m}")
    check_coins(included_arr)
    k = int(included_arr.sum())
    if order is None:
        order = one_run_order(scores)
    elif np.asarray(order).shape != (m,) or \
            not np.array_equal(np.sort(order), np.arange(m)) or \
            np.any(np.diff(scores[order]) < 0):
        raise ConfigError("order must sort the scores (one_run_order)")
    level = 1.0 - confidence

    if (k_plus is None) != (k_minus is None):
        raise ConfigError("give both k_plus and k_minus, or neither")
    if k_plus is not None and k_minus is not None:
        if k_plus < 0 or k_minus < 0 or k_plus + k_minus < 1 or k_plus + k_minus > m:
            raise ConfigError(
                f"need k_plus, k_minus >= 0 and 1 <= k_plus + k_minus <= m={m}, "
                f"got k_plus={k_plus}, k_minus={k_minus}"
            )
        pair = (int(k_plus), int(k_minus))
        r, v = _guess_counts(order, included_arr, *pair)
        return OneRunResult(
            epsilon_lower_bound=_bound(method, m, r, v, delta, level),
            ceiling=_grid_ceiling(m, k, [pair], delta, level, method), canaries=m, guesses=r,
            correct=v, confidence=confidence, k_plus=pair[0], k_minus=pair[1],
            selection="fixed", delta=delta, candidates=1, method=method, included=k)

    if selection == "bonferroni":
        if grid is None:
            grid = one_run_candidate_grid(m)
        grid = [(int(a), int(b)) for a, b in grid]
        if not grid or any(a < 0 or b < 0 or not 1 <= a + b <= m for a, b in grid):
            raise ConfigError(f"every grid pair needs k_plus, k_minus >= 0, 1 <= sum <= m={m}")
        level_each = level / len(grid)
        bound, (kp, km), r, v = _best_over_grid(order, included_arr, grid, delta, level_each,
                                                method)
        return OneRunResult(
            epsilon_lower_bound=bound,
            ceiling=_grid_ceiling(m, k, grid, delta, level_each, method), canaries=m,
            guesses=r, correct=v, confidence=confidence, k_plus=kp, k_minus=km,
            selection="bonferroni", delta=delta, candidates=len(grid), method=method,
            included=k)

    if selection == "split":
        if m < 4:
            raise ConfigError(f"selection='split' needs at least 4 canaries, got {m}")
        rng = os_generator()
        perm = rng.permutation(m)
        half_a, half_b = np.sort(perm[: m // 2]), np.sort(perm[m // 2 :])
        m_a, m_b = len(half_a), len(half_b)
        scores_a = scores[half_a]
        order_a = np.lexsort((rng.random(m_a), scores_a))
        _, (kp_a, km_a), _, _ = _best_over_grid(
            order_a, included_arr[half_a], one_run_candidate_grid(m_a), delta, level, method
        )
        # Transfer the chosen cut as score thresholds: "in" for scores >= the k+-th highest
        # score of the first half, "out" for scores <= its k- -th lowest.
        t_plus = scores_a[order_a[m_a - kp_a]] if kp_a else np.inf
        t_minus = scores_a[order_a[km_a - 1]] if km_a else -np.inf
        scores_b = scores[half_b]
        kp = int((scores_b >= t_plus).sum())
        km = min(int((scores_b <= t_minus).sum()), m_b - kp)
        order_b = np.lexsort((rng.random(m_b), scores[half_b]))
        r, v = _guess_counts(order_b, included_arr[half_b], kp, km)
        included_b = int(included_arr[half_b].sum())
        return OneRunResult(
            epsilon_lower_bound=_bound(method, m_b, r, v, delta, level),
            ceiling=_grid_ceiling(m_b, included_b, [(kp, km)], delta, level, method),
            canaries=m_b, guesses=r, correct=v, confidence=confidence, k_plus=kp, k_minus=km,
            selection="split", delta=delta, candidates=1, method=method, included=included_b)

    raise ConfigError(f"selection must be 'bonferroni' or 'split', got {selection!r}")


def steinke_p_value(claimed_epsilon: float, delta: float, m: int,
                    counts: Sequence[tuple[int, int, int, int]]) -> float:
    """The p-value of "``(claimed_epsilon, delta)``-DP" from the candidates' counts
    ``(k_plus, k_minus, r, v)``: the smallest :func:`one_run_p_value` times their number
    (Bonferroni), at most 1. Below a level exactly when the Bonferroni bound at that level
    exceeds the claim."""
    best = min(_p_value(float(claimed_epsilon), float(delta), int(m), int(r), int(v))
               for _, _, r, v in counts)
    return min(1.0, best * len(counts))
