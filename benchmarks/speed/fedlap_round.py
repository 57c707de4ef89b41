"""Time one FedLAP-DP client round phase by phase, the reference code against the package's.

One client round of FedLAP-DP (paper Algorithm 3; Wang et al., PoPETs 2024) split into

* DP gradients: the real-gradient targets, one sampled Gaussian mechanism release per real
  batch (``fl.methods.dp.dp_gradient``);
* matching: the R_s synthetic-image updates per real batch (second-order gradients of the
  matching distance of Eq. 9-10 through differentiable siamese augmentation);
* local steps: the R_l model steps on the synthetic set;
* server optimisation (Eq. 14/16) on five clients' synthetic sets;

each also as a ratio to a plain forward+backward of a 64-record batch of the same model, and
the client round (the first three) as a whole.

The variants are the package itself, its fast paths switched on and off through their one
door (:mod:`fedlap_privacy.compute.fast_paths`), each in its own process (the C allocator and huge
pages are process-wide, set at start-up), interleaved repeat by repeat so that they see the
same machine load, with the same seeds:

* "before": every fast path off (``FEDLAP_FAST_PATHS=off``): the ConvNet runs torch's
  modules, autograd differentiates its own backward graph for the matching step, the
  per-record gradients take the Opacus-style hook path, glibc's default allocator, torch's
  default pages: the reference implementations, what a user would otherwise run;
* "after": every fast path on (the fused C kernels required);
* "after without P", for each path P of ``--without`` (default: kernels, second-order,
  allocator): the same with that one path off (``FEDLAP_FAST_PATHS=-P``); without the
  kernels the written-out matching step and the fused per-record gradients are off too
  (they run on them). These split the speed-up between the paths.

The phases are the ones :func:`fedlap_privacy.fl.methods.fedlap.client_approximation` marks for
:mod:`fedlap_privacy.fl.engine.phase_timer`; the server optimisation is timed around its call.

The script prints how far the before/after synthetic sets end apart: floating-point
rounding, amplified by lr_img = 100 with momentum over the round (moving the initial images
by 1e-6 moves the digits set by about 1.6 along one implementation alone; in float64 the
fast and the reference paths agree to 1e-10, ``tests/core/compute/test_kernels.py``).

Configurations: ``digits`` (the default ``fedlap-privacy train`` configuration, client 0
of the paper's non-IID split) and ``paper-dp`` (the ``paper-dp`` preset on 28x28 images,
``--records`` records of two classes: FashionMNIST's client 0 with ``--data-dir``, random
images otherwise; the speed does not depend on the pixels). ``paper-dp`` runs
``--fraction-loops`` of the preset's R_i x L_max trajectory loops and ``--server-epochs``
server epochs unless ``--full``, and also prints the full round extrapolated from them.

    python benchmarks/speed/fedlap_round.py [--config digits|paper-dp|both] [--repeats 2]
        [--threads 1] [--records 1600] [--data-dir data/fashion-mnist] [--full]
        [--clock cpu|wall] [--without kernels,second-order,allocator]
    python benchmarks/speed/fedlap_round.py --config digits --repeats 3 --without kernels,gn-relu-pool

The smallest run: ``--config digits --repeats 1 --without ""`` (before and after only).

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
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from kernel_twins import KERNELS, route_to_twin
from torch import Tensor, nn

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.allocator import AllocatorState, tune_allocator
from fedlap_privacy.data.datasets import load_dataset
from fedlap_privacy.fl.config import PRESETS, TrainConfig
from fedlap_privacy.fl.engine.phase_timer import timing
from fedlap_privacy.fl.engine.simulation import client_parts, default_model_config
from fedlap_privacy.fl.methods.augment import DSA
from fedlap_privacy.fl.methods.fedlap import (
    SyntheticSet,
    client_approximation,
    init_synthetic,
    server_optimisation,
)
from fedlap_privacy.models import ModelConfig, build_model

#: the client round's phases as fl.methods.fedlap marks them, then the server optimisation
PHASES = ("real gradients", "matching", "local steps", "server")
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_CLOCK = ["cpu"]


def _clock() -> float:
    """The chosen clock: CPU time of the process by default (with one thread, it does not
    count the time other processes take the core away on a shared machine)."""
    return CLOCKS[_CLOCK[0]]()


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
            scale = {"real gradients": loops, "matching": loops, "local steps": loops,
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


def run_round(s: Setup) -> tuple[dict[str, float], float, float, SyntheticSet]:
    """One client round and one server optimisation by the package, with the fast paths
    this process was started with: per-phase seconds, the client round's (the chosen clock,
    then elapsed seconds) and S_k."""
    cfg = s.cfg
    gen = torch.Generator().manual_seed(123)
    syn = init_synthetic(s.x, s.y, cfg.ipc, cfg.init, gen)
    dsa = DSA().draw if cfg.dsa else None
    lr = cfg.lr_net
    with timing(_clock) as phases:
        start, start_wall = _clock(), time.perf_counter()
        learned = client_approximation(s.model, s.x, s.y, syn, cfg, lr, gen, dsa).synthetic
        client, client_wall = _clock() - start, time.perf_counter() - start_wall
    times = {name: phases.get(name) for name in PHASES}
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
    server_optimisation(model, sets, [0.2] * 5, cfg.radius, lr, cfg.server_epochs,
                        cfg.server_batch, gen, cfg.server_momentum, dsa)
    times["server"] = _clock() - start
    return times, client, client_wall, learned


BEFORE, AFTER = "before", "after"
#: the door's variables, set by this script for each variant (not inherited)
_SWITCHES = (fast_paths.FAST_PATHS_ENV, fast_paths.KERNELS_ENV, fast_paths.ALLOCATOR_ENV,
             fast_paths.FOLLOW_ENV, "THP_MEM_ALLOC_ENABLE")


def variants(without: list[str]) -> dict[str, dict[str, str]]:
    """Variant name -> the fast-path variables its process starts with (module docstring)."""
    found = {BEFORE: {fast_paths.FAST_PATHS_ENV: "off"},
             AFTER: {fast_paths.FAST_PATHS_ENV: "on", fast_paths.KERNELS_ENV: "require"}}
    for path in without:
        if path in KERNELS:  # routed to its twin in the child (child_kernel)
            found[f"after without {path}"] = dict(found[AFTER])
            continue
        off = ",".join(f"-{p}" for p in path.split("+"))
        found[f"after without {path}"] = {fast_paths.FAST_PATHS_ENV: off}
    return found


def child_kernel(variant: str) -> str | None:
    """The C kernel a variant routes to its torch twin, None for a path variant."""
    name = variant.removeprefix("after without ")
    return name if name != variant and name in KERNELS else None


def child(args: argparse.Namespace) -> None:
    """One variant in this process: warm up, time one round, save the times and S_k."""
    paths = fast_paths.current()
    kernel = child_kernel(args.child)
    if kernel is not None:
        route_to_twin(kernel)
    setting = tune_allocator()  # as every fedlap-privacy command does at start-up
    if paths.allocator and setting.state is not AllocatorState.TUNED:
        raise SystemExit(f"allocator not tuned here: {setting.reason}")
    s = make_setup(args.config, args)
    c = s.cfg
    warm = Setup(s.name, dataclasses.replace(c, max_loops=1, real_batches=1, server_epochs=1),
                 s.model, s.x, s.y, s.scale)
    run_round(warm)  # warm-up (allocator, kernels), not timed
    unit = plain_step_time(s.model, s.x)
    times, client, client_wall, learned = run_round(s)
    torch.save({"times": times, "client": client, "client_wall": client_wall, "unit": unit, "images": learned.images,
                "paths": dataclasses.asdict(paths.effective())}, args.save)


def run_child(args: argparse.Namespace, config: str, variant: str, path: Path
              ) -> dict[str, Any]:
    """Run :func:`child` in a fresh process with the variant's switches; load its file."""
    cmd = [sys.executable, __file__, "--config", config, "--child", variant, "--save", str(path),
           "--threads", str(args.threads), "--records", str(args.records), "--fraction-loops",
           str(args.fraction_loops), "--server-epochs", str(args.server_epochs), "--clock",
           args.clock, "--without", ",".join(args.without)]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    if args.full:
        cmd.append("--full")
    env = {k: v for k, v in os.environ.items() if k not in _SWITCHES}
    env.update(variants(args.without)[variant])
    subprocess.run(cmd, check=True, env=env)
    return torch.load(path, weights_only=True)


