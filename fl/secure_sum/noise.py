"""Integer noise shares, drawn from the operating system's randomness (never from a seed a
configuration could fix: the caller passes :func:`fedlap_privacy.secret_random.os_generator`).

* Skellam Sk(mu, mu): the difference of two Poisson(mu) draws (Agarwal, Kairouz, Liu 2021).
* discrete Gaussian N_Z(0, s^2): Canonne, Kamath, Steinke 2020, Algorithm 3: propose from a
  discrete Laplace of scale t = floor(s) + 1 and accept with probability
  exp(-(|y| - s^2/t)^2 / (2 s^2)). The discrete Laplace is the difference of two geometric
  draws (P(y) proportional to exp(-|y|/t)); the acceptance test uses floating point.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["discrete_gaussian", "skellam"]


def skellam(local_std: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """Sk(mu, mu) with variance local_std^2 (mu = local_std^2 / 2), as int64."""
    mu = local_std**2 / 2.0
    return rng.poisson(mu, size).astype(np.int64) - rng.poisson(mu, size).astype(np.int64)


def discrete_gaussian(s: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """N_Z(0, s^2) by rejection from a discrete Laplace (Canonne, Kamath, Steinke 2020)."""
    t = math.floor(s) + 1
    p = -math.expm1(-1.0 / t)  # success probability of each geometric draw
    out = np.empty(size, dtype=np.int64)
    todo = np.arange(size)
    while todo.size:
        y = (rng.geometric(p, todo.size) - rng.geometric(p, todo.size)).astype(np.int64)
        accept = rng.random(todo.size) < np.exp(-((np.abs(y) - s**2 / t) ** 2) / (2.0 * s**2))
        out[todo[accept]] = y[accept]
        todo = todo[~accept]
    return out
