"""What the canary audits detect, what they cost, and how long they take.

Part 1, faults (``--faults``): the real DP step (:func:`fedlap_privacy.fl.methods.dp.dp_gradient`)
run 40 times on a 32-record client (Poisson rate 1/4) with 1000 white-box Dirac canaries,
its ledger claiming epsilon 1 at delta 1e-5; then the same step with its noise removed,
its noise 10x too small, and its clipping disabled. Prints, over 20 seeds, how often the
one-run audit finds a violation and the bounds it reached.

Part 2, runs (``--runs``): a method trained with 0 and with M canaries: test accuracy (the
accuracy cost of the canaries), training time, and the time and result of
``fedlap-privacy audit`` on the run with canaries. Digits by default; with ``--data-dir``
FashionMNIST (one round of DP-FedAvg, B 256, 20 local steps).

    python benchmarks/audit_power/canary_audit.py --faults
    python benchmarks/audit_power/canary_audit.py --runs --canaries 1000
    python benchmarks/audit_power/canary_audit.py --runs --dataset fashion-mnist --data-dir data/fashion-mnist
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedlap_privacy.accountant import FedLAPSchedule, plan_sigma
from fedlap_privacy.audit.canaries.canary_audit import run_canary_audits
from fedlap_privacy.audit.inference.report import run_audit
from fedlap_privacy.fl.auditing.canaries import audit_dp_steps
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.simulation import train
from fedlap_privacy.fl.methods import dp
from fedlap_privacy.state.ledger import PrivacyLedger

N, B, T, M, DELTA = 32, 8, 40, 1000, 1e-5


def faults(seeds: int) -> None:
    schedule = FedLAPSchedule(batch_size=B, client_size=N, local_steps=T)
    sigma = plan_sigma(schedule, 1, 1.0, DELTA)
    ledger = PrivacyLedger("record-level", schedule, sigma, DELTA, clients=1)
    ledger.record(1, T, [0])
    claimed = ledger.epsilon
    real_noise, real_clip = dp.clip_and_noise, dp.clip_factors
    variants = {
        "correct": (1.0, real_clip),
        "noise removed": (0.0, real_clip),
        "noise 10x too small": (0.1, real_clip),
        "no clipping": (1.0, lambda norms, c: torch.ones_like(norms)),
    }
    print(f"claimed epsilon {claimed:.3f} (sigma {sigma:.3f}); {M} Dirac canaries, {T} steps, "
          f"{seeds} seeds")
    print("| DP step | violations | eps lower bound: median (min-max) | ceiling |")
    print("|---|---|---|---|")
    for name, (factor, clip_rule) in variants.items():
        dp.clip_and_noise = lambda ps, c, s, b, g, f=factor: real_noise(ps, c, s * f, b, g)
        dp.clip_factors = clip_rule
        bounds, verdicts, ceiling = [], [], 0.0
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)
            model = torch.nn.Linear(1000, 10)
            x, y = torch.randn(N, 1000, generator=g), torch.randint(0, 10, (N,), generator=g)
            state = audit_dp_steps(model, x, y, steps=T, batch_size=B, clip=1.0, sigma=sigma,
                                   canaries=M, generator=g)
            (audit,) = run_canary_audits(state, None, claimed, DELTA)
            bounds.append(audit.result.epsilon_lower_bound)
            verdicts.append(audit.verdict)
            ceiling = audit.result.ceiling
        dp.clip_and_noise, dp.clip_factors = real_noise, real_clip
        print(f"| {name} | {verdicts.count('violation')}/{seeds} | "
              f"{statistics.median(bounds):.2f} ({min(bounds):.2f}-{max(bounds):.2f}) | "
              f"{ceiling:.2f} |")


def runs(args: argparse.Namespace) -> None:
    base = dict(method=args.method, dataset=args.dataset, data_dir=args.data_dir,
                rounds=args.rounds, seed=0)
    if args.dataset != "digits":
        base.update(batch_size=256, local_steps=20, width=None)
    print(f"| {args.method} on {args.dataset} | test accuracy % | epsilon | train s | "
          "audit s | eps lower bound | ceiling | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for m in (0, args.canaries):
            out = Path(tmp) / f"m{m}"
            start = time.perf_counter()
            summary = train(TrainConfig(**base, canaries=m), out, device="cpu").summary
            trained = time.perf_counter() - start
            cells = ["-", "-", "-", "-"]
            if m:
                start = time.perf_counter()
                report = run_audit(out / "ckpt.pt", attacks="loss", device="cpu")
                audited = time.perf_counter() - start
                one_run = report.one_run
                assert one_run is not None
                cells = [f"{audited:.1f}", f"{one_run['epsilon_lower_bound']:.2f}",
                         f"{one_run['ceiling']:.2f}", one_run["verdict"]]
            print(f"| {m} canaries | {100 * summary.test_accuracy:.2f} | "
                  f"{summary.privacy.epsilon:.2f} | {trained:.1f} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", action="store_true")
    parser.add_argument("--runs", action="store_true")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--method", default="fedlap-dp")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--canaries", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.faults or not args.runs:
        faults(args.seeds)
    if args.runs:
        runs(args)


if __name__ == "__main__":
    main()
