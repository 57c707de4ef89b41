"""Gather finished training runs under a folder into one JSON file (the tables of docs/results.md).

Every folder below ``ROOT`` that holds a run (``metrics.jsonl`` and its private state)
becomes one record: its path relative to ``ROOT``, the settings that tell runs apart
(method, rounds, seed, sigma, batch size, T, the FedLAP server rate, the baselines' local
steps, rate and proximal weight mu) and, after each round, the test accuracy and epsilon
spent (``metrics.jsonl``) and the validation accuracy (the run's private state: the
validation records are private training records).
A run is finished when its ledger has charged every planned round (``rounds_spent``; a round
interrupted and charged on resume counts, so such a run trains fewer rounds than planned).

    python benchmarks/experiments/collect_runs.py ROOT --json out.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedlap_privacy.fl.run.run_files import METRICS, load_history, load_private, load_run_config

SETTINGS = ("method", "rounds", "seed", "sigma", "batch_size", "accesses_per_round",
            "server_lr", "lr_schedule", "local_steps", "lr_local", "prox_mu",
            "client_records", "validation_records")


def collect(root: Path) -> list[dict]:
    records = []
    for metrics in sorted(root.rglob(METRICS)):
        run = metrics.parent
        rows = load_history(run)
        cfg = load_run_config(run)
        spent = rows[-1].rounds_spent if rows else 0
        records.append({
            "run": str(run.relative_to(root)),
            **{key: getattr(cfg, key) for key in SETTINGS},
            "finished": spent >= cfg.rounds,
            "rounds_spent": spent,
            "test_accuracy": [r.test_accuracy for r in rows],
            # older runs wrote it into metrics.jsonl
            "validation_accuracy": [v.accuracy for v in load_private(run).validation_scores]
            or [r.extras.get("validation_accuracy") for r in rows],
            "epsilon": [r.epsilon for r in rows],
            "seconds": [r.seconds for r in rows],
        })
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    records = collect(args.root)
    args.json.write_text(json.dumps(records, indent=1) + "\n")
    for r in records:
        last = r["test_accuracy"][-1] if r["test_accuracy"] else float("nan")
        print(f"{r['run']:60s} {len(r['test_accuracy'])}/{r['rounds']} rounds trained, "
              f"{r['rounds_spent']} charged  "
              f"test {100 * last:5.1f}%")


if __name__ == "__main__":
    main()
