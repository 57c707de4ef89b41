"""A local Flower deployment against the in-process engine, in one run: the per-round tax.

``train --engine flower --clients 5 --rounds 4`` (digits defaults: FedLAP-DP, the CPU) two
ways, each in a fresh process, one after the other so that they see the same machine:

* ``in-process``: ``--engine simulation``;
* ``flower``: a local deployment of Flower's own commands, in Flower's default isolation (a
  new ``flwr-clientapp`` process for every message).

Prints each run's wall time (start-up included), the CPU time of its whole process tree (the
steadier figure on a shared machine), its rounds' seconds as the run recorded them,
the Flower / in-process ratios, and whether the goal of issue 58 holds: the Flower run
within 3x the in-process run plus 60 s. Prints the machine's load (``uptime``)
before and after: on a shared machine compare within one run only.

    python benchmarks/speed/flower_rounds.py [--clients 5] [--rounds 4] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flower_simulation import machine_load

RUNS = (("in-process", False), ("flower", True))


def worker(spec: dict) -> dict:
    """One run in this (fresh) process; its wall time and the rounds' recorded seconds."""
    from fedlap_privacy.fl.config_resolve import resolve_config
    from fedlap_privacy.fl.engine.simulation import train
    from fedlap_privacy.fl.flower.runner import run_flower

    cfg = resolve_config(None, {"clients": spec["clients"], "rounds": spec["rounds"]},
                         spec["sets"], schedule="auto")
    start = time.perf_counter()
    if not spec["flower"]:
        result = train(cfg, spec["out"], "cpu")
        history = result.history
    else:
        flower = run_flower(cfg, spec["out"], device="cpu")
        history = flower.history
    wall = time.perf_counter() - start
    return {"wall": wall, "rounds": [h.seconds for h in history],
            "accuracy": history[-1].test_accuracy if history else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    print(f"load before: {machine_load()}  (CPUs: {os.cpu_count()})")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="flower-rounds-") as tmp:
        for name, flower in RUNS:
            spec = {"clients": args.clients, "rounds": args.rounds, "sets": args.sets,
                    "flower": flower, "out": str(Path(tmp) / name)}
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                  capture_output=True, text=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if done.returncode != 0:
                print(f"{name}: failed\n{done.stderr[-2000:]}")
                sys.exit(1)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["cpu"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
            rows[name] = row
            print(f"{name:>20}: {row['wall']:7.1f} s wall, {row['cpu']:7.1f} CPU s, rounds "
                  + ", ".join(f"{s:.1f}" for s in row["rounds"])
                  + f" s, test accuracy {row['accuracy']:.4f}", flush=True)
    base = rows["in-process"]["wall"]
    for name in ("flower",):
        wall = rows[name]["wall"]
        rounds = sum(rows[name]["rounds"]) / max(sum(rows["in-process"]["rounds"]), 1e-9)
        cpu = rows[name]["cpu"] / max(rows["in-process"]["cpu"], 1e-9)
        print(f"{name:>20}: {wall / base:5.2f}x the in-process wall time, {cpu:5.2f}x its CPU "
              f"time, rounds {rounds:5.2f}x; goal (<= 3 x {base:.1f} + 60 = "
              f"{3 * base + 60:.1f} s): {'met' if wall <= 3 * base + 60 else 'missed'}")
    print(f"load after: {machine_load()}")


if __name__ == "__main__":
    main()
