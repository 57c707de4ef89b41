"""Pessimistic discretisation of one subsampled Gaussian step (docs/accounting.md#pld-accounting).

Contract: the mechanism of :mod:`fedlap_privacy.accountant.schedule` — each record joins the
batch with probability ``q``, the sum of records clipped to C gets ``N(0, sigma^2 C^2)``
(sensitivity 1 after scaling by C), add/remove-one neighbours. Its privacy loss has two
directions, as in dp-accounting's ``GaussianPrivacyLoss`` (mu = N(0, sigma^2)):

* remove: P = (1 - q) mu(x) + q mu(x + 1) against Q = mu(x),
  loss ``l(x) = log(1 - q + q exp((-1/2 - x) / sigma^2))``;
* add:    P = mu(x) against Q = (1 - q) mu(x) + q mu(x - 1),
  loss ``l(x) = -log(1 - q + q exp((x - 1/2) / sigma^2))``.

Both losses are monotone in x, so the hockey-stick divergence ``delta(eps) = P(l > eps) -
e^eps Q(l > eps)`` has a closed form in normal CDFs at every eps. The step is discretised by
Connect-the-Dots (Doroshenko, Ghazi, Kamath, Kumar, Manurangsi 2022, "Connect the dots:
tighter discrete approximations of privacy loss distributions", PoPETs, Algorithm 1) on the
grid ``eps_i = i * h``: the probabilities are chosen so that the discrete PLD's
hockey-stick curve equals the true one at every grid point and lies above it in between
(Theorem 3.4 there: a pessimistic, dominating pair), with the mass of the truncated x-tails
(``exp(-50)``) put at +infinity. Everything is vectorised: one evaluation of the normal CDFs
per grid point, where dp-accounting inverts the loss point by point in Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
from scipy import special

from fedlap_privacy.errors import ConfigError

__all__ = [
    "LOG_MASS_TRUNCATION",
    "MAX_BUCKETS",
    "VALUE_INTERVAL",
    "DiscretePLD",
    "sgm_buckets",
    "sgm_pld",
]

#: Discretisation of the privacy-loss values (dp-accounting's default grid).
VALUE_INTERVAL = 1e-4
#: ln of the noise mass left out of the discretised x-range (put at +infinity): dp-accounting's
#: default ``log_mass_truncation_bound``.
LOG_MASS_TRUNCATION = -50.0
#: Most privacy-loss buckets one step may span (40 MB of float64; sigma about 0.06 at q 1).
MAX_BUCKETS = 5_000_000
#: Row length of the blocked moment generating function (DiscretePLD.log_mgf).
_BLOCK = 64


@dataclass(frozen=True, eq=False)
class DiscretePLD:
    """A discrete privacy loss distribution: mass ``probs[i]`` at loss
    ``(lower + i) * interval``, mass ``infinity`` at +infinity (a dominating pair for
    the step it discretises when built pessimistically)."""

    interval: float
    lower: int
    probs: np.ndarray
    infinity: float

    @property
    def upper(self) -> int:
        """Grid index of the largest finite loss."""
        return self.lower + len(self.probs) - 1

    @cached_property
    def _losses(self) -> np.ndarray:
        return (self.lower + np.arange(len(self.probs))) * self.interval

    @cached_property
    def variance(self) -> float:
        """Variance of the finite part (normalised), in loss units squared."""
        mass = float(self.probs.sum())
        if mass <= 0.0:
            return 0.0
        mean = float(self.probs @ self._losses) / mass
        return max(float(self.probs @ (self._losses - mean) ** 2) / mass, 0.0)

    @cached_property
    def _blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """``probs`` as rows of :data:`_BLOCK` (zero-padded), padded in front (the last
        row ends at the largest loss) and at the back (the first row starts at the
        smallest): the layouts :meth:`log_mgf` uses for ``lam >= 0`` and ``lam < 0``."""
        n = len(self.probs)
        size = -(-n // _BLOCK) * _BLOCK
        front, back = np.zeros(size), np.zeros(size)
        front[size - n:] = self.probs
        back[:n] = self.probs
        return front.reshape(-1, _BLOCK), back.reshape(-1, _BLOCK)

    def log_mgf(self, lam: np.ndarray) -> np.ndarray:
        """``log sum_i probs[i] exp(lam * loss_i)`` for each ``lam`` (finite part only).

        The losses are ``(lower + i) h``, so with ``i = B a + b`` (rows of ``B``) each term
        is ``probs[i] e^{lam h B a} e^{lam h b}``: one matrix product of the rows with
        ``e^{lam h b}`` and one weighted sum over rows, ``len(lam) (B + n / B)``
        exponentials instead of ``len(lam) n``. Both factors are shifted so that the largest
        loss (``lam >= 0``) or the smallest (``lam < 0``) has exponent 0: no overflow, and
        the same terms underflow as in ``exp(lam loss_i - max_i lam loss_i)``."""
        lam = np.atleast_1d(np.asarray(lam, dtype=float))
        out = np.empty_like(lam)
        h, n, b = self.interval, len(self.probs), np.arange(_BLOCK)
        front, back = self._blocks
        rows = np.arange(len(front))
        for sel, blocks in ((lam >= 0.0, front), (lam < 0.0, back)):
            if not sel.any():
                continue
            step = lam[sel, None] * h
            if blocks is front:  # exponent 0 at the largest loss, index n - 1
                inner = np.exp(step * (b - (_BLOCK - 1)))
                outer = np.exp(step * _BLOCK * (rows - (len(rows) - 1)))
                top = step[:, 0] * (self.lower + n - 1)
            else:  # exponent 0 at the smallest loss, index 0
                inner = np.exp(step * b)
                outer = np.exp(step * _BLOCK * rows)
                top = step[:, 0] * self.lower
            sums = np.einsum("ma,am->m", outer, blocks @ inner.T)
            with np.errstate(divide="ignore"):
                out[sel] = np.log(sums) + top
        return out


def _x_truncation(sigma: float) -> float:
    """x with Phi(x / sigma) = exp(LOG_MASS_TRUNCATION) / 2 (negative)."""
    return sigma * float(special.ndtri(0.5 * math.exp(LOG_MASS_TRUNCATION)))


def _loss(x: float, sigma: float, q: float, remove: bool) -> float:
    """Privacy loss at noise value x (module docstring)."""
    if remove:
        l0 = (-0.5 - x) / sigma**2
        return l0 if q == 1.0 else float(np.logaddexp(math.log1p(-q), math.log(q) + l0))
    l0 = (x - 0.5) / sigma**2
    return -(l0 if q == 1.0 else float(np.logaddexp(math.log1p(-q), math.log(q) + l0)))


def _grid(sigma: float, q: float, remove: bool, interval: float) -> tuple[int, int]:
    """Grid indices (lowest, highest) of the epsilons Connect-the-Dots uses: the losses at
    the ends of the x-range that keeps all but exp(LOG_MASS_TRUNCATION) of the noise."""
    lower_x = _x_truncation(sigma)
    upper_x = -lower_x
    if remove:
        lower_x -= 1.0
    else:
        upper_x += 1.0
    eps_upper = _loss(lower_x, sigma, q, remove)
    eps_lower = _loss(upper_x, sigma, q, remove)
    return math.floor(eps_lower / interval), math.ceil(eps_upper / interval)


def sgm_buckets(sigma: float, q: float, interval: float = VALUE_INTERVAL) -> int:
    """Number of grid points one step at (sigma, q) spans (the larger direction)."""
    return max(hi - lo + 1 for lo, hi in (_grid(sigma, q, r, interval) for r in (True, False)))


def _deltas(eps: np.ndarray, sigma: float, q: float, remove: bool) -> np.ndarray:
    """Hockey-stick divergence delta(eps) of one step, exactly, for every eps (vectorised).

    remove: for eps > log(1 - q) the loss exceeds eps iff x < x*, with
    ``x* = -1/2 - sigma^2 log((e^eps - 1 + q) / q)``, and
    ``delta = (1 - q) Phi(x*/s) + q Phi((x* + 1)/s) - e^eps Phi(x*/s)``; below, ``1 - e^eps``.
    add: for eps < -log(1 - q), ``x* = 1/2 + sigma^2 log((e^-eps - 1 + q) / q)`` and
    ``delta = Phi(x*/s) - e^eps ((1 - q) Phi(x*/s) + q Phi((x* - 1)/s))``; above, 0.
    """
    deltas = np.zeros_like(eps)
    log_q = math.log(q)
    log_1mq = math.log1p(-q) if q < 1.0 else -math.inf
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        if remove:
            inside = eps > log_1mq
            e = eps[inside]
            x = -0.5 - sigma**2 * (np.log(np.expm1(e) + q) - log_q)
            log_lower = special.log_ndtr(x / sigma)
            lower = np.exp(log_lower)
            upper = (1.0 - q) * lower + q * special.ndtr((x + 1.0) / sigma)
            deltas[inside] = upper - np.exp(e + log_lower)
            deltas[~inside] = -np.expm1(eps[~inside])
        else:
            inside = eps < -log_1mq
            e = eps[inside]
            x = 0.5 + sigma**2 * (np.log(np.expm1(-e) + q) - log_q)
            log_upper = special.log_ndtr(x / sigma)
            log_lower = special.log_ndtr((x - 1.0) / sigma)
            if q < 1.0:
                log_lower = np.logaddexp(log_1mq + log_upper, log_q + log_lower)
            deltas[inside] = np.exp(log_upper) - np.exp(e + log_lower)
    return np.clip(deltas, 0.0, 1.0)


def _connect_the_dots(deltas: np.ndarray, interval: float) -> tuple[np.ndarray, float]:
    """Probabilities on the grid and the mass at +infinity whose hockey-stick curve
    interpolates ``deltas`` (Doroshenko et al. 2022, Algorithm 1, equal gaps)."""
    deltas = np.minimum.accumulate(deltas)
    if len(deltas) == 1:
        return np.array([1.0 - deltas[0]]), float(deltas[0])
    diffs = np.diff(deltas)
    probs = np.empty_like(deltas)
    probs[0] = 1.0 - deltas[0] + diffs[0] / math.expm1(interval)
    probs[1:-1] = (diffs[1:] - diffs[:-1] * math.exp(interval)) / math.expm1(interval)
    probs[-1] = diffs[-1] / math.expm1(-interval)
    return np.maximum(probs, 0.0), float(deltas[-1])


@lru_cache(maxsize=64)
def sgm_pld(sigma: float, q: float, remove: bool, interval: float = VALUE_INTERVAL) -> DiscretePLD:
    """The pessimistic discrete PLD of one step (remove or add direction); cached per
    (sigma, q, direction, grid), so planning re-uses it across rounds and calls.

    At q = 1 both directions are the same distribution (the remove one is returned). A step
    spanning more than :data:`MAX_BUCKETS` grid points is a ConfigError naming RDP.
    """
    if q == 1.0:
        remove = True
    lo, hi = _grid(sigma, q, remove, interval)
    if hi - lo + 1 > MAX_BUCKETS:
        raise ConfigError(
            f"the PLD accountant cannot discretise sigma {sigma:g}: its privacy losses span "
            f"{hi - lo + 1:.1e} buckets of {interval:g} (at most {MAX_BUCKETS:.0e} within its "
            "memory budget); use the RDP accountant (--accountant rdp)"
        )
    eps = np.arange(lo, hi + 1) * interval
    probs, infinity = _connect_the_dots(_deltas(eps, sigma, q, remove), interval)
    probs.setflags(write=False)
    return DiscretePLD(interval=interval, lower=lo, probs=probs, infinity=infinity)