def report(name: str, args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> None:
    """Print the phase table of one configuration: median over repeats per variant."""
    s = make_setup(name, args)
    c = s.cfg
    print(f"\n== {name}: {tuple(s.x.shape)} client records, B={c.batch_size}, "
          f"R_i/L_max/R_b/R_s/R_l = {c.reinits}/{c.max_loops}/{c.real_batches}/"
          f"{c.syn_steps}/{c.local_model_steps}, ipc {c.ipc}, server epochs "
          f"{c.server_epochs}; threads {args.threads}, {args.clock} clock, load average "
          f"{os.getloadavg()[0]:.2f}, {args.repeats} repeat(s)")
    labels = list(results)
    for v in labels:
        on = [k for k in fast_paths.PATHS if results[v][-1]["paths"][k]]
        print(f"   {v}: fast paths running: {', '.join(on) or 'none'}")
    units = {v: statistics.median(r["unit"] for r in results[v]) for v in labels}
    print("   plain forward+backward of 64 records: " + ", ".join(
        f"{v} {units[v] * 1e3:.1f} ms" for v in labels))
    before, after = results[BEFORE][-1]["images"], results[AFTER][-1]["images"]
    print(f"   synthetic sets before/after: max abs difference "
          f"{(before - after).abs().max().item():.2e} (of max |pixel| "
          f"{before.abs().max().item():.2e})")
    width = max(10, *(len(v) for v in labels))
    print(f"   {'phase':14s} " + " ".join(f"{v:>{width}s}" for v in labels)
          + f" {'speed-up':>9s} {'after/fb':>9s}")
    med = {phase: {v: statistics.median(r["times"][phase] for r in results[v]) for v in labels}
           for phase in PHASES}
    for phase in PHASES:
        m = med[phase]
        print(f"   {phase:14s} " + " ".join(f"{m[v]:{width}.2f}" for v in labels)
              + f" {m[BEFORE] / m[AFTER]:8.2f}x {m[AFTER] / units[AFTER]:9.0f}")
    client = {v: statistics.median(r["client"] for r in results[v]) for v in labels}
    total = {v: client[v] + med["server"][v] for v in labels}
    print(f"   {'client round':14s} " + " ".join(f"{client[v]:{width}.3f}" for v in labels)
          + f" {client[BEFORE] / client[AFTER]:8.2f}x")
    print(f"   {'total':14s} " + " ".join(f"{total[v]:{width}.2f}" for v in labels)
          + f" {total[BEFORE] / total[AFTER]:8.2f}x")
    if any(v != 1.0 for v in s.scale.values()):
        # the client round's time outside the marked phases scales with the loops too
        full = {v: client[v] * s.scale["matching"] + med["server"][v] * s.scale["server"]
                for v in labels}
        print(f"   full {name} round (extrapolated from the measured fraction): "
              + ", ".join(f"{v} {full[v]:.0f} s" for v in labels))
    wall = {v: statistics.median(r["client_wall"] for r in results[v]) for v in labels}
    print(f"   {'client, wall':14s} " + " ".join(f"{wall[v]:{width}.3f}" for v in labels)
          + f" {wall[BEFORE] / wall[AFTER]:8.2f}x")
    buys(labels, results)


def buys(labels: list[str], results: dict[str, list[dict[str, Any]]]) -> None:
    """What each switched-off path or kernel buys: "after without P" over "after", the
    median of the repeat-by-repeat ratios (each repeat's variants ran one after the other)
    and their range, for each phase, the client round (clock chosen, and wall)."""
    after = results[AFTER]

    def ratios(v: str, of: Any) -> str:
        r = sorted(of(w) / of(a) for w, a in zip(results[v], after, strict=True))
        return f"{statistics.median(r):.2f}x [{r[0]:.2f}, {r[-1]:.2f}]"

    for v in labels:
        if v in (BEFORE, AFTER):
            continue
        parts = [f"{phase} {ratios(v, lambda r, p=phase: r['times'][p])}" for phase in PHASES]
        parts.append(f"client round {ratios(v, lambda r: r['client'])}")
        parts.append(f"client wall {ratios(v, lambda r: r['client_wall'])}")
        print(f"   {v.removeprefix('after without ')} buys: " + "; ".join(parts))


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
    parser.add_argument("--without", default="kernels,second-order,allocator",
                        help="fast paths to switch off one at a time, besides before (all "
                             "off) and after (all on); comma-separated, '' for none; "
                             "'a+b' switches a and b off together")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = [n.strip().replace("_", "-") for n in args.without.split(",") if n.strip()]
    known = [p.replace("_", "-") for p in fast_paths.PATHS]
    if any(n not in KERNELS and p not in known for n in names for p in n.split("+")):
        parser.error(f"--without takes names among {', '.join(known + list(KERNELS))}")
    args.without = names
    _CLOCK[0] = args.clock
    torch.set_num_threads(args.threads)
    if args.child:
        child(args)
        return
    configs = ("digits", "paper-dp") if args.config == "both" else (args.config,)
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs:
            results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants(args.without)}
            for repeat in range(args.repeats):
                for variant in results:  # interleaved: every variant sees the same load
                    path = Path(tmp) / f"{name}-{repeat}-{len(results[variant])}.pt"
                    results[variant].append(run_child(args, name, variant, path))
            report(name, args, results)


if __name__ == "__main__":
    main()
