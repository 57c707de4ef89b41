"""How far off ``train --dry-run``'s time estimate is: the estimate of a round
(``fl.engine.dry_run.time_steps``: a few client steps timed on random data, extrapolated)
against the rounds of the same configuration actually trained, in the same process, one
after the other (so both see the same load on a shared machine).

Configurations (each through ``resolve_config``, as ``train`` resolves its flags, so the
cross-device defaults apply where the rule picks them):

* ``readme``: the README's cross-device command, dp-fedavg-client on FashionMNIST, 3,000
  clients (dirichlet), client fraction 1/30, target epsilon 2 (the packed cohort);
* ``shards``: dp-fedavg-client on FashionMNIST, 1,000 clients (shards), client fraction 0.05,
  target epsilon 2 (the issue's dry run that did not answer);
* ``fedlap``: FedLAP-DP on the digits, 5 clients, sigma 1.5 (the loop, one client after the
  other, T = 10).

For each: the dry run's seconds (the timing itself), its estimate of a round and of the
rounds measured, the rounds' wall seconds (in-process, no files: checkpoints excluded, as
in the estimate), their ratio (estimate / measured: above 1, the estimate errs high) and
the CPU seconds of the rounds (the steadier figure on a shared machine). One JSON line per
configuration.

    python benchmarks/speed/dry_run_estimate.py --data-dir /path/to/fashion-mnist [--rounds 3]
        [--configs readme,shards,fedlap]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "readme": dict(method="dp-fedavg-client", dataset="fashion-mnist", clients=3000,
                   split="dirichlet", client_fraction=1 / 30, target_eps=2.0),
    "shards": dict(method="dp-fedavg-client", dataset="fashion-mnist", clients=1000,
                   split="shards", client_fraction=0.05, target_eps=2.0),
    "fedlap": dict(method="fedlap-dp", dataset="digits", clients=5, sigma=1.5),
}


def measure(name: str, data_dir: str | None, rounds: int) -> dict[str, Any]:
    """The estimate and the measured rounds of configuration ``name``."""
    from fedlap_privacy.fl.config_resolve import resolve_config
    from fedlap_privacy.fl.engine.dry_run import plan_run, read_data, time_steps
    from fedlap_privacy.fl.engine.events import RoundEnded, RoundStarted, RunEvent
    from fedlap_privacy.fl.engine.simulation import train

    flags = {**CONFIGS[name], "rounds": rounds, "split_seed": 0}
    if flags["dataset"] != "digits":
        flags["data_dir"] = data_dir
    cfg = resolve_config(None, flags)
    cfg, data_plan, data = read_data(cfg)
    start = time.perf_counter()
    timing = time_steps(cfg, data, "cpu")
    timing_s = time.perf_counter() - start
    plan = plan_run(cfg, data_plan.client_sizes, timing)
    round_estimate = timing.round_seconds(plan.config, plan.accesses_per_round)

    marks: dict[str, float] = {}
    walls: list[float] = []
    cpus: list[float] = []

    def clock(event: RunEvent) -> None:
        if isinstance(event, RoundStarted):
            marks["wall"], marks["cpu"] = time.perf_counter(), time.process_time()
        elif isinstance(event, RoundEnded):
            walls.append(time.perf_counter() - marks["wall"])
            cpus.append(time.process_time() - marks["cpu"])

    result = train(plan.config, None, "cpu", clock, data=data)
    measured = sum(walls) / len(walls)
    return {
        "config": name, "clients": cfg.clients, "expected_cohort": cfg.sampling.expected_cohort,
        "mode": timing.mode, "steps_timed": timing.steps, "clients_timed": timing.cohort,
        "dry_run_timing_s": round(timing_s, 2), "estimate_round_s": round(round_estimate, 3),
        "measured_round_s": [round(w, 3) for w in walls],
        "measured_round_cpu_s": [round(c, 3) for c in cpus],
        "ratio": round(round_estimate / measured, 3),
        "test_accuracy": result.summary.test_accuracy,
        "load_before": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="data/fashion-mnist")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    from fedlap_privacy.compute.threads import apply_cpu_policy

    apply_cpu_policy(None)  # as the CLI does
    for name in args.configs.split(","):
        print(json.dumps(measure(name, args.data_dir, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
