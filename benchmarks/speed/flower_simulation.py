"""Flower's Simulation Engine against the in-process engine at cross-device scale, in one run.

FedAvg on FashionMNIST split into ``--clients`` clients with McMahan et al.'s shards (60 records
each at 1,000 clients, 6 at 10,000), the small CNN (ConvNet width 32, depth 2), about
``--cohort`` clients a round (Poisson sampling), seeded batches (``reproducible_noise``),
three ways, each in a fresh process, one after the other on the same machine:

* ``packed``: the in-process engine's packed cohort (``cohort_training=packed``, torch's
  default threads): the fastest way on one machine;
* ``loop``: the in-process engine training the clients one by one, one torch thread (what a
  seeded run does by default, and the reference of the bit-for-bit check);
* ``flower-simulation``: ``--engine flower-simulation`` with one CPU per virtual SuperNode
  (Ray actors side by side), its node policy admitting FedAvg, its batch size and seeded
  batches.

Prints each run's wall time, its start-up (the wall time before round 1 ends, less the
round: Ray's start and the discovery of every virtual node, the data's load and split), its
rounds' seconds as recorded, the CPU seconds and the peak resident memory of its whole
process tree (the run's process, Ray's GCS, raylet and actors: sampled from ``/proc`` every
0.2 s, Linux only), the ratios, and whether the Simulation Engine's checkpoint (weights,
ledger, metrics) equals the loop's bit for bit (``bit for bit: True``; with ``--runs``
leaving out the loop or the engine, not checked). Prints the machine's load before and
after: on a shared machine compare within one run.

    python benchmarks/speed/flower_simulation.py [--data-dir DIR] [--clients 1000] [--rounds 2]
        [--cohort 100] [--runs packed,loop,flower-simulation] [--one-thread] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

RUNS = ("packed", "loop", "flower-simulation")
FLOWER_RUNS = ("flower-simulation",)


def _config(spec: dict):
    from fedlap_privacy.fl.config import TrainConfig

    return TrainConfig(
        method="fedavg", dataset="fashion-mnist", data_dir=spec["data_dir"], split="shards",
        clients=spec["clients"], rounds=spec["rounds"], batch_size=5, local_steps=5,
        lr_local=0.05, width=32, depth=2, split_seed=0, reproducible_noise=True,
        client_fraction=min(1.0, spec["cohort"] / spec["clients"]),
        cohort_training="packed" if spec["run"] == "packed" else "loop",
    ).validate()


def worker(spec: dict) -> dict:
    """One run in this (fresh) process."""
    from fedlap_privacy.fl.engine.events import RoundEnded, RunEvent
    from fedlap_privacy.fl.engine.simulation import train
    from fedlap_privacy.fl.flower.simulation_engine import run_simulation_engine

    cfg = _config(spec)
    start = time.perf_counter()
    first: list[float] = []

    def progress(event: RunEvent) -> None:
        if isinstance(event, RoundEnded) and not first:
            first.append(time.perf_counter() - start)

    if spec["run"] in FLOWER_RUNS:
        policy = Path(spec["out"]).with_suffix(".policy.toml")
        policy.write_text('threat-model = "trusted-server"\nallowed-methods = ["fedavg"]\n'
                          "allow-reproducible-noise = true\nmin-batch-size = 1\n")
        history = run_simulation_engine(cfg, spec["out"], "cpu", node_policy=policy,
                                        callback=progress).history
    else:
        history = train(cfg, spec["out"], "cpu", progress).history
    return {"wall": time.perf_counter() - start, "startup": first[0] - history[0].seconds,
            "rounds": [h.seconds for h in history],
            "clients": [h.clients for h in history], "accuracy": history[-1].test_accuracy}


def same_run(a: Path, b: Path) -> bool:
    """The two run folders hold the same weights, ledger and metrics (timings aside)."""
    import torch

    from fedlap_privacy.state.checkpoint import load_checkpoint

    x, y = load_checkpoint(a / "ckpt.pt"), load_checkpoint(b / "ckpt.pt")
    strip = [[{k: v for k, v in h.items() if k != "seconds"} for h in c["history"]]
             for c in (x, y)]
    return (x["ledger"] == y["ledger"] and strip[0] == strip[1]
            and x["model_state"].keys() == y["model_state"].keys()
            and all(torch.equal(x["model_state"][k], y["model_state"][k])
                    for k in x["model_state"]))


@dataclass
class TreeUsage:
    """CPU seconds and peak resident memory of a process and everything it starts (its
    descendants, and the processes of its session: Ray's daemons), sampled from ``/proc``.
    A process's CPU time is its last sample's (at most one interval short at its exit)."""

    root: int
    interval: float = 0.2
    cpu: dict[int, float] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # each process's title
    peak_mib: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)

    def _sample(self) -> None:
        tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
        stats: dict[int, list[str]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:  # fields after the command's closing parenthesis
                    text = (entry / "stat").read_text()
                except OSError:
                    continue
                stats[int(entry.name)] = text[text.rindex(")") + 2:].split()
        children: dict[int, list[int]] = {}
        for pid, f in stats.items():
            children.setdefault(int(f[1]), []).append(pid)
        tree, todo = set(), [self.root]
        while todo:
            pid = todo.pop()
            if pid not in tree:
                tree.add(pid)
                todo.extend(children.get(pid, []))
        tree |= {pid for pid, f in stats.items() if int(f[3]) == self.root}  # its session
        rss = 0
        for pid in tree & stats.keys():
            f = stats[pid]
            self.cpu[pid] = (int(f[11]) + int(f[12])) / tick  # utime, stime
            with contextlib.suppress(OSError):  # its title; an actor's (ray::CLASS...) kept
                title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(
                    errors="replace")
                if not self.names.get(pid, "").startswith("ray::") or (
                        title.startswith("ray::") and "IDLE" not in title):
                    self.names[pid] = title
            rss += int(f[21]) * page
        self.peak_mib = max(self.peak_mib, rss / 2**20)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> TreeUsage:
        threading.Thread(target=self._watch, daemon=True).start()
        return self

    def stop(self) -> float:
        """Stops sampling; the tree's CPU seconds."""
        self._stop.set()
        return sum(self.cpu.values())


def machine_load() -> str:
    """The machine's load line (``uptime``), printed before and after a benchmark."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="/work/shared/data/fashion-mnist")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cohort", type=int, default=100)
    parser.add_argument("--runs", default=",".join(RUNS[:3]),
                        help="which of " + ", ".join(RUNS) + " to run, comma-separated")
    parser.add_argument("--one-thread", action="store_true",
                        help="the packed cohort with one torch thread too (a loaded machine's "
                        "contended threads cost it more than the others)")
    parser.add_argument("--out", default=None, help="keep the run folders here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    print(f"load before: {machine_load()}  (CPUs: {os.cpu_count()})")
    with tempfile.TemporaryDirectory(prefix="flower-sim-bench-") as tmp:
        root = Path(args.out or tmp)
        rows = {}
        runs = [r for r in RUNS if r in args.runs.split(",")]
        for run in runs:
            spec = {"data_dir": args.data_dir, "clients": args.clients, "rounds": args.rounds,
                    "cohort": args.cohort, "run": run, "out": str(root / run)}
            env = dict(os.environ)
            if run != "packed" or args.one_thread:  # one thread: the actors' count (bit for bit)
                env["OMP_NUM_THREADS"] = "1"
            proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env, start_new_session=True)
            usage = TreeUsage(proc.pid).start()
            stdout, stderr = proc.communicate()
            cpu = usage.stop()
            if proc.returncode != 0:
                print(f"{run}: failed\n{stderr[-3000:]}")
                sys.exit(1)
            rows[run] = row = json.loads(stdout.strip().splitlines()[-1])
            row.update(cpu=cpu, peak_mib=usage.peak_mib)
            print(f"{run:>18}: {row['wall']:7.1f} s wall, start-up {row['startup']:6.1f} s, "
                  "rounds " + ", ".join(f"{s:.2f}" for s in row["rounds"])
                  + f" s ({', '.join(map(str, row['clients']))} clients), {cpu:7.1f} CPU s, "
                  f"peak {usage.peak_mib:6.0f} MiB (process tree), test accuracy "
                  f"{row['accuracy']:.4f}", flush=True)
        for run in ("loop", *FLOWER_RUNS):
            if run not in rows or "packed" not in rows:
                continue
            ratio = sum(rows[run]["rounds"]) / sum(rows["packed"]["rounds"])
            print(f"{run:>18}: rounds {ratio:6.2f}x the packed cohort's, wall "
                  f"{rows[run]['wall'] / rows['packed']['wall']:6.2f}x, CPU "
                  f"{rows[run]['cpu'] / rows['packed']['cpu']:6.2f}x")
        for run in FLOWER_RUNS:
            if {"loop", run} <= rows.keys():
                print(f"bit for bit ({run}): {same_run(root / 'loop', root / run)}")
    print(f"load after: {machine_load()}")


if __name__ == "__main__":
    main()
