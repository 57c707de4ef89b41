"""Palmer penguins, split by island into 3 clients: FedAvg vs DP-FedAvg vs FedLAP-DP at a target
epsilon (docs/own-data.md, measured result).

Needs the ``palmerpenguins`` package (its CSV only; not a dependency of fedlap-privacy):
``pip install palmerpenguins``. Writes one .npz per island (Biscoe, Dream, Torgersen; no
test.npz, so each client holds out a fifth of its records for evaluation) and trains each
method for each seed through the Python API, printing a Markdown table.

Features: bill length, bill depth, flipper length, body mass, scaled by fixed round constants
(not statistics of the records, which would themselves leak). Label: the species. Rows with
a missing measurement are dropped (342 penguins remain).

Model: a multinomial logistic regression (:func:`logistic_regression`, 15 weights, passed as
``--model benchmarks/experiments/penguins.py:logistic_regression`` would be), the same for every method.
With about 270 training records, epsilon 3 buys little signal per weight: the default
tabular MLP (about 4,700 weights) drowns in the DP noise (DP-FedAvg 84% over three seeds,
one at 62%), the 15 weights do not.

How the settings were chosen (``--tune``): six DP-FedAvg candidates (:data:`CANDIDATES`), each
scored by its mean accuracy over seeds 100-102 on a validation split of 40 TRAINING records
held out of the clients (``validation_records``), never on the test records; the best is
:data:`PICKED`. The other methods run with the same settings, untuned. The reported seeds
(0-4 by default) are not the tuning seeds.

    .venv/bin/python benchmarks/experiments/penguins.py --out runs/penguins [--seeds 0 1 2 3 4] [--tune]
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import numpy as np
from torch import nn

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


def logistic_regression(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The benchmark's model factory: one linear layer from the features to the logits."""
    return nn.Linear(int(input_shape[0]), num_classes)


MODEL = f"{Path(__file__).resolve()}:logistic_regression"
RUNS = {
    "FedAvg (non-private)": dict(method="fedavg"),
    "DP-FedAvg, epsilon 3": dict(method="dp-fedavg", target_eps=3.0, sigma=None),
    "FedLAP-DP, epsilon 3": dict(method="fedlap-dp", target_eps=3.0, sigma=None, lr_img=1.0),
}
#: DP-FedAvg's tuning candidates (``--tune``): the first is the earlier setting with the
#: default tabular MLP
CANDIDATES = {
    "MLP, B 16, 10 x 2 steps, lr 1": dict(rounds=10, batch_size=16, local_steps=2, lr_local=1.0),
    "MLP, B 32, 10 x 1 steps, lr 1": dict(rounds=10, batch_size=32, local_steps=1, lr_local=1.0),
    "linear, B 16, 10 x 2 steps, lr 1": dict(model=MODEL, rounds=10, batch_size=16,
                                             local_steps=2, lr_local=1.0),
    "linear, B 32, 10 x 1 steps, lr 2": dict(model=MODEL, rounds=10, batch_size=32,
                                             local_steps=1, lr_local=2.0),
    "linear, B 32, 5 x 2 steps, lr 1": dict(model=MODEL, rounds=5, batch_size=32,
                                            local_steps=2, lr_local=1.0),
    "linear, B 16, 5 x 2 steps, lr 2": dict(model=MODEL, rounds=5, batch_size=16,
                                            local_steps=2, lr_local=2.0),
}
TUNING_SEEDS = (100, 101, 102)
VALIDATION_RECORDS = 40
#: the validation split's pick (``--tune``: 99.2%, tied with the last candidate; the first
#: best listed wins); every method runs with it
PICKED = "linear, B 32, 10 x 1 steps, lr 2"
COMMON = dict(clip=1.0, **CANDIDATES[PICKED])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/penguins"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--tune", action="store_true",
                        help="score DP-FedAvg's candidates on the validation split instead")
    args = parser.parse_args()
    from fedlap_privacy.fl.config import TrainConfig
    from fedlap_privacy.fl.engine.simulation import train

    sizes = write_clients(args.out / "data")
    print(f"clients (records per island, before the held-out fifth): {sizes}")
    if args.tune:
        print(f"| DP-FedAvg candidate, epsilon 3 | validation accuracy ({VALIDATION_RECORDS} "
              "training records held out), mean | per seed |")
        print("|---|---|---|")
        for name, values in CANDIDATES.items():
            scores = []
            for seed in TUNING_SEEDS:
                cfg = TrainConfig(**{**RUNS["DP-FedAvg, epsilon 3"], "clip": 1.0, **values,
                                     "validation_records": VALIDATION_RECORDS, "seed": seed})
                result = train(cfg, None, "cpu", data=args.out / "data")
                scores.append(result.summary.validation_accuracy)
            print(f"| {name} | {statistics.mean(scores):.1%} | "
                  f"{', '.join(f'{a:.1%}' for a in scores)} |")
        return
    print("| run | test accuracy (mean ± sd) | per seed | epsilon |")
    print("|---|---|---|---|")
    for name, values in RUNS.items():
        accs, eps = [], None
        for seed in args.seeds:
            cfg = TrainConfig(**{**COMMON, **values, "seed": seed})  # type: ignore[arg-type]
            result = train(cfg, None, "cpu", data=args.out / "data")
            accs.append(result.summary.test_accuracy)
            eps = result.summary.privacy.epsilon
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        print(f"| {name} | {statistics.mean(accs):.1%} ± {spread:.1%} | "
              f"{', '.join(f'{a:.1%}' for a in accs)} | {'-' if eps is None else f'{eps:.2f}'} |")


if __name__ == "__main__":
    main()
