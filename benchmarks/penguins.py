"""Palmer penguins, split by island into 3 clients: FedAvg vs DP-FedAvg vs FedLAP-DP at a target
epsilon (docs/own-data.md, measured result).

Needs the ``palmerpenguins`` package (its CSV only; not a dependency of fedlap-privacy):
``pip install palmerpenguins``. Writes one .npz per island (Biscoe, Dream, Torgersen; no
test.npz, so each client holds out a fifth of its records for evaluation) and trains each
method for each seed through the Python API, printing a Markdown table.

Features: bill length, bill depth, flipper length, body mass, scaled by fixed round constants
(not statistics of the records, which would themselves leak). Label: the species. Rows with
a missing measurement are dropped (342 penguins remain).

    .venv/bin/python benchmarks/penguins.py --out runs/penguins
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import numpy as np

SPECIES = ("Adelie", "Chinstrap", "Gentoo")
ISLANDS = ("Biscoe", "Dream", "Torgersen")
COLUMNS = ("bill_length_mm", "bill_depth_mm", "flipper_length_mm", "body_mass_g")
#: fixed (centre, scale) per column: round numbers, not computed from the records
SCALE = ((45.0, 5.0), (17.0, 2.0), (200.0, 15.0), (4200.0, 800.0))


def write_clients(folder: Path) -> list[int]:
    """One .npz per island in ``folder``; returns the clients' sizes."""
    import palmerpenguins

    csv_path = Path(palmerpenguins.__file__).parent / "data" / "penguins.csv"
    rows = [r for r in csv.DictReader(csv_path.open()) if all(r[c] != "NA" for c in COLUMNS)]
    folder.mkdir(parents=True, exist_ok=True)
    sizes = []
    for k, island in enumerate(ISLANDS):
        mine = [r for r in rows if r["island"] == island]
        x = np.array([[(float(r[c]) - m) / s for c, (m, s) in zip(COLUMNS, SCALE, strict=True)]
                      for r in mine], dtype=np.float32)
        y = np.array([SPECIES.index(r["species"]) for r in mine], dtype=np.int64)
        np.savez(folder / f"{k}_{island.lower()}.npz", x=x, y=y, num_classes=len(SPECIES))
        sizes.append(len(y))
    return sizes


RUNS = {
    "FedAvg (non-private)": dict(method="fedavg"),
    "DP-FedAvg, epsilon 3": dict(method="dp-fedavg", target_eps=3.0, sigma=None),
    "FedLAP-DP, epsilon 3": dict(method="fedlap-dp", target_eps=3.0, sigma=None, lr_img=1.0),
}
COMMON = dict(rounds=10, batch_size=16, local_steps=2, lr_local=1.0, clip=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/penguins"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    from fedlap_privacy.fl.config import TrainConfig
    from fedlap_privacy.fl.simulation import train

    sizes = write_clients(args.out / "data")
    print(f"clients (records per island, before the held-out fifth): {sizes}")
    print("| run | test accuracy (mean ± sd) | per seed | epsilon |")
    print("|---|---|---|---|")
    for name, values in RUNS.items():
        accs, eps = [], None
        for seed in args.seeds:
            cfg = TrainConfig(**{**COMMON, **values, "seed": seed})  # type: ignore[arg-type]
            result = train(cfg, None, "cpu", data=args.out / "data")
            accs.append(result.summary["test_accuracy"])
            eps = result.summary["epsilon"]
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        print(f"| {name} | {statistics.mean(accs):.1%} ± {spread:.1%} | "
              f"{', '.join(f'{a:.1%}' for a in accs)} | {'-' if eps is None else f'{eps:.2f}'} |")


if __name__ == "__main__":
    main()
