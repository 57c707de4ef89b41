"""Time one FedLAP-DP client round phase by phase, the reference code against the package's.

One client round of FedLAP-DP (paper Algorithm 3; Wang et al., PoPETs 2024) split into

* DP gradients: the real-gradient targets, one sampled Gaussian mechanism release per real
  batch (``fl.dp.dp_gradient``);
* matching: the R_s synthetic-image updates per real batch (second-order gradients of the
  matching distance of Eq. 9-10 through differentiable siamese augmentation);
* local steps: the R_l model steps on the synthetic set;
* server optimisation (Eq. 14/16) on five clients' synthetic sets;

each also as a ratio to a plain forward+backward of a 64-record batch of the same model, and
the client round (the first three) as a whole.

Four variants, each in its own process (the C allocator and the kernel choice are
process-wide), interleaved repeat by repeat so that they see the same machine load, with
the same seeds:

* "before": the reference implementation kept verbatim in this file (the package's code
  when this benchmark was written) with glibc's default allocator and torch's kernels
  (``FEDLAP_KERNELS=off``: the ConvNet runs its modules, per-record gradients take the hook
  path for the whole batch at once, as they did then);
* "after": the package's :func:`client_approximation` and :func:`server_optimisation`
  (phases timed by wrapping ``fl.fedlap._real_gradient`` and ``fl.fedlap._model_steps``)
  with the allocator every ``fedlap-privacy`` command sets
  (:mod:`fedlap_privacy.allocator`), the fused C kernels (:mod:`fedlap_privacy.kernels`)
  and the written-out second-order matching step (:mod:`fedlap_privacy.second_order`);
* "after, torch kernels": the same without the C kernels, so also without the written-out
  matching step (it runs on them): autograd differentiates its own backward graph;
* "after, system allocator": the same with glibc's defaults (and the fused kernels); the
  last two split the speed-up between the code, the kernels and the allocator.

The script prints how far the before/after synthetic sets end apart: floating-point
rounding, amplified by lr_img = 100 with momentum over the round (moving the initial images
by 1e-6 moves the digits set by about 1.6 along one implementation alone; in float64 the
implementations agree to 1e-10, ``tests/core/test_kernels.py``).

Configurations: ``digits`` (the default ``fedlap-privacy train`` configuration, client 0
of the paper's non-IID split) and ``paper-dp`` (the ``paper-dp`` preset on 28x28 images,
``--records`` records of two classes: FashionMNIST's client 0 with ``--data-dir``, random
images otherwise; the speed does not depend on the pixels). ``paper-dp`` runs
``--fraction-loops`` of the preset's R_i x L_max trajectory loops and ``--server-epochs``
server epochs unless ``--full``, and also prints the full round extrapolated from them.

    python benchmarks/fedlap_round.py [--config digits|paper-dp|both] [--repeats 2]
        [--threads 1] [--records 1600] [--data-dir data/fashion-mnist] [--full]
        [--clock cpu|wall]

Times are process CPU seconds by default (``--clock wall`` for elapsed time): on a shared
machine they move far less with other processes' load than elapsed time does.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fedlap_privacy.fl.fedlap as fedlap
from fedlap_privacy.allocator import ALLOCATOR_ENV, AllocatorState, tune_allocator
from fedlap_privacy.data import load_dataset
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.augment import DSA
from fedlap_privacy.fl.config import PRESETS, TrainConfig
from fedlap_privacy.fl.dp import dp_gradient, poisson_sample
from fedlap_privacy.fl.fedlap import SyntheticSet, init_synthetic, structurally_zero
from fedlap_privacy.fl.simulation import client_parts, default_model_config
from fedlap_privacy.fl.trust_region import clone_params, distance, project_to_ball
from fedlap_privacy.kernels import KERNELS_ENV
from fedlap_privacy.models import ModelConfig, build_model

PHASES = ("dp gradients", "matching", "local steps", "server")
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_CLOCK = ["cpu"]


def _clock() -> float:
    """The chosen clock: CPU time of the process by default (with one thread, it does not
    count the time other processes take the core away on a shared machine)."""
    return CLOCKS[_CLOCK[0]]()


# ----------------------------------------------------------------------------------------
# Reference implementation ("before"): the package's code when this benchmark was added,
# with a timer per phase. Kept here, not in the package, so that the package has one path.


def ref_layer_distance(g_real: Tensor, g_syn: Tensor) -> Tensor:
    """Eq. 10 for one layer, as first implemented in ``fl.matching``."""
    if g_real.shape != g_syn.shape:
        raise ConfigError("real and synthetic gradients differ in shape")

    def rows(g: Tensor) -> Tensor:
        return g.reshape(1, -1) if g.dim() <= 1 else g.reshape(g.shape[0], -1)

    a, b = rows(g_real), rows(g_syn)
    dot = (a * b).sum(dim=1)
    norms = torch.linalg.vector_norm(a, dim=1) * torch.linalg.vector_norm(b, dim=1)
    return (1.0 - dot / (norms + 1e-6)).mean()


def ref_match_distance(
    g_real: list[Tensor], g_syn: tuple[Tensor, ...], mse_weight: float, include: list[bool]
) -> Tensor:
    """L_dis of Eq. 9-10, as first implemented in ``fl.matching``."""
    total = g_syn[0].new_zeros(())
    for i, (real, syn) in enumerate(zip(g_real, g_syn, strict=True)):
        if not include[i]:
            continue
        term = ref_layer_distance(real, syn)
        total = total + torch.where(real.ne(0).any(), term, term.new_zeros(()))
        if mse_weight != 0.0:
            total = total + mse_weight * (real - syn).square().sum()
    return total


def ref_model_steps(
    model: nn.Module, syn: SyntheticSet, steps: int, lr: float, anchor: list[Tensor], radius: float
) -> bool:
    params = list(model.parameters())
    for _ in range(steps):
        loss = F.cross_entropy(model(syn.images), syn.labels)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.sub_(lr * g)
        if project_to_ball(model, anchor, radius):
            return True
    return False


def ref_client_approximation(
    global_model: nn.Module, x: Tensor, y: Tensor, syn: SyntheticSet, cfg: TrainConfig,
    lr_net: float, generator: torch.Generator, augment: Callable[..., Any] | None,
    times: dict[str, float],
) -> SyntheticSet:
    """Algorithm 3 (FedLAP-DP) as first implemented in ``fl.fedlap``, timed per phase."""
    assert cfg.private and cfg.sigma is not None
    anchor = clone_params(global_model)
    model = copy.deepcopy(global_model)
    params = list(model.parameters())
    images = syn.images.detach().clone().requires_grad_(True)
    opt = torch.optim.SGD([images], lr=cfg.lr_img, momentum=cfg.img_momentum)
    rate = cfg.batch_size / x.shape[0]
    include = [not zero for zero in structurally_zero(model)]
    for _ in range(cfg.reinits):
        with torch.no_grad():
            for p, a in zip(params, anchor, strict=True):
                p.copy_(a)
        for _ in range(cfg.max_loops):
            if distance(model, anchor) >= cfg.radius:
                break
            for _ in range(cfg.real_batches):
                aug = augment(generator) if augment is not None else (lambda t: t)
                batch = poisson_sample(x.shape[0], rate, generator).to(x.device)
                start = _clock()
                # the whole batch's per-record gradients at once, as then (no chunks)
                g_real = dp_gradient(model, aug(x[batch]), y[batch], cfg.clip, cfg.sigma,
                                     cfg.batch_size, generator, chunk_size=None)
                times["dp gradients"] += _clock() - start
                start = _clock()
                for _ in range(cfg.syn_steps):
                    loss = F.cross_entropy(model(aug(images)), syn.labels)
                    g_syn = torch.autograd.grad(loss, params, create_graph=True)
                    dist = ref_match_distance(g_real, g_syn, cfg.mse_weight, include)
                    (images.grad,) = torch.autograd.grad(dist, [images])
                    opt.step()
                times["matching"] += _clock() - start
            current = SyntheticSet(images.detach(), syn.labels)
            start = _clock()
            reached = ref_model_steps(model, current, cfg.local_model_steps, lr_net, anchor,
                                      cfg.radius)
            times["local steps"] += _clock() - start
            if reached:
                break
    return SyntheticSet(images.detach(), syn.labels)


def ref_server_optimisation(
    model: nn.Module, sets: list[SyntheticSet], weights: list[float], radius: float | None,
    lr: float, epochs: int, batch_size: int, generator: torch.Generator, momentum: float,
    augment: Callable[..., Any] | None,
) -> int:
    """Eq. 14/16 as first implemented in ``fl.fedlap``."""
    anchor = clone_params(model)
    images = torch.cat([s.images for s in sets])
    labels = torch.cat([s.labels for s in sets])
    record_w = torch.cat([torch.full((len(s.labels),), w / len(s.labels))
                          for s, w in zip(sets, weights, strict=True)])
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    steps = 0
    for _ in range(epochs):
        order = torch.randperm(len(labels), generator=generator)
        for start in range(0, len(labels), batch_size):
            idx = order[start : start + batch_size]
            batch = images[idx] if augment is None else augment(generator)(images[idx])
            losses = F.cross_entropy(model(batch), labels[idx], reduction="none")
            loss = (losses * record_w[idx]).sum() / record_w[idx].sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
            if radius is not None and project_to_ball(model, anchor, radius):
                return steps
    return steps


# ----------------------------------------------------------------------------------------
# The package's code ("after"), its phases timed by wrapping two module-level functions.


@contextmanager
def timed_package(times: dict[str, float]) -> Iterator[None]:
    """Within the block, ``fl.fedlap``'s DP-gradient and local-step helpers add their time."""
    real, steps = fedlap._real_gradient, fedlap._model_steps

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = _clock()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name] += _clock() - start

        return wrapper

    fedlap._real_gradient = timed("dp gradients", real)  # type: ignore[assignment]
    fedlap._model_steps = timed("local steps", steps)  # type: ignore[assignment]
    try:
        yield
    finally:
        fedlap._real_gradient, fedlap._model_steps = real, steps  # type: ignore[assignment]


# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    name: str
    cfg: TrainConfig
    model: nn.Module
    x: Tensor
    y: Tensor
    scale: dict[str, float]  # full round / measured, per phase (1 when nothing is cut)


def make_setup(name: str, args: argparse.Namespace) -> Setup:
    if name == "digits":
        cfg = TrainConfig()
        data = load_dataset("digits")
        part = client_parts(cfg, data)[0]
        mc = default_model_config(cfg, data)
        x, y = torch.from_numpy(data.x_train[part]), torch.from_numpy(data.y_train[part])
        scale = dict.fromkeys(PHASES, 1.0)
    else:
        full = TrainConfig(**PRESETS["paper-dp"], dataset="fashion-mnist")
        cfg = full
        scale = dict.fromkeys(PHASES, 1.0)
        if not args.full:
            cfg = dataclasses.replace(full, reinits=1, max_loops=args.fraction_loops,
                                      server_epochs=args.server_epochs)
            loops = full.reinits * full.max_loops / (cfg.reinits * cfg.max_loops)
            scale = {"dp gradients": loops, "matching": loops, "local steps": loops,
                     "server": full.server_epochs / cfg.server_epochs}
        if args.data_dir:
            data = load_dataset("fashion-mnist", args.data_dir)
            part = client_parts(cfg, data)[0][: args.records]
            x, y = torch.from_numpy(data.x_train[part]), torch.from_numpy(data.y_train[part])
        else:
            g = torch.Generator().manual_seed(1)
            x = torch.randn(args.records, 1, 28, 28, generator=g)
            y = torch.arange(args.records) % 2
        mc = ModelConfig(1, 28, 10)
    torch.manual_seed(0)
    return Setup(name, cfg, build_model(mc), x, y, scale)


