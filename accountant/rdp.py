"""Rényi DP of the sampled Gaussian mechanism and its conversion to (epsilon, delta).

Contract (docs/accounting.md#sampled-gaussian-mechanism): one access to private data
Poisson-samples every record independently with probability ``q``, clips each record's
contribution to L2 norm ``C``, sums, and adds ``N(0, sigma^2 C^2 I)`` once to the sum.
Neighbouring datasets differ by adding or removing one record. The mechanism's RDP at order
``alpha > 1`` is ``log(A_alpha) / (alpha - 1)`` with
(Mironov, Talwar, Zhang 2019, Eq. 4)

    A_alpha = E_{z ~ N(0, sigma^2)} [ (1 - q + q * exp((2z - 1) / (2 sigma^2)))^alpha ].

How it is computed, exactly and for all orders at once:

* integer orders: the finite binomial sum of Mironov et al. section 3.3, rewritten as
  ``A - 1 = sum_{k>=2} C(alpha,k) (1-q)^(alpha-k) q^k expm1((k^2-k)/(2 sigma^2))`` — every
  term positive, summed in log space, so ``log A`` keeps full relative precision even when
  it is ~1e-12 (large sigma, small q);
* fractional orders: the expectation above as an integral, evaluated by the trapezoidal rule
  on a uniform grid (below sigma 0.01, on two windows around the integrand's two bumps). The
  integrand is analytic in a strip around the real axis and decays like a Gaussian, so the
  rule converges exponentially (to ~1e-15 here). Its integrand is
  ``(1+u)^alpha - 1 - alpha u`` with ``u = q (L - 1)``, ``E[L] = 1`` — non-negative, so
  nothing cancels. This replaces the signed two-sided erfc series, whose alternating tail
  decays only polynomially and which older implementations cut off with an absolute
  threshold (under-reporting RDP for large sigma) or bound by summing absolute values
  (over-reporting). The tests check both kinds of order against mpmath.

``rdp_to_epsilon`` is Balle et al. 2020, Thm 21 (as Opacus and dp-accounting use it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from fedlap_privacy.errors import ConfigError

__all__ = ["DEFAULT_ORDERS", "EXTENDED_ORDERS", "rdp_to_epsilon", "sgm_rdp"]

#: The paper's and Opacus's default grid: 1.1, 1.2, ..., 10.9 and 12, 13, ..., 63.
DEFAULT_ORDERS: np.ndarray = np.concatenate([1 + np.arange(1, 100) / 10.0, np.arange(12, 64)])
#: A larger grid in the style of dp-accounting (adds 11 and 128 ... 1024).
EXTENDED_ORDERS: np.ndarray = np.sort(
    np.concatenate([DEFAULT_ORDERS, [11.0, 128.0, 256.0, 512.0, 1024.0]])
)

_MAX_CELLS = 2_000_000  # quadrature cells evaluated at once
#: cost bounds of one sgm_rdp call, checked before anything is allocated (each array of the
#: work is 8 bytes a cell; the quadrature is chunked to _MAX_CELLS cells at a time)
_MAX_TABLE = 10_000_000  # integer orders: the (orders x max order) binomial table
_MAX_GRID = 5_000_000  # fractional orders: points of the quadrature grid
_MAX_EVALUATIONS = 100_000_000  # fractional orders: orders x grid points


def _as_orders(orders: Sequence[float] | np.ndarray) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(orders, dtype=float))
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("RDP orders must be a non-empty list of numbers > 1")
    bad = arr[~(np.isfinite(arr) & (arr > 1))]
    if bad.size:
        raise ValueError(f"RDP order {bad[0]:g} is invalid: orders must be finite numbers > 1")
    return arr


@lru_cache(maxsize=16)
def _integer_tables(orders: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(alpha, k, log C(alpha, k)) on the grid k = 2..max alpha; -inf where k > alpha."""
    top = max(orders)
    log_factorial = np.array([math.lgamma(n + 1.0) for n in range(top + 1)])
    ai = np.asarray(orders)[:, None]
    ki = np.arange(2, top + 1)[None, :]
    inside = ki <= ai
    log_binom = np.where(
        inside,
        log_factorial[ai] - log_factorial[ki] - log_factorial[np.where(inside, ai - ki, 0)],
        -np.inf,
    )
    return ai.astype(float), ki.astype(float), log_binom


