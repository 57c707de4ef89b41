"""Randomised Hadamard rotation: ``x -> H D x / sqrt(d)`` with D a diagonal of random signs
(Kairouz, Liu, Steinke, ICML 2021, section 4.2). H / sqrt(d) is orthogonal and symmetric, so
the rotation keeps the L2 norm and its inverse is ``y -> D H y / sqrt(d)``. The signs come
from a public seed shared by the round's clients: the rotation is public, only flattening
the vector so that rounding and the modulus treat every coordinate alike."""

from __future__ import annotations

import numpy as np

__all__ = ["fwht", "rotate", "rotation_signs", "unrotate"]


def fwht(x: np.ndarray) -> np.ndarray:
    """Normalised fast Walsh-Hadamard transform of a vector of length 2^k: O(d log d)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"Hadamard transform needs a power-of-2 length, not {d}")
    y = np.array(x, dtype=np.float64)
    h = 1
    while h < d:
        y = y.reshape(-1, 2, h)
        y = np.stack([y[:, 0] + y[:, 1], y[:, 0] - y[:, 1]], axis=1)
        h *= 2
    return y.reshape(d) / np.sqrt(d)


def rotation_signs(seed: bytes, dim: int) -> np.ndarray:
    """The round's public random signs (+1/-1), from its public seed."""
    rng = np.random.default_rng(int.from_bytes(seed, "big"))
    return rng.integers(0, 2, size=dim).astype(np.float64) * 2.0 - 1.0


def rotate(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    return fwht(signs * x)


def unrotate(y: np.ndarray, signs: np.ndarray) -> np.ndarray:
    return signs * fwht(y)
