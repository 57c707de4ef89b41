"""Audit power of canary scores (``audit --canary-scores``): summed update versus per-step
likelihood ratio, on the claimed mechanism simulated with its noise scaled.

Gradient canaries as a JAX / TensorFlow / Opacus user adds them (docs/auditing.md): 1,000
canaries, each on its own coordinate of a block no real record reaches, each included with a
fair coin; when included, Poisson-sampled at rate q in every step and adding its clipped
gradient (norm C = 1) to the clipped sum before the Gaussian noise (sigma C). The claim is
sigma 1, q 0.01, 1,000 steps (epsilon 1.83 at delta 1e-5 by the PLD accountant); the run's
real noise is the claimed one times ``factor``. Two scores of the same run:

* ``summed``: the canary coordinate's total update, ``sum_t u_t``;
* ``per-step LR``: ``sum_t log(1 - q + q exp((u_t - C/2) C / (sigma C)^2))`` with the
  claimed sigma, the log-likelihood ratio of "included" against "not included".

For each, over seeds: how often :func:`~fedlap_privacy.audit.audit_canary_scores` (with the
claimed mechanism: Steinke, f-DP and the claim-curve test, family-wise 95%) finds a
violation, and the median lower bound.

    python benchmarks/audit_power/score_audit_power.py --seeds 10
"""

from __future__ import annotations

import argparse
import math
import secrets

import numpy as np

from fedlap_privacy.audit import ClaimedMechanism, audit_canary_scores

M, DELTA = 1000, 1e-5
CLAIM = ClaimedMechanism(noise_multiplier=1.0, sample_rate=0.01, steps=1000)


def scores(factor: float, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], np.ndarray]:
    q, sigma = CLAIM.sample_rate, CLAIM.noise_multiplier
    included = rng.random(M) < 0.5
    summed, ratio = np.zeros(M), np.zeros(M)
    for _ in range(CLAIM.steps):
        sampled = included & (rng.random(M) < q)
        u = sampled + factor * sigma * rng.standard_normal(M)
        summed += u
        ratio += np.logaddexp(math.log1p(-q), math.log(q) + (u - 0.5) / sigma**2)
    return {"summed": summed, "per-step LR": ratio}, included


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--factors", type=float, nargs="+", default=[1.0, 0.5, 0.3])
    args = parser.parse_args()
    claimed = CLAIM.epsilon(DELTA)
    print(f"claim: epsilon {claimed:.3f} at delta {DELTA:g}; {args.seeds} seeds per cell")
    print("| noise factor | score | violations | median lower bound | median claim-curve p |")
    print("|---|---|---|---|---|")
    for factor in args.factors:
        found: dict[str, list[tuple[bool, float, float]]] = {}
        for _ in range(args.seeds):
            named, included = scores(factor, np.random.default_rng(secrets.randbits(64)))
            for name, values in named.items():  # each score audited on its own
                r = audit_canary_scores(values, included, claimed_epsilon=claimed, delta=DELTA,
                                        mechanism=CLAIM)
                found.setdefault(name, []).append(
                    (r.violation, r.epsilon_lower_bound, r.claim_curve_p_value or 1.0))
        for name, rows in found.items():
            hits = sum(v for v, _, _ in rows)
            print(f"| {factor:g} | {name} | {hits} / {len(rows)} | "
                  f"{np.median([b for _, b, _ in rows]):.2f} | "
                  f"{np.median([p for _, _, p in rows]):.2g} |")


if __name__ == "__main__":
    main()
