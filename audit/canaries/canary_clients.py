"""Canary-client epsilon estimation for client-level DP federated learning.

G. Andrew, P. Kairouz, S. Oh, A. Oprea, H. B. McMahan, V. M. Suriyakumar, "One-shot
empirical privacy estimation for federated learning", ICLR 2024 (arXiv:2302.03098).

Canary clients send a fixed random direction ``c_j`` (scaled to the clipping norm) as
their update. The statistic of a canary is the cosine between ``c_j`` and the final model
delta (:func:`canary_cosines`), or the largest cosine with any round's delta ("all
iterates", :func:`max_cosines_over_rounds`). A canary that was never inserted is a random
direction independent of the model, so its cosine with a fixed vector in ``R^d`` has the
density proportional to ``(1 - t^2)^((d-3)/2)`` on ``[-1, 1]`` (``(t+1)/2`` is
``Beta((d-1)/2, (d-1)/2)``), mean 0 and variance exactly ``1/d``; for large ``d`` it is
``N(0, 1/d)`` (the paper's closed-form null). The inserted canaries' cosines are summarised by a
Gaussian ``N(mu_hat, sigma_hat^2)`` and epsilon is estimated as the epsilon at ``delta``
between the null and that Gaussian (:func:`gaussian_pair_epsilon`, the exact privacy
profile of a pair of Gaussians; see also T. Steinke, "Composition of differential privacy
& privacy amplification by subsampling", arXiv:2210.00597).

This is an *estimate* (it assumes the cosines are Gaussian), not a bound with a
confidence level; for a bound use :mod:`fedlap_privacy.audit.bounds.one_run` on the same
statistics. Only numpy / scipy are used (no torch).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
from scipy.optimize import brentq, minimize_scalar
from scipy.special import betainc, betaincinv, log_ndtr, ndtri

from fedlap_privacy.errors import ConfigError

__all__ = [
    "CanaryClientEstimate",
    "canary_client_epsilon",
    "canary_cosines",
    "cosine_null_threshold_epsilon",
    "gaussian_epsilon",
    "gaussian_pair_epsilon",
    "max_cosines_over_rounds",
]

Null = Literal["closed-form", "empirical"]

#: Below this dimension the closed-form null uses the exact cosine law (as the authors do).
EXACT_NULL_BELOW = 1000


def _check_delta(delta: float) -> None:
    if not (math.isfinite(delta) and 0.0 < delta < 1.0):
        raise ConfigError(f"delta must lie in (0, 1), got {delta}")


def _as_directions(canary_directions: np.ndarray) -> np.ndarray:
    c = np.asarray(canary_directions, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] < 1 or c.shape[1] < 2:
        raise ConfigError(f"canary_directions must have shape (n, d) with d >= 2, got {c.shape}")
    norms = np.linalg.norm(c, axis=1)
    if not np.all(np.isfinite(norms)) or np.any(norms == 0):
        raise ConfigError("every canary direction must be finite and non-zero")
    return c / norms[:, None]


def canary_cosines(canary_directions: np.ndarray, model_delta: np.ndarray) -> np.ndarray:
    """Cosine between each canary direction ``(n, d)`` and the model delta ``(d,)``.

    The statistic of Andrew et al. (ICLR 2024): ``<c_j, Delta> / (|c_j| |Delta|)``
    (shape ``(n,)``). The directions need not be normalised.
    """
    c = _as_directions(canary_directions)
    delta = np.asarray(model_delta, dtype=np.float64)
    if delta.shape != (c.shape[1],):
        raise ConfigError(f"model_delta must have shape ({c.shape[1]},), got {delta.shape}")
    norm = float(np.linalg.norm(delta))
    if not math.isfinite(norm) or norm == 0:
        raise ConfigError("model_delta must be finite and non-zero")
    return c @ (delta / norm)


def max_cosines_over_rounds(canary_directions: np.ndarray, deltas: np.ndarray) -> np.ndarray:
    """The "all iterates" statistic: max over rounds of the cosine with each round's delta.

    ``deltas`` has shape ``(rounds, d)`` (one model delta per round). Andrew et al. (ICLR
    2024), "all iterates" threat model: the adversary sees every round. The null law of a
    max over rounds is not ``N(0, 1/d)``: use ``null="empirical"`` (unobserved canaries)
    with this statistic.
    """
    c = _as_directions(canary_directions)
    d = np.asarray(deltas, dtype=np.float64)
    if d.ndim != 2 or d.shape[1] != c.shape[1] or d.shape[0] < 1:
        raise ConfigError(f"deltas must have shape (rounds, {c.shape[1]}), got {d.shape}")
    norms = np.linalg.norm(d, axis=1)
    if not np.all(np.isfinite(norms)) or np.any(norms == 0):
        raise ConfigError("every round's delta must be finite and non-zero")
    return (c @ (d / norms[:, None]).T).max(axis=1)


# ---------------------------------------------------------------------------------------
# epsilon between Gaussians


def _solve_epsilon(log_delta_at: Any, delta: float) -> float:
    """Smallest ``eps >= 0`` with ``log_delta_at(eps) <= log(delta)`` (non-increasing)."""
    target = math.log(delta)
    if log_delta_at(0.0) <= target:
        return 0.0
    lo, hi = 0.0, 1.0
    while log_delta_at(hi) > target:
        lo, hi = hi, 2.0 * hi
        if hi > 1e4:
            raise ConfigError("epsilon is unbounded for these distributions (delta too small)")
    return float(brentq(lambda e: log_delta_at(e) - target, lo, hi, xtol=1e-12, rtol=1e-12))


def gaussian_epsilon(sigma: float, delta: float, sensitivity: float = 1.0) -> float:
    """Epsilon of the Gaussian mechanism with noise ``sigma`` at ``delta`` (exact).

    The analytic Gaussian mechanism (Balle & Wang, ICML 2018, Theorem 8): with
    ``mu = sensitivity / sigma`` the mechanism is ``(eps, delta)``-DP iff
    ``Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu) <= delta``; this solves it for the
    smallest ``eps`` (computed in log space).
    """
    _check_delta(delta)
    if not (math.isfinite(sigma) and sigma > 0 and math.isfinite(sensitivity)):
        raise ConfigError(f"sigma must be finite and > 0, got {sigma}")
    mu = abs(sensitivity) / sigma
    if mu == 0:
        return 0.0

    def log_delta_at(eps: float) -> float:
        first = float(log_ndtr(mu / 2 - eps / mu))
        second = eps + float(log_ndtr(-mu / 2 - eps / mu))
        if second >= first:
            return -math.inf
        return first + math.log1p(-math.exp(second - first))

    return _solve_epsilon(log_delta_at, delta)


def _log_sub(x: float, y: float) -> float:
    """``log(e^x - e^y)`` for ``x >= y`` (``-inf`` when equal)."""
    if y >= x:
        return -math.inf
    return x + math.log1p(-math.exp(y - x))


def _log_mass_above(mu: float, s: float, a: float, b: float, c: float) -> float:
    """``log P[a Y^2 + b Y + c > 0]`` for ``Y ~ N(mu, s^2)`` (exact, via normal CDFs)."""
    if a == 0.0:
        if b == 0.0:
            return 0.0 if c > 0 else -math.inf
        t = -c / b
        z = (t - mu) / s
        return float(log_ndtr(-z)) if b > 0 else float(log_ndtr(z))
    disc = b * b - 4.0 * a * c
    if disc <= 0.0:  # no sign change: the quadratic has the sign of a (almost) everywhere
        return 0.0 if a > 0 else -math.inf
    # Roots without cancellation (also when a is tiny: one root is then far away).
    q = -0.5 * (b + math.copysign(math.sqrt(disc), b))
    roots = sorted((q / a, c / q))  # q != 0 since disc > 0
    z1, z2 = (roots[0] - mu) / s, (roots[1] - mu) / s
    if a > 0:  # outside the roots
        return float(np.logaddexp(log_ndtr(z1), log_ndtr(-z2)))
    # between the roots: Phi(z2) - Phi(z1), from the tail where it does not cancel
    if z1 > 0:
        return _log_sub(float(log_ndtr(-z1)), float(log_ndtr(-z2)))
    return _log_sub(float(log_ndtr(z2)), float(log_ndtr(z1)))


def gaussian_pair_epsilon(mu1: float, s1: float, mu2: float, s2: float, delta: float) -> float:
    """Epsilon at ``delta`` between ``N(mu1, s1^2)`` and ``N(mu2, s2^2)`` (both directions).

    Andrew et al. (ICLR 2024), after Steinke (2022, arXiv:2210.00597): the
    privacy loss ``L(y) = ln f1(y) - ln f2(y) = a y^2 + b y + c`` with
    ``a = (s2^-2 - s1^-2) / 2``, ``b = mu1/s1^2 - mu2/s2^2``,
    ``c = ((mu2/s2)^2 - (mu1/s1)^2) / 2 + ln s2 - ln s1``;
    ``delta_12(eps) = P_1[L > eps] - e^eps P_2[L > eps]`` (the hockey-stick divergence)
    with both probabilities computed exactly from the roots of the quadratic, likewise
    ``delta_21`` with ``-L``; the result is the smallest ``eps >= 0`` with
    ``max(delta_12, delta_21)(eps) <= delta``. With ``s1 == s2`` it equals
    :func:`gaussian_epsilon` with ``sigma = s1 / |mu1 - mu2|``.
    """
    _check_delta(delta)
    for name, value in (("mu1", mu1), ("mu2", mu2)):
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be finite, got {value}")
    for name, value in (("s1", s1), ("s2", s2)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} must be finite and > 0, got {value}")
    a = 0.5 * (s2**-2 - s1**-2)
    b = mu1 / s1**2 - mu2 / s2**2
    c = 0.5 * ((mu2 / s2) ** 2 - (mu1 / s1) ** 2) + math.log(s2) - math.log(s1)

    def log_delta_at(eps: float) -> float:
        # delta_12: region L > eps under N1 and N2; delta_21: region -L > eps.
        d12 = _log_sub(
            _log_mass_above(mu1, s1, a, b, c - eps), eps + _log_mass_above(mu2, s2, a, b, c - eps)
        )
        d21 = _log_sub(
            _log_mass_above(mu2, s2, -a, -b, -c - eps),
            eps + _log_mass_above(mu1, s1, -a, -b, -c - eps),
        )
        return max(d12, d21)

    return _solve_epsilon(log_delta_at, delta)


# ---------------------------------------------------------------------------------------
# exact cosine null (small d)


def _cosine_log_sf(t: np.ndarray, d: int) -> np.ndarray:
    """``log P[X >= t]`` for the cosine ``X`` of a uniform direction with a fixed one in R^d."""
    h = 0.5 * (d - 1)
    with np.errstate(divide="ignore"):
        # P[X >= t] = P[X <= -t] = I_{(1-t)/2}(h, h) by symmetry.
        return np.log(betainc(h, h, np.clip((1.0 - t) / 2.0, 0.0, 1.0)))


def cosine_null_threshold_epsilon(mu: float, std: float, d: int, delta: float) -> float:
    """Epsilon from threshold tests between the exact cosine null and ``N(mu, std^2)``.

    For small ``d`` the cosine of an unobserved canary follows the exact law with density
    proportional to ``(1 - t^2)^((d-3)/2)``; Andrew et al. (ICLR 2024, and their
    released code) then estimate epsilon from the tests "cosine >= t" as
    ``max_t max(ln((1 - delta - FNR(t)) / FPR(t)), ln((1 - delta - FPR(t)) / FNR(t)))``
    with ``FPR(t) = P_null[X >= t]`` (exact, regularised incomplete beta) and
    ``FNR(t) = P[N(mu, std^2) < t]``. Here the maximum over ``t`` is found on a grid over
    ``[null quantile delta, alternative quantile 1 - delta]`` and refined with a bounded
    scalar search. For an equal-variance Gaussian null this equals the two-Gaussian
    epsilon (threshold tests are then the likelihood-ratio tests).
    """
    _check_delta(delta)
    if not (isinstance(d, int | np.integer) and d >= 3):
        raise ConfigError(f"the exact cosine law needs an integer d >= 3, got {d!r}")
    if not (math.isfinite(mu) and mu > 0):
        raise ConfigError(f"mu must be > 0 (above the null's mean 0), got {mu}")
    if not (math.isfinite(std) and std > 0):
        raise ConfigError(f"std must be finite and > 0, got {std}")
    h = 0.5 * (d - 1)
    lo = 2.0 * float(betaincinv(h, h, delta)) - 1.0  # P_null[X <= lo] = delta
    hi = mu + std * float(ndtri(1.0 - delta))  # P_alt[Y <= hi] = 1 - delta
    log1m_delta = math.log1p(-delta)

    def bounds(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        log_fpr = _cosine_log_sf(t, d)
        log_fnr = log_ndtr((t - mu) / std)
        with np.errstate(divide="ignore", invalid="ignore"):
            # ln(1 - delta - FNR) and ln(1 - delta - FPR) in log space.
            num1 = log1m_delta + np.log1p(-np.exp(log_fnr - log1m_delta))
            num2 = log1m_delta + np.log1p(-np.exp(log_fpr - log1m_delta))
            e1 = np.where(np.isfinite(num1), num1 - log_fpr, -np.inf)
            e2 = np.where(np.isfinite(num2), num2 - log_fnr, -np.inf)
        return np.nan_to_num(e1, nan=-np.inf), np.nan_to_num(e2, nan=-np.inf)

    if hi <= lo:
        return 0.0
    grid = np.linspace(lo, hi, 4001)
    best = 0.0
    step = grid[1] - grid[0]
    for which in (0, 1):
        values = bounds(grid)[which]
        i = int(np.argmax(values))
        if not np.isfinite(values[i]):
            continue
        left, right = max(lo, grid[i] - step), min(hi, grid[i] + step)
        found = minimize_scalar(
            lambda t, w=which: -float(bounds(np.array([t]))[w][0]),
            bounds=(left, right),
            method="bounded",
            options={"xatol": 1e-14 + 1e-10 * step},
        )
        best = max(best, float(values[i]), -float(found.fun))
    return best


# ---------------------------------------------------------------------------------------
# the estimate


@dataclass(frozen=True)
class CanaryClientEstimate:
    """Outcome of :func:`canary_client_epsilon` (an estimate, not a bound).

    ``mean`` / ``std``: the Gaussian fitted to the inserted canaries' cosines;
    ``null_mean`` / ``null_std``: the null's (``0`` and ``d^-1/2`` for the closed form);
    ``null_law``: ``"gaussian"`` or ``"exact-cosine"`` (exact law, threshold tests).
    """

    epsilon: float
    delta: float
    mean: float
    std: float
    null: str
    null_law: str
    null_mean: float
    null_std: float
    dimension: int | None
    observed: int
    unobserved: int

    def to_json(self) -> dict[str, Any]:
        """A plain dict (JSON-serialisable) with every field."""
        return asdict(self)


def _sample(values: np.ndarray | None, name: str) -> np.ndarray:
    if values is None:
        raise ConfigError(f"{name} are required")
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size < 2:
        raise ConfigError(f"{name} need at least 2 values to fit a Gaussian, got {x.size}")
    if not np.all(np.isfinite(x)):
        raise ConfigError(f"{name} must be finite")
    if float(np.std(x)) == 0.0:
        raise ConfigError(f"{name} are all equal: a Gaussian cannot be fitted")
    return x


def canary_client_epsilon(
    observed_cosines: np.ndarray,
    d: int | None,
    delta: float,
    null: Null = "closed-form",
    unobserved_cosines: np.ndarray | None = None,
    exact_null: bool | None = None,
) -> CanaryClientEstimate:
    """Epsilon estimate from canary clients (Andrew et al., ICLR 2024).

    ``observed_cosines``: the statistic of the canaries that were inserted (fitted by a
    Gaussian ``N(mean, std^2)``, sample mean and unbiased standard deviation).
    ``null="closed-form"``: the unobserved canaries' cosine follows the law of a random
    direction in ``R^d``: ``N(0, 1/d)`` (:func:`gaussian_pair_epsilon`), or, when
    ``exact_null`` is true (default: when ``d < 1000``, as the authors' code does), the
    exact law with threshold tests (:func:`cosine_null_threshold_epsilon`).
    ``null="empirical"``: a Gaussian fitted to ``unobserved_cosines`` (canaries that were
    generated but never inserted); required for the all-iterates statistic.
    """
    _check_delta(delta)
    obs = _sample(observed_cosines, "observed_cosines")
    mean, std = float(obs.mean()), float(obs.std(ddof=1))
    if null == "closed-form":
        if d is None or not isinstance(d, int | np.integer) or d < 3:
            raise ConfigError(f"the closed-form null needs the model dimension d >= 3, got {d!r}")
        if unobserved_cosines is not None:
            raise ConfigError("unobserved_cosines are only used with null='empirical'")
        use_exact = d < EXACT_NULL_BELOW if exact_null is None else bool(exact_null)
        null_mean, null_std = 0.0, float(d) ** -0.5
        if use_exact:
            eps = cosine_null_threshold_epsilon(mean, std, int(d), delta)
        else:
            eps = gaussian_pair_epsilon(null_mean, null_std, mean, std, delta)
        return CanaryClientEstimate(
            epsilon=eps,
            delta=delta,
            mean=mean,
            std=std,
            null=null,
            null_law="exact-cosine" if use_exact else "gaussian",
            null_mean=null_mean,
            null_std=null_std,
            dimension=int(d),
            observed=int(obs.size),
            unobserved=0,
        )
    if null == "empirical":
        if exact_null:
            raise ConfigError("exact_null applies to null='closed-form' only")
        unobs = _sample(unobserved_cosines, "unobserved_cosines")
        null_mean, null_std = float(unobs.mean()), float(unobs.std(ddof=1))
        return CanaryClientEstimate(
            epsilon=gaussian_pair_epsilon(null_mean, null_std, mean, std, delta),
            delta=delta,
            mean=mean,
            std=std,
            null=null,
            null_law="gaussian",
            null_mean=null_mean,
            null_std=null_std,
            dimension=None if d is None else int(d),
            observed=int(obs.size),
            unobserved=int(unobs.size),
        )
    raise ConfigError(f"null must be 'closed-form' or 'empirical', got {null!r}")
