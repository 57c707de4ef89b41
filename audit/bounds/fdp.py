"""f-DP one-run audit (Mahloujifar, Melis, Chaudhuri, "Auditing f-Differential Privacy in One
Run", ICML 2025, arXiv:2410.22235).

The game is Steinke, Nasr, Jagielski's (:mod:`fedlap_privacy.audit.bounds.one_run`): ``m`` canaries
with secret inclusion bits, ``k`` guesses, ``c`` of them correct. Instead of testing an
``(eps, delta)`` pair, the paper tests a whole trade-off curve ``f``: if the mechanism is
``f``-DP with respect to every canary, the number of correct guesses is controlled by the
paper's recursive bound (its Section 4, the membership-inference bound with abstentions).
With ``fbar(x) = 1 - f(x)`` (the most power a test of false-positive rate ``x`` can have) and
``fbar^-1`` its inverse, and ``tau`` a candidate probability of ``>= c`` correct guesses:

* start at ``r_c = tau c / m`` and ``h_c = tau (k - c) / m``;
* for ``i = c-1, ..., 0``: ``h_i = max(h_{i+1}, fbar^-1(r_{i+1}))`` and
  ``r_i = min(1, r_{i+1} + i / (k - i) (h_i - h_{i+1}))``;
* if ``r_0 + h_0 > k / m`` no ``f``-DP mechanism makes ``>= c`` correct guesses with
  probability ``tau`` (``r_0`` and ``h_0`` lower-bound the expected fractions of correct and
  wrong guesses, which sum to exactly ``k / m``).

So ``f`` is rejected at level ``alpha`` when the recursion fails at ``tau = alpha``
(:func:`rejects`), and the p-value of the counts under ``f`` is the smallest failing ``tau``
(:func:`curve_p_value`). Once ``h`` stops growing the recursion is at a fixed point and stops.

For the Gaussian family (``mu``-GDP, Dong, Roth, Su 2022: ``fbar^-1(r) = Phi(Phi^-1(r) -
mu)``), the bound is the largest rejected ``mu``, reported as the epsilon of ``mu``-GDP at the
audit's delta (Dong, Roth, Su, Corollary 2.13: ``delta(eps) = Phi(-eps/mu + mu/2) - e^eps
Phi(-eps/mu - mu/2)``). It lower-bounds the epsilon of any mechanism whose trade-off curve
is Gaussian (an ideal Gaussian mechanism, or the CLT limit of DP-SGD); for other curves use
:mod:`fedlap_privacy.audit.bounds.claim_curve`. Only numpy / scipy are used (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

from scipy.optimize import brentq
from scipy.special import ndtr, ndtri

from fedlap_privacy.audit.canaries.canary_clients import gaussian_epsilon
from fedlap_privacy.errors import ConfigError

__all__ = [
    "MU_MAX",
    "curve_p_value",
    "fdp_lower_bound",
    "gaussian_inverse",
    "gdp_epsilon",
    "gdp_mu",
    "gdp_mu_lower_bound",
    "rejects",
]

Inverse = Callable[[float], float]

#: Largest mu searched: mu-GDP at mu = 40 is epsilon ~ 800 at delta 1e-5, beyond any audit.
MU_MAX = 40.0
_MU_TOL = 1e-7
#: Smallest p-value resolved by :func:`curve_p_value` (smaller ones are reported as this).
P_FLOOR = 1e-12


def rejects(inverse: Inverse, m: int, k: int, c: int, tau: float) -> bool:
    """True when no mechanism with ``fbar^-1 = inverse`` makes ``>= c`` correct guesses of
    ``k`` among ``m`` canaries with probability ``tau`` (the module's recursion)."""
    if c == 0 or k == 0:
        return False
    r = tau * c / m
    h = tau * (k - c) / m
    for i in range(c - 1, -1, -1):
        grown = inverse(r)
        if grown <= h:  # fixed point: neither r nor h changes any more
            break
        r = min(1.0, r + i / (k - i) * (grown - h))
        h = grown
    return r + h > k / m


def curve_p_value(inverse: Inverse, m: int, k: int, c: int, rtol: float = 1e-3) -> float:
    """p-value of ``c`` correct among ``k`` guesses under the curve: the smallest ``tau``
    that :func:`rejects` (bisection on ``log tau`` to relative ``rtol``, reported at the
    upper end of the bracket, so never below the exact value); 1 when ``tau = 1`` is not
    rejected, :data:`P_FLOOR` when it is below that."""
    if not rejects(inverse, m, k, c, 1.0):
        return 1.0
    if rejects(inverse, m, k, c, P_FLOOR):
        return P_FLOOR
    lo, hi = math.log(P_FLOOR), 0.0
    while hi - lo > rtol:
        mid = 0.5 * (lo + hi)
        if rejects(inverse, m, k, c, math.exp(mid)):
            hi = mid
        else:
            lo = mid
    return math.exp(hi)


def gaussian_inverse(mu: float) -> Inverse:
    """``fbar^-1`` of ``mu``-GDP: ``r -> Phi(Phi^-1(r) - mu)`` (Dong, Roth, Su 2022)."""

    def inverse(r: float) -> float:
        return float(ndtr(ndtri(r) - mu))

    return inverse


def gdp_epsilon(mu: float, delta: float) -> float:
    """Epsilon of ``mu``-GDP at ``delta`` (Dong, Roth, Su, Corollary 2.13): the Gaussian
    mechanism with sensitivity 1 and noise ``1 / mu``."""
    if mu <= 0.0:
        return 0.0
    return gaussian_epsilon(1.0 / mu, delta)


def gdp_mu(epsilon: float, delta: float) -> float:
    """The ``mu`` whose ``mu``-GDP has exactly ``epsilon`` at ``delta`` (inverse of
    :func:`gdp_epsilon`; 0 for ``epsilon = 0``)."""
    if epsilon <= 0.0:
        return 0.0
    hi = 1.0
    while gdp_epsilon(hi, delta) < epsilon:
        hi *= 2.0
        if hi > 1e6:
            return math.inf
    return float(brentq(lambda mu: gdp_epsilon(mu, delta) - epsilon, 0.0, hi, xtol=1e-12))


@lru_cache(maxsize=8192)
def gdp_mu_lower_bound(m: int, k: int, c: int, level: float) -> float:
    """The largest ``mu`` whose ``mu``-GDP :func:`rejects` at ``tau = level`` (0 if even
    ``mu = 0``, a mechanism that leaks nothing, is not rejected; :data:`MU_MAX` at most).
    Rejection weakens as ``mu`` grows (the curve's ``fbar^-1`` falls pointwise); the
    crossing is found by doubling then bisection to :data:`_MU_TOL`."""
    if not rejects(gaussian_inverse(0.0), m, k, c, level):
        return 0.0
    lo, hi = 0.0, 1.0
    while rejects(gaussian_inverse(hi), m, k, c, level):
        lo, hi = hi, 2.0 * hi
        if hi > MU_MAX:
            return MU_MAX
    while hi - lo > _MU_TOL:
        mid = 0.5 * (lo + hi)
        if rejects(gaussian_inverse(mid), m, k, c, level):
            lo = mid
        else:
            hi = mid
    return lo


def fdp_lower_bound(m: int, k: int, c: int, delta: float, level: float) -> float:
    """Epsilon at ``delta`` of the largest ``mu``-GDP rejected at ``level`` (module
    docstring); ``delta`` must be > 0 (``mu``-GDP is not ``(eps, 0)``-DP for any finite
    eps)."""
    if not 0.0 < delta < 1.0:
        raise ConfigError(f"the f-DP bound needs 0 < delta < 1, got {delta}")
    return gdp_epsilon(gdp_mu_lower_bound(int(m), int(k), int(c), float(level)), delta)
