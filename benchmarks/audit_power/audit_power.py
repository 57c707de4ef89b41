"""Audit power: the most each one-run bound can show, and the smallest noise deficit caught.

Part 1 (default): the ceiling (the bound when every guess is right) of Steinke, Nasr,
Jagielski's one-run bound and of the f-DP bound of Mahloujifar, Melis, Chaudhuri (Gaussian
family), for 100 / 1,000 / 10,000 canaries at 95% confidence and delta 1e-5: guessing on
every canary (r = m, one candidate), and the audit's default selection (the best over
:func:`~fedlap_privacy.audit.bounds.one_run.one_run_candidate_grid`, each at level 0.05 / its size).

Part 2 (``--deficit``): the white-box fault injection of benchmarks/audit_power/canary_audit.py
(the real DP step, 40 steps on a 32-record client at Poisson rate 1/4, 1,000 canaries, the ledger
claiming epsilon 1 at delta 1e-5) with the noise scaled by each factor; over 20 seeds, how
often each method (and the strongest valid verdict) finds a violation.

    python benchmarks/audit_power/audit_power.py
    python benchmarks/audit_power/audit_power.py --deficit 1.0 0.5 0.4 0.35 0.3 0.25 0.2
"""

from __future__ import annotations

import argparse

from fedlap_privacy.audit.bounds.one_run import one_run_candidate_grid, one_run_ceiling

DELTA, CONFIDENCE = 1e-5, 0.95


def _grid_ceiling(m: int, method: str) -> float:
    grid = one_run_candidate_grid(m)
    level = (1.0 - CONFIDENCE) / len(grid)
    return max(one_run_ceiling(m, a + b, DELTA, 1.0 - level, method=method) for a, b in grid)


def ceilings() -> None:
    print("| canaries | Steinke, r = m | f-DP, r = m | Steinke, grid | f-DP, grid |")
    print("|---|---|---|---|---|")
    for m in (100, 1_000, 10_000):
        cells = [one_run_ceiling(m, m, DELTA, CONFIDENCE, method=k) for k in ("steinke", "fdp")]
        cells += [_grid_ceiling(m, k) for k in ("steinke", "fdp")]
        print(f"| {m:,} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


def deficit(factors: list[float]) -> None:
    import torch

    from fedlap_privacy.accountant import FedLAPSchedule, plan_sigma
    from fedlap_privacy.audit.bounds.claim_curve import ClaimCurve
    from fedlap_privacy.audit.canaries.canary_audit import run_canary_audits
    from fedlap_privacy.fl.auditing.canaries import audit_dp_steps
    from fedlap_privacy.fl.methods import dp
    from fedlap_privacy.state.ledger import PrivacyLedger

    n, b, t, m = 32, 8, 40, 1000
    schedule = FedLAPSchedule(batch_size=b, client_size=n, local_steps=t)
    sigma = plan_sigma(schedule, 1, 1.0, DELTA)
    ledger = PrivacyLedger("record-level", schedule, sigma, DELTA, clients=1)
    ledger.record(1, t, [0])
    curve = ClaimCurve.from_steps({(sigma, b / n): t}, DELTA)
    real = dp.release
    print(f"claim: epsilon {ledger.epsilon:.3f} (sigma {sigma:.3f}); violations of 20 seeds")
    print("| noise factor | Steinke | f-DP | claim-curve | strongest valid |")
    print("|---|---|---|---|---|")
    for factor in factors:
        def scaled(total, c, s, bs, gen, f=factor):
            return real(total, c, s * f, bs, gen)

        dp.release = scaled
        found = {"steinke": 0, "fdp": 0, "claim-curve": 0, "strongest": 0}
        for seed in range(20):
            g = torch.Generator().manual_seed(seed)
            model = torch.nn.Linear(1000, 10)
            x, y = torch.randn(n, 1000, generator=g), torch.randint(0, 10, (n,), generator=g)
            state = audit_dp_steps(model, x, y, steps=t, batch_size=b, clip=1.0, sigma=sigma,
                                   canaries=m, generator=g)
            (audit,) = run_canary_audits(state, None, ledger.epsilon, DELTA, curve=curve)
            for name, result in audit.methods().items():
                found[name] += result["verdict"] == "violation"
            found["strongest"] += audit.verdict == "violation"
        dp.release = real
        print(f"| {factor:g} | " + " | ".join(f"{v}/20" for v in found.values()) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deficit", type=float, nargs="*", default=None,
                        help="noise factors to inject (part 2)")
    args = parser.parse_args()
    if args.deficit is None:
        ceilings()
    else:
        deficit(args.deficit or [1.0, 0.5, 0.4, 0.35, 0.3, 0.25, 0.2])


if __name__ == "__main__":
    main()
