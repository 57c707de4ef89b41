"""Time the package's products of Winograd tiles and pixel Gram matrices
(fedlap_privacy.kernels.tile_products) against torch's batched matrix product (MKL's
``sgemm`` on the CPU), which the package ran before and a user of torch would run.

The shapes a FedLAP-DP round makes, float32, 128 channels: the 36 products of a 16x16 or
8x8 convolution for a DP chunk of 128 records (2,048 and 512 tiles) and for a synthetic set
of 20 images (320 and 80), and the pixel Gram matrices of a DP chunk's 16x16 and 8x8 maps
(torch forms the whole symmetric matrix; ours the blocks the norm reads). Each way
interleaved within one run, so that both see the same machine load; prints the median
times, GFLOP/s (of the whole product) and the ratio torch / ours, with the load average.

    python benchmarks/tile_products.py [--repeats 9] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from fedlap_privacy.allocator import tune_allocator
from fedlap_privacy.kernels import tile_products

# (label, tile rows) at 36 points and 128 channels
PRODUCTS = [("DP chunk 16x16", 2048), ("DP chunk 8x8", 512), ("synthetic 16x16", 320),
            ("synthetic 8x8", 80)]
# (label, records, map side) at 128 channels
GRAMS = [("DP chunk 16x16", 128, 16), ("DP chunk 8x8", 128, 8)]
CHANNELS, POINTS = 128, 36


def _time(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, the functions interleaved."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    tune_allocator()
    torch.set_num_threads(args.threads)
    if not tile_products.native(torch.zeros(1)):
        raise SystemExit("the tile products do not run here (float32 kernels with AVX2 and "
                         "FMA, the tile-products fast path on)")
    torch.manual_seed(0)
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}, "
          f"medians of {args.repeats}")
    print(f"{'product':<28}{'torch ms':>10}{'ours ms':>10}{'torch GF/s':>12}"
          f"{'ours GF/s':>11}{'ratio':>8}")
    for label, rows in PRODUCTS:
        tiles, weights = torch.randn(rows, POINTS, CHANNELS), torch.randn(POINTS, CHANNELS,
                                                                            CHANNELS)
        a, b = torch.empty(rows, POINTS, CHANNELS), torch.empty(rows, POINTS, CHANNELS)
        packed = tile_products.pack(weights)  # once per kernel transform in a round
        times = _time({
            "torch": lambda t=tiles, w=weights, o=a: torch.bmm(t.transpose(0, 1), w,
                                                               out=o.transpose(0, 1)),
            "ours": lambda t=tiles, w=packed, o=b: tile_products.products(t, w, o)},
            args.repeats)
        assert (a - b).abs().max() <= 1e-4 * a.abs().max()
        _row(f"products {label}", times, 2 * POINTS * rows * CHANNELS * CHANNELS)
    for label, records, side in GRAMS:
        x = torch.randn(records, CHANNELS, side * side)
        q = torch.empty(records, side * side, side * side)
        times = _time({"torch": lambda x=x, q=q: torch.bmm(x.transpose(1, 2), x, out=q),
                       "ours": lambda x=x, side=side: tile_products.gram_upper(x, side)},
                      args.repeats)
        _row(f"Gram {label}", times, 2 * records * (side * side) ** 2 * CHANNELS)


def _row(label: str, times: dict[str, float], flop: int) -> None:
    t, o = times["torch"], times["ours"]
    print(f"{label:<28}{t * 1e3:>10.2f}{o * 1e3:>10.2f}{flop / t / 1e9:>12.1f}"
          f"{flop / o / 1e9:>11.1f}{t / o:>7.2f}x")


if __name__ == "__main__":
    main()
