"""The client's encoding of its update and the server's decoding of the sum
(Kairouz, Liu, Steinke, ICML 2021, Algorithms 1 and 2; Agarwal, Kairouz, Liu 2021).

encode: clip to L2 norm c, pad to d = 2^k, rotate (public randomised Hadamard), divide by
gamma, round each coordinate up with probability equal to its fractional part and redraw
until the rounded vector's norm is within the sensitivity bound the accountant uses
(conditional randomised rounding), add the noise share, reduce mod 2^b. The rounding and the
noise draw from the operating system's randomness.

decode: the sum mod 2^b read as centred integers in [-2^(b-1), 2^(b-1)), times gamma,
unrotated and unpadded: the noisy sum of the clipped updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedlap_privacy.accountant.distributed import DistributedMechanism, DistributedNoise
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.secure_sum.hadamard import rotate, rotation_signs, unrotate
from fedlap_privacy.fl.secure_sum.noise import discrete_gaussian, skellam
from fedlap_privacy.secret_random import os_generator

__all__ = ["MAX_ROUNDING_TRIES", "SecureSumSpec", "decode", "encode"]

#: conditional rounding succeeds with probability >= 1 - beta per try (KLS 2021, section 4)
MAX_ROUNDING_TRIES = 1000


@dataclass(frozen=True)
class SecureSumSpec:
    """One round's public parameters: the mechanism, the bits of the modulus, the model size
    and the public seed of the rotation (at least 128 bits, the same for every client)."""

    mechanism: DistributedMechanism
    bits: int
    model_size: int
    rotation_seed: bytes

    def __post_init__(self) -> None:
        if not (isinstance(self.bits, int) and 2 <= self.bits <= 62):
            raise ConfigError(f"bits {self.bits!r} must be an integer in [2, 62]")
        dim = self.mechanism.quantisation.dim
        if not (isinstance(self.model_size, int) and 1 <= self.model_size <= dim):
            raise ConfigError(f"model size {self.model_size!r} must be in [1, {dim}] "
                              "(the padded dimension)")
        if len(self.rotation_seed) < 16:
            raise ConfigError("the rotation seed must have at least 128 bits")

    @property
    def modulus(self) -> int:
        return 1 << self.bits


def encode(update: np.ndarray, spec: SecureSumSpec, *, add_noise: bool = True) -> np.ndarray:
    """One client's share of the sum, as uint64 in [0, 2^b).

    ``add_noise=False`` leaves the noise share out: a fault switch for audits (the decoded sum
    then has measurably less variance); a deployment never sets it.
    """
    q = spec.mechanism.quantisation
    x = np.asarray(update, dtype=np.float64).reshape(-1)
    if x.size != spec.model_size:
        raise ConfigError(f"update has {x.size} values, the round expects {spec.model_size}")
    if not np.all(np.isfinite(x)):
        raise ConfigError("update has non-finite values")
    norm = float(np.linalg.norm(x))
    if norm > q.clip:
        x = x * (q.clip / norm)
    padded = np.zeros(q.dim)
    padded[: x.size] = x
    scaled = rotate(padded, rotation_signs(spec.rotation_seed, q.dim)) / q.gamma
    rng = os_generator()
    grid = _round_conditionally(scaled, q.l2, rng)
    if add_noise:
        grid = grid + _noise(spec.mechanism, q.dim, rng)
    return np.mod(grid, spec.modulus).astype(np.uint64)


def _round_conditionally(scaled: np.ndarray, bound: float, rng: np.random.Generator
                         ) -> np.ndarray:
    low = np.floor(scaled)
    frac = scaled - low
    low = low.astype(np.int64)
    for _ in range(MAX_ROUNDING_TRIES):
        rounded = low + (rng.random(scaled.size) < frac)
        if math.fsum((rounded.astype(np.float64)) ** 2) <= bound**2:
            return rounded
    raise RuntimeError(f"conditional rounding failed {MAX_ROUNDING_TRIES} times: the bound "
                       f"{bound:g} is inconsistent with the clip and the grid")


def _noise(mechanism: DistributedMechanism, dim: int, rng: np.random.Generator) -> np.ndarray:
    if mechanism.noise is DistributedNoise.SKELLAM:
        return skellam(mechanism.local_std, dim, rng)
    return discrete_gaussian(mechanism.local_std, dim, rng)


def decode(total: np.ndarray, spec: SecureSumSpec) -> np.ndarray:
    """The noisy sum of the clipped updates, from the sum of the shares mod 2^b."""
    q = spec.mechanism.quantisation
    t = np.asarray(total, dtype=np.uint64) % np.uint64(spec.modulus)
    centred = t.astype(np.int64)
    centred[centred >= spec.modulus // 2] -= spec.modulus
    unrotated = unrotate(centred.astype(np.float64) * q.gamma,
                         rotation_signs(spec.rotation_seed, q.dim))
    return unrotated[: spec.model_size]
