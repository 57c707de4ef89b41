"""FedLAP-DP's clients side by side on Flower's Simulation Engine, against the in-process
engine, in one run.

``train --method fedlap-dp`` on digits (the tests' small configuration: ``--set width=16
reinits=1 max_loops=2 real_batches=2 syn_steps=2 local_model_steps=2 ipc=2
server_epochs=5``), ``--clients`` clients, ``--rounds`` rounds, seeded noise, three ways, each
a fresh ``train`` process, one after the other on the same machine:

* ``in-process, 1 thread``: the clients one after the other, one torch thread (the
  reference of the bit-for-bit check);
* ``in-process``: the same with torch's threads (``--threads`` left to the CPU policy);
* ``flower-simulation``: ``--engine flower-simulation --client-cpus 1``: a pool of
  (CPUs / 1) Ray actors, each training one client at a time with one torch thread, side by
  side.

Prints each run's wall time, its rounds' recorded seconds, the CPU seconds and peak memory
of its process tree (:class:`flower_simulation.TreeUsage`), the CPU seconds of each Ray
worker that spent more than one (two ``ray::ClientAppActor`` with about the same CPU time:
both trained clients, side by side),
and whether the Simulation Engine's checkpoint equals the 1-thread run's bit for bit.

    python benchmarks/speed/flower_simulation_fedlap.py [--clients 4] [--rounds 2]
        [--set KEY=VALUE ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flower_simulation import TreeUsage, machine_load, same_run

SMALL = dict(width=16, reinits=1, max_loops=2, real_batches=2, syn_steps=2,
             local_model_steps=2, ipc=2, server_epochs=5)


def _train(args: argparse.Namespace, out: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "fedlap_privacy", "train", "--method", "fedlap-dp",
            "--clients", str(args.clients), "--rounds", str(args.rounds), "--device", "cpu",
            "--reproducible-noise", "--json", "--out", str(out),
            *[f"--set={k}={v}" for k, v in {**SMALL, **dict(
                item.split("=", 1) for item in args.set)}.items()], *extra]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting of the small configuration (e.g. "
                        "max_loops=4): longer client rounds")
    parser.add_argument("--out", default=None, help="keep the run folders here")
    args = parser.parse_args()
    print(f"load before: {machine_load()}  (CPUs: {os.cpu_count()})")
    with tempfile.TemporaryDirectory(prefix="flower-sim-fedlap-") as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        policy = root / "policy.toml"
        policy.write_text('allowed-methods = ["fedlap-dp"]\nallow-reproducible-noise = true\n')
        runs = {"in-process, 1 thread": ("loop", ["--threads", "1"]),
                "in-process": ("threads", []),
                "flower-simulation": ("sim", ["--engine", "flower-simulation", "--client-cpus",
                                              "1", "--node-policy", str(policy)])}
        for name, (folder, extra) in runs.items():
            env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if folder == "sim" else {})}
            start = time.perf_counter()
            proc = subprocess.Popen(_train(args, root / folder, extra), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env,
                                    start_new_session=True)
            usage = TreeUsage(proc.pid).start()
            _stdout, stderr = proc.communicate()
            wall, cpu = time.perf_counter() - start, usage.stop()
            if proc.returncode != 0:
                print(f"{name}: failed\n{stderr[-3000:]}")
                sys.exit(1)
            rounds = [json.loads(line)["seconds"]
                      for line in (root / folder / "metrics.jsonl").read_text().splitlines()]
            actors = [f"{usage.names[pid][:40]} {c:.1f}" for pid, c in usage.cpu.items()
                      if c > 1 and usage.names.get(pid, "").startswith("ray::")]
            print(f"{name:>22}: {wall:7.1f} s wall, rounds "
                  + ", ".join(f"{s:.1f}" for s in rounds) + f" s, {cpu:7.1f} CPU s, peak "
                  f"{usage.peak_mib:6.0f} MiB"
                  + (f"; Ray workers' CPU s: {', '.join(actors)}" if actors else ""),
                  flush=True)
        print(f"bit for bit: {same_run(root / 'loop', root / 'sim')}")
    print(f"load after: {machine_load()}")


if __name__ == "__main__":
    main()