def plain_step_time(model: nn.Module, x: Tensor, repeats: int = 5) -> float:
    """Median time of a plain forward+backward of a 64-record batch (the unit of ratios)."""
    xb = x[:64] if x.shape[0] >= 64 else x.repeat(64 // x.shape[0] + 1, 1, 1, 1)[:64]
    yb = torch.zeros(64, dtype=torch.int64)
    m = copy.deepcopy(model)
    times = []
    for _ in range(repeats + 1):
        start = _clock()
        F.cross_entropy(m(xb), yb).backward()
        times.append(_clock() - start)
    return statistics.median(times[1:])


def run_round(s: Setup, which: str) -> tuple[dict[str, float], SyntheticSet]:
    """One client round and one server optimisation; per-phase seconds and S_k."""
    cfg = s.cfg
    times = dict.fromkeys(PHASES, 0.0)
    gen = torch.Generator().manual_seed(123)
    syn = init_synthetic(s.x, s.y, cfg.ipc, cfg.init, gen)
    dsa = DSA().draw if cfg.dsa else None
    lr = cfg.lr_net
    start = _clock()
    if which == "before":
        learned = ref_client_approximation(s.model, s.x, s.y, syn, cfg, lr, gen, dsa, times)
    else:
        with timed_package(times):
            learned = fedlap.client_approximation(s.model, s.x, s.y, syn, cfg, lr, gen,
                                                  dsa).synthetic
    total = _clock() - start
    times["matching"] = total - times["dp gradients"] - times["local steps"]
    # server: five clients' sets (this client's, relabelled as five disjoint class pairs)
    classes = torch.unique(learned.labels)
    sets = []
    for k in range(5):
        labels = learned.labels.clone()
        for j, c in enumerate(classes.tolist()):
            labels[learned.labels == c] = (2 * k + j) % 10
        sets.append(SyntheticSet(learned.images, labels))
    model = copy.deepcopy(s.model)
    gen = torch.Generator().manual_seed(7)
    start = _clock()
    server = ref_server_optimisation if which == "before" else fedlap.server_optimisation
    server(model, sets, [0.2] * 5, cfg.radius, lr, cfg.server_epochs, cfg.server_batch, gen,
           cfg.server_momentum, dsa)
    times["server"] = _clock() - start
    return times, learned


VARIANTS = {  # name: (code, C allocator, FEDLAP_KERNELS)
    "before": ("before", "system", "off"),
    "after": ("after", "tuned", "require"),
    "after, torch kernels": ("after", "tuned", "off"),
    "after, system allocator": ("after", "system", "require"),
}


def child(args: argparse.Namespace) -> None:
    """One variant in this process: warm up, time one round, save the times and S_k."""
    code, allocator, _ = VARIANTS[args.child]
    if allocator == "tuned":
        setting = tune_allocator({})
        if setting.state is not AllocatorState.TUNED:
            raise SystemExit(f"allocator not tuned here: {setting.reason}")
    s = make_setup(args.config, args)
    c = s.cfg
    warm = Setup(s.name, dataclasses.replace(c, max_loops=1, real_batches=1, server_epochs=1),
                 s.model, s.x, s.y, s.scale)
    run_round(warm, code)  # warm-up (allocator, kernels), not timed
    unit = plain_step_time(s.model, s.x)
    times, learned = run_round(s, code)
    torch.save({"times": times, "unit": unit, "images": learned.images}, args.save)


def run_child(args: argparse.Namespace, config: str, variant: str, path: Path) -> dict[str, Any]:
    """Run :func:`child` in a fresh process (the allocator is process-wide) and load its file."""
    cmd = [sys.executable, __file__, "--config", config, "--child", variant, "--save", str(path),
           "--threads", str(args.threads), "--records", str(args.records), "--fraction-loops",
           str(args.fraction_loops), "--server-epochs", str(args.server_epochs), "--clock",
           args.clock]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    if args.full:
        cmd.append("--full")
    env = {k: v for k, v in os.environ.items() if k != ALLOCATOR_ENV}
    env[KERNELS_ENV] = VARIANTS[variant][2]
    subprocess.run(cmd, check=True, env=env)
    return torch.load(path)


def report(name: str, args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> None:
    """Print the phase table of one configuration: median over repeats per variant."""
    s = make_setup(name, args)
    c = s.cfg
    print(f"\n== {name}: {tuple(s.x.shape)} client records, B={c.batch_size}, "
          f"R_i/L_max/R_b/R_s/R_l = {c.reinits}/{c.max_loops}/{c.real_batches}/"
          f"{c.syn_steps}/{c.local_model_steps}, ipc {c.ipc}, server epochs "
          f"{c.server_epochs}; threads {args.threads}, {args.clock} clock, load average "
          f"{os.getloadavg()[0]:.2f}, {args.repeats} repeat(s)")
    units = {v: statistics.median(r["unit"] for r in results[v]) for v in VARIANTS}
    print("   plain forward+backward of 64 records: " + ", ".join(
        f"{v} {units[v] * 1e3:.1f} ms" for v in VARIANTS))
    before, after = results["before"][-1]["images"], results["after"][-1]["images"]
    print(f"   synthetic sets before/after: max abs difference "
          f"{(before - after).abs().max().item():.2e} (of max |pixel| "
          f"{before.abs().max().item():.2e})")
    labels = list(VARIANTS)
    print(f"   {'phase':14s} " + " ".join(f"{v:>22s}" for v in labels)
          + f" {'speed-up':>9s} {'after/fb':>9s}")
    totals = dict.fromkeys(labels, 0.0)
    full = dict.fromkeys(labels, 0.0)
    for phase in PHASES:
        med = {v: statistics.median(r["times"][phase] for r in results[v]) for v in labels}
        for v in labels:
            totals[v] += med[v]
            full[v] += med[v] * s.scale[phase]
        print(f"   {phase:14s} " + " ".join(f"{med[v]:22.2f}" for v in labels)
              + f" {med['before'] / med['after']:8.2f}x {med['after'] / units['after']:9.0f}")
    client = {v: totals[v] - statistics.median(r["times"]["server"] for r in results[v])
              for v in labels}
    print(f"   {'client round':14s} " + " ".join(f"{client[v]:22.3f}" for v in labels)
          + f" {client['before'] / client['after']:8.2f}x")
    print(f"   {'total':14s} " + " ".join(f"{totals[v]:22.2f}" for v in labels)
          + f" {totals['before'] / totals['after']:8.2f}x")
    if any(v != 1.0 for v in s.scale.values()):
        print(f"   full {name} round (extrapolated from the measured fraction): "
              + ", ".join(f"{v} {full[v]:.0f} s" for v in labels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=("digits", "paper-dp", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--records", type=int, default=1600)
    parser.add_argument("--data-dir", default=None, help="FashionMNIST folder (paper-dp)")
    parser.add_argument("--fraction-loops", type=int, default=1,
                        help="paper-dp: trajectory loops run (of R_i x L_max = 20)")
    parser.add_argument("--server-epochs", type=int, default=10,
                        help="paper-dp: server epochs run (of 100)")
    parser.add_argument("--full", action="store_true", help="paper-dp: the whole round")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu",
                        help="cpu: process CPU time (default), wall: elapsed time")
    parser.add_argument("--child", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    _CLOCK[0] = args.clock
    torch.set_num_threads(args.threads)
    if args.child:
        child(args)
        return
    names = ("digits", "paper-dp") if args.config == "both" else (args.config,)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
            for repeat in range(args.repeats):
                for variant in VARIANTS:  # interleaved: every variant sees the same load
                    path = Path(tmp) / f"{name}-{repeat}-{len(results[variant])}.pt"
                    results[variant].append(run_child(args, name, variant, path))
            report(name, args, results)


if __name__ == "__main__":
    main()
