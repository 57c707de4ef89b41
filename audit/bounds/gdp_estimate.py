"""A heuristic Gaussian-DP estimate from canary scores: an ESTIMATE, never a bound.

M. Nasr, J. Hayes, T. Steinke, B. Balle, F. Tramèr, M. Jagielski, N. Carlini, A. Terzis,
"Tight auditing of differentially private machine learning", USENIX Security 2023: with
gradient canaries under Gaussian noise, the scores of the canaries that were in and of
those that were out are close to two Gaussians of the same spread, and the privacy of the
pair is that of ``mu``-GDP with ``mu = (mean_in - mean_out) / sd_out`` (Dong, Roth, Su
2022). For white-box Dirac canaries at Poisson rate ``q`` over ``T`` releases with noise
``sigma``, ``mu`` is about ``q sqrt(T) / sigma``, the central-limit ``mu`` of the composed
subsampled Gaussian. The epsilon reported is that of ``mu``-GDP at the audit's delta.

It assumes what it estimates (Gaussian scores) and carries no confidence level: it can lie
above the true epsilon by chance or by model error. It is shown beside the bounds, labelled
an estimate, and takes no part in any verdict. Only numpy / scipy (no torch).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fedlap_privacy.audit.bounds.fdp import MU_MAX, gdp_epsilon

__all__ = ["GdpEstimate", "gdp_estimate"]


@dataclass(frozen=True)
class GdpEstimate:
    """``mu`` and its epsilon at ``delta`` (module docstring); ``kind`` says what it is."""

    mu: float
    epsilon: float
    delta: float
    mean_in: float
    mean_out: float
    sd_out: float
    kind: str = "estimate (Nasr et al. 2023, Gaussian scores assumed), not a bound"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def gdp_estimate(scores_in: np.ndarray, scores_out: np.ndarray,
                 delta: float) -> GdpEstimate | None:
    """The estimate of the module docstring; None when it cannot be formed (fewer than two
    scores on a side, no spread among the out-scores, or delta outside (0, 1))."""
    s_in = np.asarray(scores_in, dtype=np.float64)
    s_out = np.asarray(scores_out, dtype=np.float64)
    if s_in.size < 2 or s_out.size < 2 or not 0.0 < delta < 1.0:
        return None
    if not (np.all(np.isfinite(s_in)) and np.all(np.isfinite(s_out))):
        return None
    sd = float(s_out.std(ddof=1))
    if sd == 0.0 or not math.isfinite(sd):
        return None
    mean_in, mean_out = float(s_in.mean()), float(s_out.mean())
    mu = min(max(0.0, (mean_in - mean_out) / sd), MU_MAX)
    return GdpEstimate(mu, gdp_epsilon(mu, delta), delta, mean_in, mean_out, sd)
