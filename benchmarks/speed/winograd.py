"""Time the ConvNet's 3x3 convolutions through Winograd's F(4x4, 3x3)
(fedlap_privacy.compute.kernels.winograd) against torch's own (oneDNN's direct convolution), the
kernels a user of torch would otherwise run.

For each shape a FedLAP-DP round makes (128 channels; a DP chunk of 128 records and a
synthetic set of 20 images; the 16x16 and 8x8 maps of the 28x28 ConvNet), the forward, the
input gradient and the weight gradient, each way interleaved within one run so that they
see the same machine load. Checks first that both agree (float64, 1e-12 of the output's
scale), then prints the median times and the ratio torch / ours, with the load average.

    python benchmarks/speed/winograd.py [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.allocator import tune_allocator
from fedlap_privacy.compute.kernels import winograd

# (records, height and width) at 128 channels
SHAPES = [(128, 16), (20, 16), (128, 8), (20, 8)]


def _torch(module: nn.Conv2d, pass_: str, x: Tensor, gy: Tensor) -> Callable[[], object]:
    with fast_paths.disabled("winograd"):
        assert not winograd.applies(x, module.weight, module)
    if pass_ == "forward":
        return lambda: torch.ops.aten.convolution(x, module.weight, None, [1, 1], [1, 1],
                                                  [1, 1], False, [0, 0], 1)
    mask = [pass_ == "input grad", pass_ == "weight grad", False]
    return lambda: torch.ops.aten.convolution_backward(gy, x, module.weight, None, [1, 1],
                                                       [1, 1], [1, 1], False, [0, 0], 1, mask)


def _ours(module: nn.Conv2d, pass_: str, x: Tensor,
          gy: Tensor) -> Callable[[], object] | None:
    """Our pass, or None below the threshold (:func:`winograd.applies`: torch's runs)."""
    if not winograd.applies(x, module.weight, module):
        return None
    if pass_ == "forward":
        return lambda: winograd.conv(x, module.weight)
    mask = (pass_ == "input grad", pass_ == "weight grad")
    return lambda: winograd.conv_backward(gy, x, module.weight, mask)


def _check() -> None:
    """Both ways agree in float64 (the oracle test, once more before timing)."""
    g = torch.Generator().manual_seed(0)
    module = nn.Conv2d(128, 128, 3, padding=1, bias=False).double()
    x = torch.randn(8, 128, 16, 16, generator=g, dtype=torch.float64)
    gy = torch.randn(8, 128, 16, 16, generator=g, dtype=torch.float64)
    for pass_ in ("forward", "input grad", "weight grad"):
        ours = _ours(module, pass_, x, gy)
        assert ours is not None
        a, b = ours(), _torch(module, pass_, x, gy)()
        for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,),
                        strict=False):
            if u is not None and v is not None:
                assert (u - v).abs().max() <= 1e-12 * v.abs().max(), pass_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    tune_allocator()
    torch.set_num_threads(args.threads)
    _check()
    torch.manual_seed(0)
    module = nn.Conv2d(128, 128, 3, padding=1, bias=False).requires_grad_(False)
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}, "
          f"medians of {args.repeats}, ms (torch = oneDNN's direct convolution)")
    print(f"{'records x map':>14s} {'pass':>12s} {'torch':>8s} {'ours':>8s} {'torch/ours':>11s}")
    for n, side in SHAPES:
        x, gy = torch.randn(n, 128, side, side), torch.randn(n, 128, side, side)
        for pass_ in ("forward", "input grad", "weight grad"):
            ours = _ours(module, pass_, x, gy)
            if ours is None:
                print(f"{f'{n} x {side}x{side}':>14s} {pass_:>12s}  below the threshold on "
                      f"{args.threads} threads: torch's runs")
                continue
            _race(f"{n} x {side}x{side}", pass_,
                  {"torch": _torch(module, pass_, x, gy), "ours": ours}, args.repeats)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


def _race(label: str, pass_: str, runs: dict[str, Callable[[], object]], repeats: int) -> None:
    """Print the median times of the two ways, interleaved, and their ratio."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():  # warm up: the first calls fault the buffers in
        fn(), fn()
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{label:>14s} {pass_:>12s} {med['torch']:8.1f} {med['ours']:8.1f} "
          f"{med['torch'] / med['ours']:10.2f}x")


if __name__ == "__main__":
    main()
