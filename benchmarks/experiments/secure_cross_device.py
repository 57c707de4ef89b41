"""Client-level DP-FedAvg with and without trusting the server, at cross-device scale.

FashionMNIST in 3,000 shard clients, a fixed cohort of 100 a round, the cross-device defaults
(the small CNN of width 32 and depth 2, B 10, 10 local steps at learning rate 0.1), fixed clip
C 1, the same noise multiplier and seed: central noise added by a trusted server, then
``--secure-aggregation skellam`` and ``discrete-gaussian`` (each client adds its share of the
noise; the server decodes only the sum). Every run is an ordinary ``fedlap-privacy train``
in a subprocess. Prints, per run, the test accuracy after the last round and its best, the
wall time, the epsilon against the server and against outsiders, and the continuous
Gaussian's epsilon at the same noise multiplier and sensitivity over the same participations
(every round, no amplification: what the distributed epsilon must stay near and never go
below).

    python benchmarks/experiments/secure_cross_device.py --data-dir data/fashion-mnist --rounds 30

``--engine flower-simulation --clients 1000`` runs the same over Flower's Simulation Engine
(each virtual node masks its own upload; the server unmasks the sum: fl/flower/secure_node.py)
beside the same secure run in process (``--runs skellam``: that one alone).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RUNS = {"central": (), "skellam": ("--secure-aggregation", "skellam"),
        "discrete-gaussian": ("--secure-aggregation", "discrete-gaussian")}
DELTA = 1e-5


def command(args: argparse.Namespace, extra: tuple[str, ...], out: Path) -> list[str]:
    return [sys.executable, "-m", "fedlap_privacy.cli.main", "train", "--method",
            "dp-fedavg-client", "--set", "clip=1", "--dataset", "fashion-mnist", "--data-dir",
            str(args.data_dir), "--clients", str(args.clients), "--split", "shards",
            "--clients-per-round",
            "100", "--rounds", str(args.rounds), "--batch-size", "10", "--local-steps", "10",
            "--set", "lr_local=0.1", "--set", "width=32", "--set", "depth=2", "--seed",
            str(args.seed), "--sigma", str(args.sigma), "--delta", str(DELTA), "--out", str(out),
            *extra]


#: what a Flower node admits here: client-level DP-FedAvg (its noise share its own)
NODE_POLICY = 'allowed-methods = ["dp-fedavg-client"]\nmin-batch-size = 1\n'


def gaussian_epsilon(sigma: float, releases: int) -> float:
    """The continuous Gaussian mechanism (sensitivity C, noise sigma C) over ``releases``
    releases, by the same RDP conversion as the distributed accountant."""
    from fedlap_privacy.accountant.rdp import DEFAULT_ORDERS, _as_orders, rdp_to_epsilon

    orders = _as_orders(DEFAULT_ORDERS)
    return rdp_to_epsilon(releases * orders / (2.0 * sigma**2), orders, DELTA)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/secure-cross-device"))
    parser.add_argument("--clients", type=int, default=3000)
    parser.add_argument("--engine", default="simulation",
                        choices=["simulation", "flower-simulation"])
    parser.add_argument("--runs", default=",".join(RUNS), help="which of: " + ", ".join(RUNS))
    args = parser.parse_args()
    gaussian = gaussian_epsilon(args.sigma, args.rounds)
    print(f"continuous Gaussian, sigma {args.sigma:g}, {args.rounds} releases: epsilon "
          f"{gaussian:.3f} at delta {DELTA:g}")
    print("| run | accuracy, last (best) | wall | epsilon vs server (/ Gaussian) | outsiders |")
    print("|---|---|---|---|---|")
    engines = ["simulation"] + ([args.engine] if args.engine != "simulation" else [])
    for name in args.runs.split(","):
        for engine in engines:
            out = args.out / f"{name}-{engine}"
            extra = (*RUNS[name], "--engine", engine)
            if engine != "simulation":
                args.out.mkdir(parents=True, exist_ok=True)
                (policy := args.out / "node-policy.toml").write_text(NODE_POLICY)
                extra = (*extra, "--node-policy", str(policy))
            _run(args, f"{name} ({engine})", extra, out, gaussian)


def _run(args: argparse.Namespace, name: str, extra: tuple[str, ...], out: Path,
         gaussian: float) -> None:
    """One ``train`` in a subprocess, and its row of the table."""
    from fedlap_privacy.state.checkpoint import committed_file, load_checkpoint

    start = time.perf_counter()
    subprocess.run(command(args, extra, out), check=True, capture_output=True)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    accuracy = [100 * r["test_accuracy"] for r in rows]
    privacy = load_checkpoint(committed_file(out, "ckpt.pt"))["privacy"]
    by_threat = privacy.get("epsilon_by_threat_model") or {}
    server = by_threat.get("server")
    outsiders = by_threat.get("trusted-server", privacy["epsilon"])
    against = "-" if server is None else f"{server:.2f} ({server / gaussian:.3f}x)"
    print(f"| {name} | {accuracy[-1]:.1f} ({max(accuracy):.1f}) | {wall:.0f} s | "
          f"{against} | {outsiders:.2f} |", flush=True)


if __name__ == "__main__":
    main()