def _log_expm1(x: np.ndarray) -> np.ndarray:
    """log(exp(x) - 1) for x > 0, accurate for tiny and huge x."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x > 1.0, x + np.log1p(-np.exp(-x)), np.log(np.expm1(np.minimum(x, 1.0))))


def _log_a_minus_1_integer(q: float, sigma: float, orders: np.ndarray) -> np.ndarray:
    """log(A_alpha - 1) for integer orders (finite sum, Mironov et al. 2019 section 3.3)."""
    a, k, log_binom = _integer_tables(tuple(int(o) for o in orders))
    log_terms = (
        log_binom
        + (a - k) * np.log1p(-q)
        + k * np.log(q)
        + _log_expm1((k * k - k) / (2.0 * sigma**2))
    )
    return _logsumexp_rows(log_terms)


def _logsumexp_rows(x: np.ndarray) -> np.ndarray:
    top = np.max(x, axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return (top + np.log(np.sum(np.exp(x - top), axis=1, keepdims=True)))[:, 0]


#: below this sigma the fractional-order integrand is two narrow bumps (see _two_bump_grid)
_NARROW_SIGMA = 0.01


def _log_a_minus_1_fractional(q: float, sigma: float, orders: np.ndarray) -> np.ndarray:
    """log(A_alpha - 1) for any orders by trapezoidal quadrature of Mironov et al. Eq. 4.

    The integrand phi(z) g(z), g = (1+u)^alpha - 1 - alpha u, u = q (exp((2z-1)/(2 sigma^2)) - 1),
    is analytic for |Im z| < pi sigma^2. Its logarithm rises for z < 0 and falls for z > alpha
    at least as fast as a Gaussian of width sigma, so on [-10 sigma, alpha + 10 sigma] with step
    min(sigma/2, 0.4 sigma^2) the truncation, Gaussian-discretisation and strip errors are all
    below exp(-40) relative. That grid has ~alpha / sigma^2 points; below ``_NARROW_SIGMA`` the
    two-bump grid of :func:`_two_bump_grid` replaces it (a few hundred points per order).
    """
    if sigma < _NARROW_SIGMA:
        z, step = _two_bump_grid(sigma, orders)
        return _log_integral(orders[:, None], *_z_terms(q, sigma, z)) + np.log(step)
    step = min(0.5 * sigma, 0.4 * sigma**2)
    z = np.arange(-10.0 * sigma, max(float(np.max(orders)), 0.0) + 10.0 * sigma + step, step)
    terms = _z_terms(q, sigma, z)
    chunk = max(1, _MAX_CELLS // z.size)  # bound the memory of the (orders x grid) arrays
    return np.concatenate([
        _log_integral(orders[i : i + chunk, None], *terms) + np.log(step)
        for i in range(0, orders.size, chunk)
    ])


def _two_bump_grid(sigma: float, orders: np.ndarray) -> tuple[np.ndarray, float]:
    """Per order, the points z of [-20 sigma, 20 sigma] and [alpha - 20 sigma, alpha + 20 sigma]
    with step sigma/4: shape (orders, points), and the step.

    For sigma < 0.01 the integrand is below (1 + alpha q) phi(z) + phi(z - alpha)
    exp(alpha (alpha - 1) / (2 sigma^2)), since 1 + u = (1 - q) + q L <= max(1, L): two
    Gaussian bumps of width sigma at 0 and at alpha > 1. Outside the two windows it is
    below exp(-200) of their mass. Both windows lie at least 0.3 from z ~ 1/2, where the
    singularity of (1 + u)^alpha sits (Im z = pi sigma^2), so on each window the integrand is
    analytic in a disc of radius 0.3 > 30 sigma, and the trapezoidal rule with step h on a bump
    of width sigma errs by about exp(-2 pi^2 sigma^2 / h^2) = exp(-316) relative.
    """
    step = sigma / 4.0
    offsets = np.arange(-80, 81) * step
    z = np.concatenate([np.broadcast_to(offsets, (orders.size, offsets.size)),
                        orders[:, None] + offsets[None, :]], axis=1)
    return z, step


def _z_terms(
    q: float, sigma: float, z: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """u, log(1 + u), log(u) (where u > 0) and log phi(z) at the quadrature points ``z``."""
    x = (2.0 * z - 1.0) / (2.0 * sigma**2)  # log of the likelihood ratio L
    u = q * np.expm1(np.minimum(x, 700.0))  # u = q (L - 1); where x > 700 only "big" is used
    log1p_u = np.where(x > 30.0, np.logaddexp(np.log(q) + x, np.log1p(-q)), np.log1p(u))
    log_phi = -0.5 * (z / sigma) ** 2 - 0.5 * np.log(2.0 * np.pi * sigma**2)
    with np.errstate(divide="ignore"):
        log_u = np.log(q) + _log_expm1(np.maximum(x, 1e-300))  # used only where u > 0
    return u, log1p_u, log_u, log_phi


def _log_integral(
    a: np.ndarray, u: np.ndarray, log1p_u: np.ndarray, log_u: np.ndarray, log_phi: np.ndarray
) -> np.ndarray:
    """log sum_z phi(z) g(z) for a column of orders ``a`` (see the caller)."""
    v = a * log1p_u  # log (1+u)^alpha
    with np.errstate(over="ignore"):
        au = a * u
    # log g in three regimes, each evaluated only where it is accurate
    big = v > 2.0  # (1+u)^a >> 1 + a u; here u > 0
    small = (np.abs(au) < 1e-3) & ~big
    mid = ~(big | small)
    log_g = np.empty_like(v)
    a_full = np.broadcast_to(a, v.shape)
    log_1p_au = np.logaddexp(0.0, np.log(a_full[big]) + np.broadcast_to(log_u, v.shape)[big])
    log_g[big] = v[big] + np.log1p(-np.exp(log_1p_au - v[big]))
    log_g[mid] = np.log(np.expm1(v[mid]) - au[mid])
    us, as_ = np.broadcast_to(u, v.shape)[small], a_full[small]
    coef = as_ * (as_ - 1.0) / 2.0  # sum_{j>=2} C(a, j) u^j, |a u| < 1e-3: 6 terms, < 1e-18
    series = coef * us**2
    for j in range(3, 8):
        coef = coef * (as_ - j + 1) / j
        series = series + coef * us**j
    with np.errstate(divide="ignore"):
        log_g[small] = np.log(series)
    return _logsumexp_rows(log_phi + log_g)


def sgm_rdp(q: float, sigma: float, orders: Sequence[float] | np.ndarray) -> np.ndarray:
    """RDP of one sampled Gaussian step at each order: ``log(A_alpha)/(alpha-1)``
    (docs/accounting.md#rdp-of-one-step).

    Args:
        q: Poisson sampling probability of each record, in [0, 1].
        sigma: noise multiplier (noise std / clipping bound), >= 0.
        orders: Rényi orders alpha > 1 (integer and fractional).

    Returns:
        One RDP value per order. ``q == 0`` gives 0, ``q == 1`` gives ``alpha / (2 sigma^2)``,
        ``sigma == 0`` gives infinity.
    """
    a = _as_orders(orders)
    if not 0.0 <= q <= 1.0 or not np.isfinite(q):
        raise ValueError(f"sampling rate q={q} must be in [0, 1]")
    if not sigma >= 0.0 or not np.isfinite(sigma):
        raise ValueError(f"noise multiplier sigma={sigma} must be >= 0")
    if q == 0.0:
        return np.zeros_like(a)
    if sigma == 0.0:
        return np.full_like(a, np.inf)
    if q == 1.0:
        return a / (2.0 * sigma**2)
    is_int = a == np.round(a)
    _check_cost(sigma, a[is_int], a[~is_int])
    log_a_minus_1 = np.empty_like(a)
    if np.any(is_int):
        log_a_minus_1[is_int] = _log_a_minus_1_integer(q, sigma, a[is_int])
    if np.any(~is_int):
        log_a_minus_1[~is_int] = _log_a_minus_1_fractional(q, sigma, a[~is_int])
    log_a = np.logaddexp(0.0, log_a_minus_1)  # log(1 + (A - 1))
    return log_a / (a - 1.0)


def _check_cost(sigma: float, integer: np.ndarray, fractional: np.ndarray) -> None:
    """Refuse (one line) orders whose evaluation at ``sigma`` exceeds the cost bounds above:
    the binomial table grows with the largest integer order, the quadrature grid with the
    largest fractional order over sigma^2 (:func:`_log_a_minus_1_fractional`)."""
    if integer.size:
        cells = integer.size * float(np.max(integer))
        if cells > _MAX_TABLE:
            raise ConfigError(f"RDP orders up to {np.max(integer):g} ({integer.size} integer "
                              f"orders) need a table of {cells:.1e} numbers (at most "
                              f"{_MAX_TABLE:.0e}): use fewer or smaller orders")
    if fractional.size and sigma >= _NARROW_SIGMA:
        step = min(0.5 * sigma, 0.4 * sigma**2)
        points = (float(np.max(fractional)) + 20.0 * sigma) / step
        if points > _MAX_GRID or points * fractional.size > _MAX_EVALUATIONS:
            raise ConfigError(f"RDP order {np.max(fractional):g} at sigma {sigma:g} needs a "
                              f"quadrature of {points:.1e} points x {fractional.size} orders "
                              f"(at most {_MAX_GRID:.0e} points, {_MAX_EVALUATIONS:.0e} in all): "
                              "use fewer or smaller fractional orders")


def rdp_to_epsilon(
    rdp: np.ndarray, orders: Sequence[float] | np.ndarray, delta: float
) -> tuple[float, float]:
    """Smallest epsilon over the orders and the order that attains it
    (docs/accounting.md#rdp-to-epsilon-delta).

    ``eps = min_alpha rdp(alpha) + log((alpha-1)/alpha) - (log delta + log alpha)/(alpha-1)``
    (Balle et al. 2020, Thm 21), clamped at 0.
    """
    a = _as_orders(orders)
    eps = _epsilon_per_order(np.asarray(rdp, dtype=float), a, delta)
    best = int(np.argmin(eps))
    return max(float(eps[best]), 0.0), float(a[best])


def _epsilon_per_order(rdp: np.ndarray, orders: np.ndarray, delta: float) -> np.ndarray:
    return rdp + np.log1p(-1.0 / orders) - (np.log(delta) + np.log(orders)) / (orders - 1.0)
