"""Small user data sets for the tests of ``--data`` / ``--model`` (plain helpers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

#: three well-separated classes in 6 features: a fair model beats chance (1/3) easily
FEATURES, CLASSES = 6, 3


def blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` feature rows of :data:`CLASSES` Gaussian blobs (fixed centres)."""
    centres = np.random.default_rng(123).normal(size=(CLASSES, FEATURES)) * 2.5
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n)
    return (centres[y] + rng.normal(size=(n, FEATURES))).astype(np.float32), y


def tabular_folder(root: Path, sizes: tuple[int, ...] = (90, 80, 70), test: int = 60) -> Path:
    """A folder of one .npz per client (site0.npz, ...) and a test.npz (``test`` > 0)."""
    root.mkdir(parents=True, exist_ok=True)
    for k, n in enumerate(sizes):
        x, y = blobs(n, k)
        np.savez(root / f"site{k}.npz", x=x, y=y)
    if test:
        x, y = blobs(test, 99)
        np.savez(root / "test.npz", x=x, y=y)
    return root
