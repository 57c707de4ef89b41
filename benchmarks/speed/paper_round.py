"""Time the whole FashionMNIST ``paper-dp`` round at 1,600 records per client, the README's
figure: five clients side by side on Flower's Simulation Engine (``--client-cpus 0.4``),
through the CLI as a user runs it, and print the round's seconds (``metrics.jsonl``), the
seconds from the command to its end (Ray's start and node discovery included) and the test
accuracy. With ``--reference`` it runs the same round again with every fast path off
(``FEDLAP_FAST_PATHS=off``: autograd's double backward, Opacus-style per-record
gradients, torch's convolutions) and prints the ratio (the 1/20 client round of
``benchmarks/speed/fedlap_round.py`` puts it at about four times longer). The machine's speed
moves by up to 20% within a day: compare in one run.

    python benchmarks/speed/paper_round.py --data-dir data/fashion-mnist [--reference]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMAND = ["train", "--preset", "paper-dp", "--dataset", "fashion-mnist", "--target-eps", "3",
           "--rounds", "1", "--seed", "0", "--set", "client_records=1600",
           "--engine", "flower-simulation", "--client-cpus", "0.4"]


def _round(data_dir: Path, paths: str) -> tuple[float, float, float]:
    """(round seconds, command seconds, test accuracy) of one round with ``paths``."""
    cli = shutil.which("fedlap-privacy") or str(Path(sys.executable).with_name("fedlap-privacy"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        start = time.perf_counter()
        done = subprocess.run([cli, *COMMAND, "--data-dir", str(data_dir), "--out", str(out)],
                              stdout=subprocess.DEVNULL,
                              env={**os.environ, "FEDLAP_FAST_PATHS": paths})
        if done.returncode != 0:
            raise SystemExit(f"the round failed (exit {done.returncode}; its error is above)")
        wall = time.perf_counter() - start
        row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    return float(row["seconds"]), wall, float(row["test_accuracy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--reference", action="store_true",
                        help="also the round with every fast path off, and the ratio")
    args = parser.parse_args()
    print(f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    runs = [("fast paths on", "on")] + ([("reference (off)", "off")] if args.reference else [])
    seconds = {}
    for label, paths in runs:
        round_s, wall, acc = _round(args.data_dir, paths)
        seconds[label] = round_s
        print(f"{label:<18} round {round_s:8.1f} s  command {wall:8.1f} s  "
              f"test accuracy {acc:.2%}", flush=True)
    if args.reference:
        print(f"reference / fast: {seconds['reference (off)'] / seconds['fast paths on']:.2f}x")


if __name__ == "__main__":
    main()
