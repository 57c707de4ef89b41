"""Time the ConvNet's 3x3 convolutions through Winograd's F(4x4, 3x3)
(fedlap_privacy.compute.kernels.winograd) and its first convolution through the few-channel kernel
(fedlap_privacy.compute.kernels.few_channels) against torch's own (oneDNN's direct convolution), the
kernels a user of torch would otherwise run.

For each shape a FedLAP-DP round makes (128 channels; a DP chunk of 128 records and a
synthetic set of 20 images; the 16x16 and 8x8 maps of the 28x28 ConvNet), the forward, the
input gradient and the weight gradient, each way interleaved within one run so that they
see the same machine load. Checks first that both agree (float64, 1e-12 of the output's
scale), then prints the median times and the ratio torch / ours, with the load average.
Last, the first convolution of FashionMNIST's 28x28 grey images (padding 3, 128 output
channels) for the same two batches: its forward; the images' gradient of the matching step
(the block's two convolutions summed; torch: its native kernel on the two concatenated, as
the package ran it before); and every record's weight and bias gradients of a DP chunk
(torch: a convolution with the records folded into the groups, and a sum over the map).

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
from fedlap_privacy.compute.kernels import few_channels, winograd
from fedlap_privacy.compute.per_sample import _conv_weight_grads

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
    first = nn.Conv2d(1, 128, 3, padding=3).requires_grad_(False)
    for n in sorted({n for n, _ in SHAPES}, reverse=True):
        x = torch.randn(n, 1, 28, 28)
        assert few_channels.applies(x, first.weight, first)
        _race(f"{n} x 28x28", "1st forward", {
            "torch": lambda x=x: torch.ops.aten.convolution(
                x, first.weight, first.bias, [1, 1], [3, 3], [1, 1], False, [0, 0], 1),
            "ours": lambda x=x: few_channels.conv(x, first.weight, first.bias, (3, 3))},
            args.repeats)
        gy, gz, u_w = (torch.randn(n, 128, 32, 32), torch.randn(n, 128, 32, 32),
                       torch.randn(128, 1, 3, 3))
        stacked, kernels = torch.cat([gy, gz], 1), torch.cat([first.weight, u_w], 0)
        races = {
            "1st in grad": {
                "torch": lambda x=x, g=stacked, w=kernels: (
                    torch.ops.aten._slow_conv2d_backward.output_mask(
                        g, x, w, [3, 3], [1, 1], [3, 3], [True, False, False])[0]),
                "ours": lambda gy=gy, gz=gz, u_w=u_w: few_channels.input_grad_sum(
                    [(gy, first.weight), (gz, u_w)], (3, 3), (28, 28))},
            "1st per-rec": {
                "torch": lambda x=x, gy=gy: (_conv_weight_grads(first, x, gy),
                                             gy.sum(dim=(2, 3))),
                "ours": lambda x=x, gy=gy: few_channels.per_record_grads(x, gy, (3, 3))}}
        for pass_, runs in races.items():
            want, got = runs["torch"](), runs["ours"]()
            for a, b in zip(torch.utils._pytree.tree_leaves(want),
                            torch.utils._pytree.tree_leaves(got), strict=True):
                torch.testing.assert_close(b, a, atol=1e-4 * a.abs().max().item(), rtol=0)
            _race(f"{n} x 28x28", pass_, runs, args.repeats)
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
