"""The table of docs/accounting.md#distributed-dp-over-secure-aggregation: the noise distributed
DP needs against the server relative to central DP at the same epsilon.

100 clients a round, 1,500 participations (no amplification: the server picks the cohort),
target epsilon 4 at delta 1e-5, clip 1, rounding bias exp(-1/2), wrap-around probability 1e-4
per coordinate; model sizes 65,536 and 1,048,576; 16, 18 and 20 bits. Prints a markdown table
(about one second per row), then the epsilon of the 65k, 20-bit Skellam plan when only 60 of
the 100 planned shares reach the sum.

    python benchmarks/experiments/distributed_dp_table.py
"""

from __future__ import annotations

from fedlap_privacy.accountant.distributed import (
    DistributedNoise,
    distributed_epsilon,
    plan_distributed,
)
from fedlap_privacy.errors import ConfigError

CLIENTS, ROUNDS, EPSILON, DELTA = 100, 1500, 4.0, 1e-5


def main() -> None:
    print("| noise | parameters | bits | gamma | local std (grid) | noise multiplier | "
          "x central |")
    print("|---|---|---|---|---|---|---|")
    for noise in DistributedNoise:
        for size in (65_536, 1_048_576):
            for bits in (16, 18, 20):
                try:
                    plan = plan_distributed(noise, epsilon=EPSILON, delta=DELTA,
                                            model_size=size, clients=CLIENTS, rounds=ROUNDS,
                                            bits=bits)
                except ConfigError:
                    print(f"| {noise} | {size:,} | {bits} | - | - | - | unreachable |")
                    continue
                m = plan.mechanism
                print(f"| {noise} | {size:,} | {bits} | {m.quantisation.gamma:.3g} | "
                      f"{m.local_std:,.1f} | {plan.noise_multiplier:.2f} | {plan.ratio:.4f} |")
    plan = plan_distributed("skellam", epsilon=EPSILON, delta=DELTA, model_size=65_536,
                            clients=CLIENTS, rounds=ROUNDS, bits=20)
    print(f"\ncentral noise multiplier: {plan.central_sigma:.2f}")
    dropped = distributed_epsilon(plan.mechanism, [60] * ROUNDS, DELTA)
    print(f"65k, 20 bits, Skellam: planned epsilon {plan.epsilon:.3f}; with 60 of 100 shares "
          f"every round: {dropped.epsilon:.2f}")


if __name__ == "__main__":
    main()
