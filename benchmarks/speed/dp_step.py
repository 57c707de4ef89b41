"""Time one DP real-gradient step (per-record grads + clip + noise) three ways
(docs/accounting.md#sampled-gaussian-mechanism).

(a) ours: :func:`fedlap_privacy.fl.methods.dp.dp_gradient` (per-record gradients from
    :mod:`fedlap_privacy.compute.per_sample`, clipped and summed ``DP_CHUNK`` records at a time;
    with the ``ghost_clipping`` fast path on, as by default, the norm-based clipped sum of
    :mod:`fedlap_privacy.compute.ghost_clipping`, compared on its own by ``ghost_clipping.py``);
    also the whole batch as one chunk, and its two per-sample methods, ``hooks`` and ``vmap``;
(b) Opacus ``GradSampleModule`` (per-record gradients through its hooks), then the same
    :func:`~fedlap_privacy.fl.methods.dp.clip_and_noise`;
(c) a naive loop: one forward/backward per record, then the same clipping.

All run on the ConvNet of docs/algorithms.md#convnet (width 128), interleaved within one run
so that they see the same machine load; checks first that they agree at sigma = 0, then
prints the median and best time of each and the ratios opacus/ours and naive/ours. On the
CPU (Linux) it also prints the peak memory one DP step adds to a fresh process, for
``dp_gradient`` in chunks of ``DP_CHUNK`` records and in one chunk (the C allocator tuned
as every ``fedlap-privacy`` command tunes it).

    python benchmarks/speed/dp_step.py [--batch-size 256] [--image-size 28] [--repeats 3]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from torch import Tensor, nn

from fedlap_privacy.compute.allocator import tune_allocator
from fedlap_privacy.compute.per_sample import per_sample_grads
from fedlap_privacy.fl.methods.dp import DP_CHUNK, clip_and_noise, dp_gradient
from fedlap_privacy.models import ModelConfig, build_model

CLIP, SIGMA = 1.0, 1.0


def opacus_step(
    gsm: GradSampleModule, x: Tensor, y: Tensor, sigma: float, batch: float, gen: torch.Generator
) -> list[Tensor]:
    for p in gsm.parameters():
        p.grad = None
        p.grad_sample = None
    F.cross_entropy(gsm(x), y, reduction="sum").backward()
    grads = [p.grad_sample for p in gsm.parameters()]
    return clip_and_noise(grads, CLIP, sigma, batch, gen)


def naive_step(
    model: nn.Module, x: Tensor, y: Tensor, sigma: float, batch: float, gen: torch.Generator
) -> list[Tensor]:
    params = list(model.parameters())
    rows: list[list[Tensor]] = [[] for _ in params]
    for i in range(x.shape[0]):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        for row, g in zip(rows, torch.autograd.grad(loss, params), strict=True):
            row.append(g)
    grads = [torch.stack(row) for row in rows]
    return clip_and_noise(grads, CLIP, sigma, batch, gen)


def _peak_kib() -> int:
    """This process's peak resident memory in KiB: VmHWM (ru_maxrss would carry the parent's
    peak over fork and exec on Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def peak_memory_child(args: argparse.Namespace) -> None:
    """In this fresh process: print the peak resident memory (GiB) one DP step adds."""
    tune_allocator({})
    torch.set_num_threads(1)
    model = build_model(ModelConfig(args.channels, args.image_size, 10))
    x = torch.randn(args.batch_size, args.channels, args.image_size, args.image_size)
    y = torch.randint(0, 10, (args.batch_size,))
    chunk = args.peak_child or None  # 0: one chunk
    before = _peak_kib()
    dp_gradient(model, x, y, CLIP, SIGMA, float(args.batch_size), None, chunk_size=chunk)
    print((_peak_kib() - before) / 2**20)


def peak_memory(args: argparse.Namespace) -> None:
    """Peak memory of one step in chunks of DP_CHUNK and in one chunk, one process each."""
    print("peak memory one DP step adds to a fresh process (one thread):")
    for chunk in (DP_CHUNK, 0):
        cmd = [sys.executable, __file__, "--batch-size", str(args.batch_size), "--image-size",
               str(args.image_size), "--channels", str(args.channels), "--peak-child",
               str(chunk)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1]
        label = f"chunks of {chunk}" if chunk else "one chunk"
        print(f"  dp_gradient, {label:16s} {float(out):6.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--no-naive", action="store_true", help="skip the naive loop")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--peak-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_child is not None:
        peak_memory_child(args)
        return
    warnings.filterwarnings("ignore", message=".*backward hook.*")  # Opacus, input w/o grad

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = ModelConfig(args.channels, args.image_size, 10)
    model = build_model(config).to(device)
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    size = (args.batch_size, args.channels, args.image_size, args.image_size)
    x = torch.randn(size, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    b = float(args.batch_size)
    gen = torch.Generator(device=device).manual_seed(0)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def ours_with(method: str) -> Callable[[float], list[Tensor]]:
        def step(sigma: float) -> list[Tensor]:
            grads = per_sample_grads(model, x, y, method=method)  # type: ignore[arg-type]
            return clip_and_noise(grads, CLIP, sigma, b, gen)

        return step

    candidates: dict[str, Callable[[float], list[Tensor]]] = {
        "ours (dp_gradient)": lambda s: dp_gradient(model, x, y, CLIP, s, b, gen),
        "ours, one chunk": lambda s: dp_gradient(model, x, y, CLIP, s, b, gen, chunk_size=None),
        "ours, method=hooks": ours_with("hooks"),
        "ours, method=vmap": ours_with("vmap"),
        "opacus GradSampleModule": lambda s: opacus_step(gsm, x, y, s, b, gen),
    }
    if not args.no_naive:
        candidates["naive per-record loop"] = lambda s: naive_step(model, x, y, s, b, gen)

    print(
        f"ConvNet {config.in_channels}x{config.image_size}x{config.image_size}, width "
        f"{config.width}, B={args.batch_size}, device={device}, "
        f"threads={torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}"
    )
    reference = candidates["ours (dp_gradient)"](0.0)
    scale = max(g.abs().max().item() for g in reference)
    for name, fn in candidates.items():  # also the warm-up
        err = max((u - v).abs().max().item() for u, v in zip(fn(0.0), reference, strict=True))
        print(
            f"  sigma=0 agreement with ours: {name:26s} max abs diff {err:.2e} "
            f"(of max |g| {scale:.2e})"
        )
        assert err <= 1e-4 * max(scale, 1.0), f"{name} disagrees with ours"

    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(args.repeats):  # interleaved: each round runs every candidate once
        for name, fn in candidates.items():
            sync()
            start = time.perf_counter()
            fn(SIGMA)
            sync()
            times[name].append(time.perf_counter() - start)

    print(
        f"time per DP step (sigma={SIGMA}, C={CLIP}), {args.repeats} repeats "
        f"(load average now {os.getloadavg()[0]:.2f}):"
    )
    for name, ts in times.items():
        print(f"  {name:26s} median {statistics.median(ts):7.3f} s   best {min(ts):7.3f} s")
    ours = statistics.median(times["ours (dp_gradient)"])
    ours_best = min(times["ours (dp_gradient)"])
    for other in ("opacus GradSampleModule", "naive per-record loop"):
        if other in times:
            print(
                f"  ratio {other} / ours: median {statistics.median(times[other]) / ours:.2f}"
                f"   best {min(times[other]) / ours_best:.2f}"
            )
    if device.type == "cpu" and os.path.exists("/proc/self/status"):
        peak_memory(args)


if __name__ == "__main__":
    main()
