"""The one generator for draws nobody else may predict: audit coins, tie orders, the audit's
per-step canary sampling.

Seeded with 256 bits from the operating system (:mod:`secrets`), never from a configuration,
a caller or another generator: coins or orders an auditor or the server could recompute would
void the audit (Steinke, Nasr, Jagielski 2023, the inclusion bits are independent fair coins).
"""

from __future__ import annotations

import secrets

import numpy as np

__all__ = ["os_generator"]


def os_generator() -> np.random.Generator:
    """A numpy generator seeded with 256 bits of the operating system's randomness."""
    return np.random.default_rng(secrets.randbits(256))
