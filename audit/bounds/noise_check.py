"""Does a release carry the noise the claim says? A one-sided test on the canary block.

Under a claimed DP-SGD step every value the optimiser releases on a coordinate of the canary
block, in units of the clipping norm ``C``, is ``u = b + z``: ``b`` the canary's own
contribution (1 when it was included and sampled, else 0; no record reaches the block) and
``z ~ N(0, sigma^2)`` drawn independently of ``b``. Over ``N`` released values,
``sum u^2 / sigma^2`` is then a noncentral chi-square with ``N`` degrees of freedom and
noncentrality ``sum b^2 >= 0``, which is stochastically larger than the central one
(the noncentral chi-square grows stochastically with its noncentrality). So
``P[chi2_N <= sum u^2 / sigma^2]`` is a valid p-value of "the releases carry the claimed
noise": tiny when they carry less (no noise at all, the averaged update recorded instead of
the noisy sum, a noise multiplier below the claimed one), whatever the canaries' scores.
The test only ever rejects: more noise than claimed is no evidence for the claim.

It tests for half the claimed noise (:data:`NOISE_MARGIN`), not all of it: a release scaled
slightly differently from what the canaries assume must not read as a violation, and what it
is for is the gross failure that leaves the membership tests blind (every score tied when
nothing is noisy). Smaller shortfalls are the claim-curve and bound tests' to find.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.stats import chi2

from fedlap_privacy.errors import ConfigError

__all__ = ["NOISE_MARGIN", "NoiseSample", "NoiseTest"]

#: the test's null: at least this fraction of the claimed noise multiplier
NOISE_MARGIN = 0.5


@dataclass(frozen=True)
class NoiseTest:
    """The test's outcome at ``level`` (its share of the family's level): ``violation``
    when ``p_value < level`` (the releases carry less than ``tested_noise_multiplier``,
    :data:`NOISE_MARGIN` of the claimed one), else ``inconclusive`` (this test never makes
    a claim consistent)."""

    claimed_noise_multiplier: float
    tested_noise_multiplier: float
    measured_noise_multiplier: float
    values: int
    p_value: float
    level: float
    verdict: str
    method: str = "noise"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NoiseSample:
    """What the test needs from the releases: their count, sum of squares and measured
    noise multiplier (units of ``C``), and the noise multiplier claimed for them."""

    values: int
    sum_squares: float
    measured_noise_multiplier: float
    claimed_noise_multiplier: float

    @classmethod
    def from_releases(cls, releases: np.ndarray, claimed_noise_multiplier: float,
                      measured_noise_multiplier: float) -> NoiseSample:
        arr = np.asarray(releases, dtype=np.float64)
        if arr.size < 1 or not np.all(np.isfinite(arr)):
            raise ConfigError("the noise test needs finite released values")
        sigma = float(claimed_noise_multiplier)
        if not (math.isfinite(sigma) and sigma > 0.0):
            raise ConfigError(f"the claimed noise multiplier must be > 0, got {sigma}")
        return cls(int(arr.size), float(np.square(arr).sum()),
                   float(measured_noise_multiplier), sigma)

    def test(self, level: float) -> NoiseTest:
        """The one-sided chi-square test (module docstring) at ``level``."""
        tested = NOISE_MARGIN * self.claimed_noise_multiplier
        p = float(chi2.cdf(self.sum_squares / tested ** 2, self.values))
        return NoiseTest(self.claimed_noise_multiplier, tested, self.measured_noise_multiplier,
                         self.values, p, level, "violation" if p < level else "inconclusive")
