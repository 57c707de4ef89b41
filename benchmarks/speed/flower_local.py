"""Issue 58's Flower goal, as a user runs it: ``train --engine flower`` against in-process.

Runs the command line ``fedlap-privacy train --clients 5 --rounds 4`` (digits, every other
flag at its default) and the same with ``--engine flower``, each in a fresh process and its
own ``--out`` folder, ``--repeats`` times interleaved (in-process, Flower, in-process,
Flower, ...) so that both see the same machine. Prints for every run its wall time (the
command's, start-up included), the CPU seconds of its whole process tree (this process is a
child subreaper, so the processes a deployment orphans on shutdown, such as the ServerApp,
are reaped and counted here too: the steadier figure on a shared machine) and, for Flower,
where its time went (``flower-timings.json`` in its run folder: :mod:`fl.flower.timings`);
then the mean ratios and whether the goal holds: the Flower run within 3x the in-process
run plus 60 s. Prints the machine's load before and after each run: on a shared
machine compare within one run of this script only.

    python benchmarks/speed/flower_local.py [--clients 5] [--rounds 4] [--repeats 2] [-- FLAGS...]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


@dataclass
class Run:
    """One command's wall time, CPU seconds (its process tree) and, for Flower, its phases."""

    engine: str
    wall: float
    cpu: float
    load: tuple[float, float]  # 1-minute load average before and after
    accuracy: float | None
    phases: dict[str, object] = field(default_factory=dict)
    rounds: list[float] = field(default_factory=list)  # each round's seconds (metrics.jsonl)


def _subreaper() -> bool:
    """Adopt the processes our children orphan, so that their CPU time is counted."""
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    return False


def _reap(wait: float = 10.0) -> None:
    """Wait for the orphans we adopted (up to ``wait`` seconds)."""
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.1)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def run_once(engine: str, out: Path, args: argparse.Namespace) -> Run:
    """``fedlap-privacy train [--engine flower] --clients C --rounds R --out OUT FLAGS``."""
    exe = str(Path(sys.executable).parent / "fedlap-privacy")
    command = [exe, "train", "--clients", str(args.clients), "--rounds", str(args.rounds),
               "--out", str(out), *(["--engine", "flower"] if engine == "flower" else []),
               *args.flags]
    load, cpu = _load(), _cpu()
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    _reap()
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    timings = out / "flower-timings.json"
    phases = json.loads(timings.read_text()) if timings.exists() else {}
    return Run(engine, wall, _cpu() - cpu, (load, _load()),
               metrics[-1]["test_accuracy"] if metrics else None, phases,
               [float(m.get("seconds") or 0.0) for m in metrics])


def _print(run: Run) -> None:
    print(f"{run.engine:>10}: {run.wall:7.1f} s wall, {run.cpu:7.1f} CPU s, test accuracy "
          f"{run.accuracy:.4f}, load {run.load[0]:.1f} -> {run.load[1]:.1f}, rounds "
          + ", ".join(f"{s:.1f}" for s in run.rounds) + " s", flush=True)
    if run.phases:
        p = run.phases
        rounds = ", ".join(f"{s:.1f}" for s in p["rounds_s"])  # type: ignore[union-attr]
        print(f"{'':>12}SuperLink {p['superlink_s']:.1f} s, SuperNodes "
              f"{p['supernodes_s']:.1f} s, ServerApp start {p['serverapp_s']:.1f} s, "
              f"discovery {p['discovery_s']:.1f} s, training {p['training_s']:.1f} s "
              f"(rounds {rounds}), finish {p['finish_s']:.1f} s, shutdown "
              f"{p['shutdown_s']:.1f} s; deployment total {p['total_s']:.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("flags", nargs="*", help="more train flags (after --)")
    args = parser.parse_args()
    reaper = _subreaper()
    print(f"load {Path('/proc/loadavg').read_text().strip()} (CPUs: {os.cpu_count()}); "
          f"orphans counted: {reaper}", flush=True)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="flower-local-") as tmp:
        for i in range(args.repeats):
            for engine in ("in-process", "flower"):
                run = run_once(engine, Path(tmp) / f"{engine}-{i}", args)
                runs.append(run)
                _print(run)

    def mean(engine: str, key: str) -> float:
        values = [getattr(r, key) for r in runs if r.engine == engine]
        return sum(values) / len(values)

    base, flower = mean("in-process", "wall"), mean("flower", "wall")
    cpu_base, cpu_flower = mean("in-process", "cpu"), mean("flower", "cpu")
    goal = 3 * base + 60
    print(f"mean wall: in-process {base:.1f} s, flower {flower:.1f} s ({flower / base:.2f}x); "
          f"CPU: in-process {cpu_base:.1f} s, flower {cpu_flower:.1f} s "
          f"({cpu_flower / cpu_base:.2f}x)")
    print(f"goal: flower <= 3 x {base:.1f} + 60 = {goal:.1f} s: "
          f"{'met' if flower <= goal else 'missed'} (every Flower run: "
          f"{'met' if all(r.wall <= goal for r in runs if r.engine == 'flower') else 'not all'})")
    print(f"load {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
