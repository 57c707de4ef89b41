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

Prints each run's wall time (start-up, Ray's and the discovery of every virtual node
included), its rounds' seconds as recorded, the ratios, and whether the Simulation Engine's
checkpoint (weights, ledger, metrics) equals the loop's bit for bit (``bit for bit: True``).
Prints the machine's load before and after: on a shared machine compare within one run.

    python benchmarks/flower_simulation.py [--data-dir DIR] [--clients 1000] [--rounds 2]
        [--cohort 100] [--out DIR]
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

RUNS = ("packed", "loop", "flower-simulation")


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
    from fedlap_privacy.fl.engine.simulation import train
    from fedlap_privacy.fl.flower.simulation_engine import run_simulation_engine

    cfg = _config(spec)
    start = time.perf_counter()
    if spec["run"] == "flower-simulation":
        policy = Path(spec["out"]).with_suffix(".policy.toml")
        policy.write_text('threat-model = "trusted-server"\nallowed-methods = ["fedavg"]\n'
                          "allow-reproducible-noise = true\nmin-batch-size = 1\n")
        history = run_simulation_engine(cfg, spec["out"], "cpu", node_policy=policy).history
    else:
        history = train(cfg, spec["out"], "cpu").history
    return {"wall": time.perf_counter() - start, "rounds": [h.seconds for h in history],
            "clients": [h.clients for h in history], "accuracy": history[-1].test_accuracy}


def same_run(a: Path, b: Path) -> bool:
    """The two run folders hold the same weights, ledger and metrics (timings aside)."""
    import torch

    from fedlap_privacy.checkpoint import load_checkpoint

    x, y = load_checkpoint(a / "ckpt.pt"), load_checkpoint(b / "ckpt.pt")
    strip = [[{k: v for k, v in h.items() if k != "seconds"} for h in c["history"]]
             for c in (x, y)]
    return (x["ledger"] == y["ledger"] and strip[0] == strip[1]
            and x["model_state"].keys() == y["model_state"].keys()
            and all(torch.equal(x["model_state"][k], y["model_state"][k])
                    for k in x["model_state"]))


def _load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="/work/shared/data/fashion-mnist")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cohort", type=int, default=100)
    parser.add_argument("--out", default=None, help="keep the run folders here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    print(f"load before: {_load()}  (CPUs: {os.cpu_count()})")
    with tempfile.TemporaryDirectory(prefix="flower-sim-bench-") as tmp:
        root = Path(args.out or tmp)
        rows = {}
        for run in RUNS:
            spec = {"data_dir": args.data_dir, "clients": args.clients, "rounds": args.rounds,
                    "cohort": args.cohort, "run": run, "out": str(root / run)}
            env = dict(os.environ)
            if run != "packed":  # one thread: the actors' count (bit for bit)
                env["OMP_NUM_THREADS"] = "1"
            done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                  capture_output=True, text=True, env=env)
            if done.returncode != 0:
                print(f"{run}: failed\n{done.stderr[-3000:]}")
                sys.exit(1)
            rows[run] = row = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{run:>18}: {row['wall']:7.1f} s wall, rounds "
                  + ", ".join(f"{s:.2f}" for s in row["rounds"])
                  + f" s ({', '.join(map(str, row['clients']))} clients), test accuracy "
                  f"{row['accuracy']:.4f}", flush=True)
        for run in ("loop", "flower-simulation"):
            ratio = sum(rows[run]["rounds"]) / sum(rows["packed"]["rounds"])
            print(f"{run:>18}: rounds {ratio:6.2f}x the packed cohort's, wall "
                  f"{rows[run]['wall'] / rows['packed']['wall']:6.2f}x")
        print(f"bit for bit: {same_run(root / 'loop', root / 'flower-simulation')}")
    print(f"load after: {_load()}")


if __name__ == "__main__":
    main()
