"""Cross-device scale: seconds per round and peak memory of a FedAvg cohort trained one by
one (``cohort_training=loop``), vectorised with ``vmap`` (``vectorised``, fl/engine/cohort.py) and
packed into one network (``packed``, fl/engine/packed_cohort.py), in the same run.

Each configuration (clients x cohort x mode) runs in a fresh subprocess: it loads
FashionMNIST, splits it into ``clients`` clients with McMahan et al.'s shards (60,000 /
clients records each: 60 for 1,000 clients, 6 for 10,000), builds the in-process run of
``fedlap_privacy.fl.engine.simulation`` (no files written) and times ``--rounds`` rounds of the
cohort's client steps and the server's aggregation for a cohort of ``cohort`` clients
drawn at random (evaluation on the test set excluded: it does not grow with the clients).
Peak memory is the subprocess's maximum resident set size (``resource.getrusage``), the
dataset included. Prints one row per configuration (wall and CPU seconds per round: on a
shared machine the CPU time is the steadier of the two) and the loop / vectorised and
loop / packed ratios (above 1: faster than the loop).

The model is the small CNN: the ConvNet of docs/algorithms.md#convnet at width 32, depth 2
(the 8x8 default's size) on 28x28 inputs. Local training: ``--local-steps`` SGD steps on
Poisson batches at rate ``--batch-size`` / N_k.

    python benchmarks/speed/cross_device.py [--data-dir /path/to/fashion-mnist] [--rounds 2]
        [--clients 1000,10000] [--cohorts 100,1000] [--local-steps 5] [--batch-size 5]
        [--modes loop,vectorised,packed]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

MODES = ("loop", "vectorised", "packed")


def worker(spec: dict) -> dict:
    """One configuration, in this (fresh) process."""
    import numpy as np
    import torch

    from fedlap_privacy.fl.config import TrainConfig
    from fedlap_privacy.fl.engine.training_run import TrainingRun, local_clients

    cfg = TrainConfig(
        method="fedavg", dataset="fashion-mnist", data_dir=spec["data_dir"], split="shards",
        clients=spec["clients"], rounds=spec["rounds"], batch_size=spec["batch_size"],
        local_steps=spec["local_steps"], lr_local=0.05, width=32, depth=2, split_seed=0,
        cohort_training=spec["mode"],
    ).validate()
    run = TrainingRun(cfg, torch.device("cpu"), None)
    rng = np.random.default_rng(0)
    seconds, cpu = [], []
    for m in range(1, spec["rounds"] + 1):
        chosen = sorted(rng.choice(cfg.clients, spec["cohort"], replace=False).tolist())
        info = run.method.round_info(m, run.server_state)
        start, start_cpu = time.perf_counter(), time.process_time()
        replies = local_clients(run, m, chosen, info, lambda event: None)
        run.method.aggregate(run.model, replies, run.server_state, info,
                             torch.Generator().manual_seed(m))
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return {**spec, "seconds": seconds, "cpu_seconds": cpu, "peak_mib": peak_mib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="/work/shared/data/fashion-mnist")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", default="1000,10000")
    parser.add_argument("--cohorts", default="100,1000")
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=5)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    modes = args.modes.split(",")
    if "loop" not in modes or not set(modes) <= set(MODES):
        parser.error(f"--modes: loop and any of {', '.join(MODES[1:])}")
    rows = []
    print(f"{'clients':>8} {'cohort':>7} {'mode':>11} {'s/round':>9} {'CPU s':>7} "
          f"{'peak MiB':>9}")
    for clients in (int(c) for c in args.clients.split(",")):
        for cohort in (int(c) for c in args.cohorts.split(",")):
            for mode in modes:  # interleaved: the modes see the same machine load
                spec = dict(data_dir=args.data_dir, clients=clients, cohort=cohort, mode=mode,
                            rounds=args.rounds, local_steps=args.local_steps,
                            batch_size=args.batch_size)
                done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                      capture_output=True, text=True, check=True)
                row = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"{clients:>8} {cohort:>7} {mode:>11} "
                      f"{statistics.median(row['seconds']):>9.2f} "
                      f"{statistics.median(row['cpu_seconds']):>7.2f} {row['peak_mib']:>9.0f}",
                      flush=True)
    print("\nloop / mode (seconds per round, CPU seconds per round; peak memory): above 1, "
          "the mode is faster than the loop")
    for clients in sorted({r["clients"] for r in rows}):
        for cohort in sorted({r["cohort"] for r in rows}):
            pair = {r["mode"]: r for r in rows if r["clients"] == clients and
                    r["cohort"] == cohort}
            loop = pair["loop"]
            for mode in (m for m in modes if m != "loop"):
                row = pair[mode]
                ratio = statistics.median(loop["seconds"]) / statistics.median(row["seconds"])
                cpu = (statistics.median(loop["cpu_seconds"])
                       / statistics.median(row["cpu_seconds"]))
                print(f"{clients:>8} clients, cohort {cohort:>5}, {mode:>10}: time "
                      f"x{ratio:.2f}, CPU x{cpu:.2f}, "
                      f"memory x{loop['peak_mib'] / row['peak_mib']:.2f}")


if __name__ == "__main__":
    main()
