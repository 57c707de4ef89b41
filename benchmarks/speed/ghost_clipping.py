"""Time one DP gradient with and without ghost clipping (fedlap_privacy.compute.ghost_clipping).

Three ways, on the FedLAP-DP ConvNet (width 128, depth 3, 1x28x28 by default), interleaved
within one run at each batch size so that they see the same machine load:

(a) per-record: :func:`~fedlap_privacy.fl.methods.dp.dp_gradient` with the
    ``ghost_clipping`` fast path off (every record's gradient through the fused pass,
    clipped and summed ``DP_CHUNK`` records at a time);
(b) ghost: the same call with the path on (norms, then one weighted sum per layer);
(c) Opacus' fast gradient clipping (``GradSampleModuleFastGradientClipping``, ghost
    clipping on: a first backward for the norms, a second of the reweighted loss), then
    the same noise.

``--model mlp`` runs a 784-256-256-10 ``TabularMLP`` on flat 28x28 records instead (every
layer a Linear on one position: ghost norms throughout).

Checks first that the three agree at sigma = 0, then prints the median time of each and the
ratios per-record / ghost and Opacus / ghost, with the load average.

    python benchmarks/speed/ghost_clipping.py [--batch-sizes 64,128,256] [--repeats 3] [--threads 1]
        [--model convnet|mlp]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from torch import Tensor

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.fl.methods.dp import dp_gradient, release
from fedlap_privacy.models import ModelConfig, TabularMLP, build_model

CLIP = 1.0


def opacus_ghost(gsm: GradSampleModuleFastGradientClipping, x: Tensor, y: Tensor, sigma: float,
                 batch: float, gen: torch.Generator) -> list[Tensor]:
    """Opacus' two backward passes (``DPTensorFastGradientClipping.backward``), our noise."""
    for p in gsm.parameters():
        p.grad = None
    losses = F.cross_entropy(gsm(x), y, reduction="none")
    losses.sum().backward(retain_graph=True)
    coeff = gsm.get_clipping_coef()
    for p in gsm.parameters():
        p.grad = None
    gsm.disable_hooks()
    (coeff * losses).sum().backward()
    gsm.enable_hooks()
    return release([p.grad for p in gsm.parameters()], CLIP, sigma, batch, gen)


def time_batch(model: torch.nn.Module, gsm: GradSampleModuleFastGradientClipping, x: Tensor,
               repeats: int) -> None:
    """Check the three agree at sigma 0 on ``x``, time them interleaved, print medians."""
    batch = x.shape[0]
    y = torch.randint(0, 10, (batch,))
    gen = torch.Generator().manual_seed(0)
    b = float(batch)

    def ours(ghost: bool) -> Callable[[float], list[Tensor]]:
        def step(sigma: float) -> list[Tensor]:
            with fast_paths.using(ghost_clipping=ghost):
                return dp_gradient(model, x, y, CLIP, sigma, b, gen)
        return step

    candidates = {"per-record (ghost off)": ours(False), "ghost (ours)": ours(True),
                  "Opacus ghost clipping": lambda s: opacus_ghost(gsm, x, y, s, b, gen)}
    reference = candidates["per-record (ghost off)"](0.0)
    scale = max(g.abs().max().item() for g in reference)
    for name, fn in candidates.items():  # also the warm-up
        err = max((u - v).abs().max().item() for u, v in zip(fn(0.0), reference, strict=True))
        assert err <= 1e-4 * max(scale, 1.0), f"{name} disagrees: {err:.2e}"
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn(1.0)
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ghost = med["ghost (ours)"]
    print(f"B={batch} (agree at sigma 0; median of {repeats}, load "
          f"{os.getloadavg()[0]:.2f}): " + ", ".join(
              f"{name} {t:.3f} s" for name, t in med.items()))
    print(f"  ratio per-record / ghost {med['per-record (ghost off)'] / ghost:.2f}, "
          f"Opacus / ghost {med['Opacus ghost clipping'] / ghost:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="64,128,256")
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--model", choices=("convnet", "mlp"), default="convnet")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*backward hook.*")  # Opacus, input w/o grad
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ModelConfig(1, args.image_size, 10)
    shape: tuple[int, ...] = (1, args.image_size, args.image_size)
    model: torch.nn.Module = build_model(config)
    if args.model == "mlp":
        shape = (args.image_size * args.image_size,)
        model = TabularMLP(shape[0], 10, width=256, depth=2)
    gsm = GradSampleModuleFastGradientClipping(copy.deepcopy(model), max_grad_norm=CLIP,
                                               use_ghost_clipping=True, loss_reduction="sum")
    name = (f"ConvNet 1x{args.image_size}x{args.image_size}, width {config.width}, depth "
            f"{config.depth}" if args.model == "convnet" else f"MLP {shape[0]}-256-256-10")
    print(f"{name}, threads={torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.2f}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        time_batch(model, gsm, torch.randn(batch, *shape), args.repeats)


if __name__ == "__main__":
    main()
