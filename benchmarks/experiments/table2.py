"""Reproduce the shape of the paper's Table 2: DP methods side by side at matched privacy.

Each method trains with the same split, model, Poisson sampling, sigma and accesses per round,
so the accountant gives all of them the same epsilon. Two ways to fix the budget:

* ``--rounds M`` with the preset's sigma (the paper: sigma 1, T 200, 1 round -> eps 2.79
  on its accounting, 15 rounds -> 10.18);
* ``--eps 3,10 --rounds M``: sigma planned per target so that M rounds spend exactly it.

Examples (``--data-dir`` holds the standard IDX files):
    python benchmarks/experiments/table2.py --dataset fashion-mnist --data-dir data/fashion-mnist \
        --preset paper-dp --rounds 1 --out runs/table2-fashion
    python benchmarks/experiments/table2.py --dataset digits --eps 3,10 --out runs/table2-digits

Writes ``table2.json`` and prints a markdown table beside the paper's numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from fedlap_privacy.fl.config import PRESETS, TrainConfig
from fedlap_privacy.fl.config_resolve import parse_overrides
from fedlap_privacy.fl.engine.events import ClientDone, RoundEnded, RunEvent
from fedlap_privacy.fl.engine.simulation import train

#: Table 2 of the paper, sigma = 1: {dataset: {eps: {method: accuracy}}}
PAPER = {
    "mnist": {2.79: (45.25, 54.58, 60.72), 10.18: (86.99, 88.75, 87.77)},
    "fashion-mnist": {2.79: (50.11, 54.57, 59.85), 10.18: (72.78, 71.67, 73.00)},
    "cifar10": {2.79: (17.11, 19.40, 21.42), 10.18: (31.15, 35.04, 36.09)},
}
PAPER_METHODS = ("dp-fedavg", "dp-fedprox", "fedlap-dp")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dataset", default="digits")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--methods", default="fedlap-dp,dp-fedavg,dp-fedprox")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS))
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--eps", default=None, help="comma-separated targets: plan sigma for each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="runs/table2")
    p.add_argument("--set", nargs="*", default=[], help="extra overrides key=value")
    args = p.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base: dict[str, Any] = dict(PRESETS[args.preset]) if args.preset else {}
    base.update(dataset=args.dataset, data_dir=args.data_dir, seed=args.seed)
    if args.rounds is not None:
        base["rounds"] = args.rounds
    base.update(parse_overrides(args.set))
    targets = [float(e) for e in args.eps.split(",")] if args.eps else [None]

    results: list[dict[str, Any]] = []
    for target in targets:
        for method in args.methods.split(","):
            values = {**base, "method": method}
            if target is not None:
                values.update(sigma=None, target_eps=target)
            cfg = TrainConfig.from_dict(values)
            t0 = time.perf_counter()
            res = train(cfg, out / f"{method}-eps{target}", device=args.device, callback=_log)
            row = {**res.summary.to_json(), "target_eps": target,
                   "seconds": time.perf_counter() - t0,
                   "accesses_per_round": cfg.accesses_per_round, "batch_size": cfg.batch_size}
            results.append(row)
            print(json.dumps(row), flush=True)
            (out / "table2.json").write_text(json.dumps(results, indent=2))
    print(markdown(results, args.dataset))


def _log(event: RunEvent) -> None:
    """Progress on stderr: long runs (an hour on CPU) show where they are."""
    if isinstance(event, ClientDone):
        print(time.strftime("%H:%M:%S"), f"round {event.round} client {event.client} done",
              file=sys.stderr, flush=True)
    elif isinstance(event, RoundEnded):
        print(time.strftime("%H:%M:%S"), f"round {event.round} test accuracy "
              f"{event.record.test_accuracy:.4f}", file=sys.stderr, flush=True)


def markdown(results: list[dict[str, Any]], dataset: str) -> str:
    lines = ["| method | epsilon | sigma | rounds | test accuracy % | paper % | minutes |",
             "|---|---|---|---|---|---|---|"]
    paper = PAPER.get(dataset, {})
    for r in results:
        ref = "-"
        if paper and r["method"] in PAPER_METHODS and r["epsilon"] is not None:
            nearest = min(paper, key=lambda e: abs(e - r["epsilon"]))
            if abs(nearest - r["epsilon"]) < 1.0:
                ref = f"{paper[nearest][PAPER_METHODS.index(r['method'])]:.2f} (eps {nearest})"
        lines.append(
            f"| {r['method']} | {r['epsilon']:.2f} | {r['sigma']:.3g} | {r['rounds_run']} | "
            f"{100 * r['test_accuracy']:.2f} | {ref} | {r['seconds'] / 60:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
