"""Canary clients in Flower's own DP strategies (docs/auditing.md, "Auditing Flower's DP
strategies"): what the one-run audit finds, over seeds.

Every row rehearses a Flower strategy in-process (:func:`fedlap_privacy.audit.rehearse_flower`:
synthetic clients, a model of 5,000 parameters, clip C = 1) with
:func:`fedlap_privacy.audit.CanaryClients` around it, and audits the claim (the configured
noise multiplier z, the strategy's sampling rate q, the rounds T; epsilon at delta 1e-5 by
the PLD accountant). Two configurations:

* cohort: 600 clients, 60 sampled (q = 0.1), T = 20, 1000 canaries (about 50 a round, each
  taking a sampled client's place), z = 1.2 (claim 2.52): the wrapper's noise at 1x, 0.5x,
  0.3x the claim, legacy and Message API, server- and client-side clipping;
* sparse: 1000 clients, 20 sampled (q = 0.02), T = 100, 200 canaries (2 a round), z = 1
  (claim 1.43), the legacy server-side wrapper with its noise as claimed, the canaries
  reporting num_examples = 1x, 3x, 10x, 100x the real clients' 100 (FedAvg's weighting).

Columns: the verdict; the largest valid bound with its score; the smallest claim-curve
p-value (corrected over its candidate guesses; a violation below 0.05 / 9, the 3 scores x 3
tests); Andrew et al.'s
epsilon ESTIMATE (final model / all iterates; an estimate, never a verdict). Flower's noise
draws from ``np.random`` (seeded with the seed), the canaries' coins from the OS.

    .venv/bin/python benchmarks/audit_power/flower_canaries.py --seeds 3
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np
from flwr.server import strategy as legacy
from flwr.serverapp import strategy as messages

from fedlap_privacy.audit import CanaryClients, rehearse_flower

DIMENSION = 5000


@dataclass(frozen=True)
class Row:
    name: str
    api: str
    wrapper: str
    population: int
    sampled: int
    rounds: int
    m: int
    z: float
    noise: float = 1.0  # the wrapper's noise multiplier over the claimed one
    weight: float | None = None  # the canaries' num_examples (real clients: 100)


COHORT = {"population": 600, "sampled": 60, "rounds": 20, "m": 1000, "z": 1.2}
SPARSE = {"population": 1000, "sampled": 20, "rounds": 100, "m": 200, "z": 1.0}
ROWS = [
    Row("server-side, noise 1x", "legacy", "ServerSideFixedClipping", **COHORT),
    Row("server-side, noise 0.5x", "legacy", "ServerSideFixedClipping", **COHORT, noise=0.5),
    Row("server-side, noise 0.3x", "legacy", "ServerSideFixedClipping", **COHORT, noise=0.3),
    Row("client-side, noise 1x", "legacy", "ClientSideFixedClipping", **COHORT),
    Row("Message API server-side, 1x", "message", "ServerSideFixedClipping", **COHORT),
    Row("Message API server-side, 0.3x", "message", "ServerSideFixedClipping", **COHORT,
        noise=0.3),
    Row("num_examples 1x (equal)", "legacy", "ServerSideFixedClipping", **SPARSE),
    Row("num_examples 3x", "legacy", "ServerSideFixedClipping", **SPARSE, weight=300),
    Row("num_examples 10x", "legacy", "ServerSideFixedClipping", **SPARSE, weight=1000),
    Row("num_examples 100x", "legacy", "ServerSideFixedClipping", **SPARSE, weight=10000),
]


def run(row: Row, seed: int) -> dict[str, object]:
    np.random.seed(seed)  # noqa: NPY002 (Flower adds its noise from the global state)
    module = legacy if row.api == "legacy" else messages
    if row.api == "legacy":
        inner = legacy.FedAvg(fraction_fit=row.sampled / row.population, min_fit_clients=2,
                              min_available_clients=2)
    else:
        inner = messages.FedAvg(fraction_train=row.sampled / row.population,
                                min_train_nodes=2, min_available_nodes=2)
    dp = getattr(module, f"DifferentialPrivacy{row.wrapper}")(
        inner, noise_multiplier=row.noise * row.z, clipping_norm=1.0,
        num_sampled_clients=row.sampled)
    strategy = CanaryClients(dp, m=row.m, num_examples=row.weight)
    start = time.perf_counter()
    rehearse_flower(strategy, row.rounds, population=row.population, dimension=DIMENSION,
                    seed=seed)
    result = strategy.audit(noise_multiplier=row.z)
    best = max(result.audits, key=lambda a: a.epsilon_lower_bound)
    final = result.audit.score("clients/final").estimate
    every = result.audit.score("clients/all-iterates").estimate
    return {"claim": result.claim.epsilon, "verdict": result.verdict,
            "bound": result.epsilon_lower_bound, "score": best.name.split("/")[1],
            "p": result.claim_p_value, "final": final.epsilon if final else float("nan"),
            "every": every.epsilon if every else float("nan"),
            "seconds": time.perf_counter() - start}


def adaptive_clip_drift() -> None:
    """The clip of Flower's server-side adaptive wrappers (both APIs) every 10 rounds, with
    client updates of norm 1 (no canaries): Andrew et al. (2021) move the clip towards the
    target quantile of the update norms."""
    for module, fraction in ((legacy, {"fraction_fit": 0.1}),
                             (messages, {"fraction_train": 0.1})):
        for start in (0.1, 10.0):
            np.random.seed(0)  # noqa: NPY002 (Flower adds its noise from the global state)
            dp = module.DifferentialPrivacyServerSideAdaptiveClipping(
                module.FedAvg(**fraction), noise_multiplier=1.0, num_sampled_clients=20,
                initial_clipping_norm=start, clipped_count_stddev=2.0)
            clips = []
            for block in range(5):
                rehearse_flower(dp, 10, population=200, dimension=1000, seed=block)
                clips.append(f"{dp.clipping_norm:.4g}")
            print(f"{module.__name__} adaptive clipping, updates of norm 1, clip {start} -> "
                  f"every 10 rounds: {', '.join(clips)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", default="", help="run the rows whose name contains this")
    parser.add_argument("--adaptive", action="store_true",
                        help="only show where Flower's adaptive clipping takes its clip")
    args = parser.parse_args()
    if args.adaptive:
        adaptive_clip_drift()
        return
    print(f"{'row':31s} {'seed':>4s} {'claim':>6s} {'verdict':>12s} {'bound':>6s} "
          f"{'(score)':18s} {'curve p':>9s} {'est final':>9s} {'est all':>8s} {'s':>5s}")
    for row in ROWS:
        if args.only not in row.name:
            continue
        for seed in range(args.seeds):
            r = run(row, seed)
            print(f"{row.name:31s} {seed:4d} {r['claim']:6.2f} {r['verdict']:>12s} "
                  f"{r['bound']:6.3f} ({r['score']:16s}) {r['p']:9.2g} {r['final']:9.2f} "
                  f"{r['every']:8.2f} {r['seconds']:5.1f}", flush=True)


if __name__ == "__main__":
    main()
