"""Time the audit's feature extraction (docs/audit.md#features-and-attacks) against a naive
per-record loop.

Features: per-record loss and per-record L2 gradient norm over all weights, as
:func:`fedlap_privacy.audit.inference.features.compute_features` computes them (batched, vectorised
per-record gradients from :mod:`fedlap_privacy.compute.per_sample`). The naive reference runs one
forward + backward pass per record. Both run on the ConvNet of docs/algorithms.md#convnet
(width 128) with two inputs -- scikit-learn digits (1x8x8) and a random 1x28x28 batch
(MNIST-sized) -- interleaved within one run so they see the same machine load. The script
checks that the two agree, then prints the median and best time of each and the ratio naive / ours.

    python benchmarks/speed/audit_features.py [--records 512] [--repeats 2]   # ~1.5-2 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlap_privacy.audit.inference.features import compute_features
from fedlap_privacy.data.datasets import load_dataset
from fedlap_privacy.models import ModelConfig, build_model


def naive_features(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, np.ndarray]:
    """One forward/backward per record: the loss and the gradient norm, record by record."""
    params = list(model.parameters())
    losses, norms = [], []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, params)
        losses.append(loss.item())
        norms.append(torch.sqrt(sum(g.square().sum() for g in grads)).item())
    return {"loss": np.asarray(losses), "grad-norm": np.asarray(norms)}


def ours(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, np.ndarray]:
    return compute_features(model, x, y)


def timed(fn: Callable[[], dict[str, np.ndarray]]) -> tuple[float, dict[str, np.ndarray]]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench(name: str, model: nn.Module, x: Tensor, y: Tensor, repeats: int) -> float:
    model.eval()
    fast_t, slow_t = [], []
    for _ in range(repeats):  # interleaved: both see the same load
        t, fast = timed(lambda: ours(model, x, y))
        fast_t.append(t)
        t, slow = timed(lambda: naive_features(model, x, y))
        slow_t.append(t)
    for key in ("loss", "grad-norm"):
        if not np.allclose(fast[key], slow[key], rtol=1e-4, atol=1e-6):
            worst = float(np.max(np.abs(fast[key] - slow[key]) / (np.abs(slow[key]) + 1e-6)))
            raise SystemExit(f"{name}: {key} disagrees with the naive loop (rel. err {worst:.2e})")
    ratio = statistics.median(slow_t) / statistics.median(fast_t)
    n = x.shape[0]
    print(
        f"{name:<14} {n:>5} records | ours median {statistics.median(fast_t):7.3f} s "
        f"(best {min(fast_t):.3f}) | naive median {statistics.median(slow_t):7.3f} s "
        f"(best {min(slow_t):.3f}) | naive/ours {ratio:5.1f}x | agree (rtol 1e-4)"
    )
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ConvNet width 128")

    digits = load_dataset("digits")
    x8 = torch.as_tensor(digits.x_train[: args.records])
    y8 = torch.as_tensor(digits.y_train[: args.records])
    model8 = build_model(ModelConfig(1, 8, 10, width=128))
    x28 = torch.randn(args.records, 1, 28, 28)
    y28 = torch.randint(0, 10, (args.records,))
    model28 = build_model(ModelConfig(1, 28, 10, width=128))

    ours(model8, x8[:8], y8[:8])  # warm-up (lazy imports, allocator)
    ratios = [
        bench("digits 1x8x8", model8, x8, y8, args.repeats),
        bench("random 1x28x28", model28, x28, y28, args.repeats),
    ]
    print("speed-up naive/ours: " + ", ".join(f"{r:.1f}x" for r in ratios))


if __name__ == "__main__":
    main()
