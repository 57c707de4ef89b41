"""FedLAP-DP's server rate, re-run on the synthetic sets of saved one-round runs.

The server's optimisation (paper Eq. 14/16) only reads the clients' uploaded synthetic sets,
so it is post-processing: changing its rate costs no privacy, and in a one-round run it does
not change what the clients upload (their local steps use the round's rate, not the server's).
This script therefore replays round 1's server optimisation of finished one-round
``fedlap-dp`` runs at ``server_lr`` = each ``--factors`` value, from the run's initial model
(rebuilt from its seed) and the uploads kept in its ``private.pt``, and reports:

* the distance the server moved from the initial model (the trust-region radius caps it);
* validation accuracy on ``--validation`` training records that no client holds (drawn with
  a fixed seed; never the test set): the number to choose a factor by;
* test accuracy, for docs/results.md.

The server's batch order and DSA draws come from a seeded generator here, from the secret
one in the run, so factor 1 reproduces the run's accuracy only up to that randomness.

    python benchmarks/experiments/fedlap_server_rate.py RUN [RUN ...] --data-dir data/fashion-mnist
        [--factors 1,2.5,5] [--validation 5000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from fedlap_privacy.data.datasets import load_dataset
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.simulation import evaluate
from fedlap_privacy.fl.methods.augment import DSA
from fedlap_privacy.fl.methods.fedlap import SyntheticSet, server_optimisation
from fedlap_privacy.fl.methods.trust_region import clone_params, distance
from fedlap_privacy.models import build_model
from fedlap_privacy.state.checkpoint import CHECKPOINT, PRIVATE
from fedlap_privacy.state.run_state import ModelRelease, PrivateRunState


def replay(run: Path, factors: list[float], data_dir: str, validation: int) -> list[dict]:
    release = ModelRelease.load(run / CHECKPOINT)
    private = PrivateRunState.load(run / PRIVATE)
    cfg = TrainConfig.from_dict(private.config)
    if cfg.method != "fedlap-dp" or release.round != 1 or cfg.rounds != 1:
        raise SystemExit(f"{run}: a finished one-round fedlap-dp run is needed")
    data = load_dataset(cfg.dataset, data_dir)
    held = np.concatenate([np.asarray(i) for i in private.client_indices])
    free = np.setdiff1d(np.arange(len(data.y_train)), held)
    val = np.random.default_rng(0).choice(free, validation, replace=False)
    x_val, y_val = torch.from_numpy(data.x_train[val]), torch.from_numpy(data.y_train[val])
    x_test, y_test = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    sets = [SyntheticSet(s["synthetic"]["images"], s["synthetic"]["labels"])
            for s in private.client_state]
    sizes = [len(i) for i in private.client_indices]
    weights = [n / sum(sizes) for n in sizes]
    saved = build_model(release.model_config)
    saved.load_state_dict(release.model_state)
    rows = []
    for factor in factors:
        torch.manual_seed(cfg.seed)  # the run's initial model (fl.engine.training_run.TrainingRun)
        model = build_model(release.model_config)
        start = clone_params(model)
        steps = server_optimisation(
            model, sets, weights, cfg.radius, factor * cfg.lr_net, cfg.server_epochs,
            cfg.server_batch, torch.Generator().manual_seed(cfg.seed), cfg.server_momentum,
            DSA().draw if cfg.dsa else None,
        )
        rows.append({
            "run": run.name, "seed": cfg.seed, "server_lr": factor, "steps": steps,
            "distance": distance(model, start), "radius": cfg.radius,
            "validation_accuracy": evaluate(model, x_val, y_val)[0],
            "test_accuracy": evaluate(model, x_test, y_test)[0],
            "run_test_accuracy": evaluate(saved, x_test, y_test)[0],
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--factors", default="1,2.5,5")
    parser.add_argument("--validation", type=int, default=5000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    factors = [float(f) for f in args.factors.split(",")]
    rows = [r for run in args.runs for r in replay(run, factors, args.data_dir, args.validation)]
    print(f"\n{'server_lr':>9} {'validation':>10} {'test':>6}  (mean over {len(args.runs)} runs)")
    for factor in factors:
        mine = [r for r in rows if r["server_lr"] == factor]
        val = np.mean([r["validation_accuracy"] for r in mine])
        test = [r["test_accuracy"] for r in mine]
        print(f"{factor:>9g} {100 * val:>9.1f}% {100 * np.mean(test):>5.1f}% "
              f"± {100 * np.std(test, ddof=1) if len(test) > 1 else 0:.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
