"""Tune FedLAP-DP, DP-FedAvg and DP-FedProx with the same budget on a validation split of a
public proxy, at a matched epsilon; print what each picks.

Every method gets the same number of candidate settings (``GRIDS``: six each). Each candidate
is ``fedlap-privacy compare --methods M`` at the target epsilon and round count with
``--set validation_records=N``: N training records of the proxy are held out of every
client, and the candidate is scored by its mean accuracy on them over the seeds (compare
reads it from each run's private state: the validation records are training records, kept
out of ``ckpt.pt``). Every candidate holds out the same records and splits the rest the
same way: ``--set split_seed`` (``--split-seed``, declared public in the runs' guarantee:
the proxy is public). The test split is printed beside it but never used to choose. The
pick per method is the candidate with the best validation mean; its ``--set`` flags are
printed last, to be applied unchanged to other data (``--set`` of ``compare``/``train``).

Privacy status of the tuning: it runs on the proxy only (scikit-learn's bundled digits by
default), a public dataset, so it spends nothing of any client's budget; the settings it
picks are data-independent for the private data they are applied to.

    python benchmarks/experiments/tune.py [--dataset digits] [--eps 3] [--rounds 3] [--seeds 3]
        [--validation 300] [--split-seed 0] [--out runs/tune]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: the candidates of each method, the same number for each (an equal tuning budget)
GRIDS: dict[str, list[list[str]]] = {
    "fedlap-dp": [
        [],  # train's defaults: T = 1 x 5 x 2 = 10, radius 1.5
        ["real_batches=1"],
        ["radius=3"],
        ["real_batches=1", "radius=3"],
        ["real_batches=1", "dsa=false"],
        ["real_batches=1", "max_loops=3", "radius=3"],
    ],
    "dp-fedavg": [
        [],  # train's defaults: 10 local steps at lr 0.5
        ["local_steps=5"],
        ["local_steps=20"],
        ["lr_local=1.0"],
        ["local_steps=5", "lr_local=1.0"],
        ["local_steps=20", "lr_local=0.25"],
    ],
    "dp-fedprox": [
        [],
        ["local_steps=5"],
        ["local_steps=20"],
        ["lr_local=1.0"],
        ["prox_mu=0.1"],
        ["local_steps=5", "lr_local=1.0"],
    ],
}


@dataclass(frozen=True)
class Score:
    method: str
    settings: tuple[str, ...]
    validation: float
    validation_std: float
    test: float
    test_std: float
    sigma: float


def evaluate(method: str, settings: list[str], args: argparse.Namespace, out: Path) -> Score:
    """One candidate: its compare run, scored on the validation split."""
    cmd = [sys.executable, "-m", "fedlap_privacy", "compare", "--dataset", args.dataset,
           "--eps", str(args.eps), "--rounds", str(args.rounds), "--seeds", str(args.seeds),
           "--methods", method, "--out", str(out), "--json",
           "--set", f"validation_records={args.validation}",
           "--set", f"split_seed={args.split_seed}"]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    for item in settings:
        cmd += ["--set", item]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    report = json.loads((out / "comparison.json").read_text())
    (cell,) = report["methods"][method]["results"].values()
    runs = cell["runs"]
    val = [r["validation_accuracy"] for r in runs]
    test = [r["test_accuracy"] for r in runs]

    def mean_sd(xs: list[float]) -> tuple[float, float]:
        m = sum(xs) / len(xs)
        return 100 * m, 100 * (sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5

    (v, vs), (t, ts) = mean_sd(val), mean_sd(test)
    return Score(method, tuple(settings), v, vs, t, ts, runs[0]["sigma"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--eps", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--validation", type=int, default=300,
                        help="training records held out as the validation split")
    parser.add_argument("--split-seed", type=int, default=0,
                        help="the split seed every candidate shares (the same hold-out)")
    parser.add_argument("--out", type=Path, default=Path("runs/tune"))
    parser.add_argument("--methods", default=",".join(GRIDS))
    args = parser.parse_args()
    print(f"{args.dataset}, eps {args.eps:g}, {args.rounds} rounds, {args.seeds} seeds, "
          f"{args.validation} validation records; mean ± population sd, %")
    print("| method | settings | validation | test (not used to choose) | sigma |")
    print("|---|---|---|---|---|")
    picks: list[Score] = []
    for method in args.methods.split(","):
        scores = []
        for i, settings in enumerate(GRIDS[method]):
            s = evaluate(method, settings, args, args.out / f"{method}-{i}")
            scores.append(s)
            print(f"| {method} | {' '.join(settings) or 'defaults'} | {s.validation:.1f} ± "
                  f"{s.validation_std:.1f} | {s.test:.1f} ± {s.test_std:.1f} | {s.sigma:.2f} |",
                  flush=True)
        picks.append(max(scores, key=lambda s: s.validation))
    print("\npicked by validation accuracy:")
    for s in picks:
        flags = " ".join(f"--set {item}" for item in s.settings) or "(defaults)"
        print(f"  {s.method}: {flags}  (validation {s.validation:.1f}, test {s.test:.1f})")


if __name__ == "__main__":
    main()
