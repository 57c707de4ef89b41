"""One-knob-at-a-time ablation of FedLAP-DP at a matched epsilon: what limits it on small
clients (issue: FedLAP-DP trails DP-FedAvg on digits, ~280 records per client).

Every variant is ``fedlap-privacy compare --methods fedlap-dp`` with ONE ``--set KEY=VALUE``
changed from the defaults, at the same target epsilon and round counts, so that sigma is
re-planned for each variant's accesses per round (a variant with more accesses pays with
more noise). DP-FedAvg at the same budget is the reference row. Prints one row per variant:
final test accuracy, mean ± standard deviation over the seeds, and the sigma planned.

This is an analysis on the TEST split of digits, not a tuning procedure: nothing here picks
the package's defaults. (Tuning would need a validation split carved from training data of
a public proxy, and its own privacy statement.)

    python benchmarks/experiments/fedlap_ablation.py [--eps 3] [--rounds 3] [--seeds 3]
        [--out runs/ablation] [--dataset digits] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

#: (label, settings) — one knob moved at a time from train's defaults
VARIANTS: list[tuple[str, list[str]]] = [
    ("default (T = 1 x 5 x 2 = 10, B 64)", []),
    ("T = 5 (real_batches 1)", ["real_batches=1"]),
    ("T = 20 (real_batches 4)", ["real_batches=4"]),
    ("B 32", ["batch_size=32"]),
    ("B 128", ["batch_size=128"]),
    ("ipc 5", ["ipc=5"]),
    ("ipc 20", ["ipc=20"]),
    ("lr_img 30", ["lr_img=30"]),
    ("lr_img 300", ["lr_img=300"]),
    ("syn_steps 10", ["syn_steps=10"]),
    ("radius 0.75", ["radius=0.75"]),
    ("radius 3", ["radius=3"]),
    ("server epochs 300", ["server_epochs=300"]),
    ("lr_net 0.1", ["lr_net=0.1"]),
    ("no DSA", ["dsa=false"]),
    ("MSE term 0.1", ["mse_weight=0.1"]),
]


def run(label: str, method: str, settings: list[str], args: argparse.Namespace,
        out: Path) -> dict[str, object]:
    cmd = [sys.executable, "-m", "fedlap_privacy", "compare", "--dataset", args.dataset,
           "--eps", str(args.eps), "--rounds", args.rounds, "--seeds", str(args.seeds),
           "--methods", method, "--out", str(out), "--json"]
    for item in [*args.set, *settings]:
        cmd += ["--set", item]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    report = json.loads((out / "comparison.json").read_text())
    return {"label": label, "report": report}


def rows(result: dict[str, object]) -> list[str]:
    report = result["report"]
    assert isinstance(report, dict)
    lines = []
    for row in report["methods"].values():
        for cell in row["results"].values():
            for by in cell["by_rounds"]:
                lines.append(f"| {result['label']} | {by['rounds']} | {100 * by['mean']:.1f} ± "
                             f"{100 * by['std']:.1f} | {by['sigma_mean']:.2f} | "
                             f"{by['epsilon_mean']:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--eps", type=float, default=3.0)
    parser.add_argument("--rounds", default="3", help="round count(s), e.g. 1,3")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/ablation"))
    parser.add_argument("--set", action="append", default=[], help="applied to every run")
    parser.add_argument("--only", default=None, help="comma-separated variant numbers")
    args = parser.parse_args()
    chosen = (range(len(VARIANTS)) if args.only is None
              else [int(i) for i in args.only.split(",")])
    print("| variant | rounds | test accuracy % | sigma | epsilon |")
    print("|---|---|---|---|---|")
    reference = run("DP-FedAvg (reference)", "dp-fedavg", [], args, args.out / "dp-fedavg")
    print("\n".join(rows(reference)), flush=True)
    for i in chosen:
        label, settings = VARIANTS[i]
        result = run(label, "fedlap-dp", settings, args, args.out / f"fedlap-dp-{i}")
        print("\n".join(rows(result)), flush=True)


if __name__ == "__main__":
    main()
