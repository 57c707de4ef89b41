"""What gradient canaries see in a real Opacus DP-SGD run: noise right, at 0.5x, at 0.3x.

Opacus trains an MLP (64-32-10) on scikit-learn's digits with DP-SGD: noise multiplier 1
(or 0.5x / 0.3x of it while the claim stays that of sigma 1), clipping norm 1, Poisson rate
1/29 (batch 64 of 1797), 10 epochs (290 steps); the claim is Opacus's RDP epsilon at delta
1e-5 for sigma 1, and the claimed mechanism (sigma 1, the rate, the steps) is passed to the
audit. 1000 gradient canaries (:class:`fedlap_privacy.audit.GradientCanaries`) sit either on
the dedicated canary block (``block``) or on the first 1000 coordinates of the first layer's
own weight (``model``: every record's gradient reaches them). Each is scored three ways: the
per-step likelihood ratio at the claimed noise, the same at the noise measured on the
released coordinates (the score ``GradientCanaries.audit`` uses), and the summed release.
Each score is audited alone (:func:`~fedlap_privacy.audit.canaries.score_audit.audit_canary_scores`,
95%: Steinke's bound, the f-DP bound and the claim-curve test sharing it); the table gives,
over the seeds, the largest valid bound (mean, min-max), the claim-curve p-value (median)
and how many seeds found a violation.

    python benchmarks/audit_power/opacus_canaries.py [--seeds 5]

``--bugs`` instead audits, with the default claim (the one the optimiser was set up with),
runs whose noise, accumulation or sampling goes wrong after ``make_private``: synthetic data
(1,800 records, 20 features, two classes), an MLP 20-16-2, Opacus RDP, 2,000 canaries at the
optimiser or as records of the dataset (``wrap_dataset``), each scenario over the seeds with
the coins from the operating system; it prints each scenario's claim, Opacus's own epsilon,
the canary records drawn against the accounted rate, the violations the canaries' releases
show (the score audit) and the violations of the verdict (the releases, or the sampling test
of the canary records).

    python benchmarks/audit_power/opacus_canaries.py --bugs [--seeds 3]

``--overhead`` times the training loop of the digits MLP above (10 epochs, one thread)
without canaries, with 1,000 canaries at the optimiser and with 1,000 canary records, over
the seeds (the fastest time per released step over the seeds, the least disturbed by other
work on a shared machine; per step, since canary records add steps).

    python benchmarks/audit_power/opacus_canaries.py --overhead [--seeds 3]

``--power`` audits the ``--bugs`` runs with the noise cut to 0.5x after ``attach`` at a set-up
claim near 1.5 (noise multiplier 2.3) with 1,000 to 30,000 canaries at the optimiser.

    python benchmarks/audit_power/opacus_canaries.py --power [--seeds 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections import defaultdict

import torch
from torch import nn

from fedlap_privacy.audit import GradientCanaries
from fedlap_privacy.audit.canaries import opacus_canaries
from fedlap_privacy.audit.canaries.score_audit import ClaimedMechanism, audit_canary_scores

SIGMA, CLIP, DELTA, M, BATCH, EPOCHS = 1.0, 1.0, 1e-5, 1000, 64, 10
FACTORS = (1.0, 0.5, 0.3)
SCORES = ("likelihood ratio (claimed noise)", "likelihood ratio (measured noise)",
          "summed release")


def _data() -> torch.utils.data.TensorDataset:
    from sklearn.datasets import load_digits

    d = load_digits()
    return torch.utils.data.TensorDataset(torch.tensor(d.data / 16.0, dtype=torch.float32),
                                          torch.tensor(d.target))


def train(seed: int, factor: float, placement: str) -> tuple[GradientCanaries, float, float]:
    """One Opacus run; returns the canaries, the claimed epsilon (sigma 1) and the rate."""
    from opacus import PrivacyEngine
    from opacus.accountants import RDPAccountant

    torch.manual_seed(seed)
    loader = torch.utils.data.DataLoader(_data(), batch_size=BATCH)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    canaries = GradientCanaries(m=M)
    if placement == "block":
        model = canaries.wrap(model)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=SIGMA * factor, max_grad_norm=CLIP)
    q = loader.sample_rate
    if placement == "block":
        canaries.attach(optimizer)
    else:  # the first layer's own weight: records reach every coordinate
        first = next(p for p in model.parameters() if p.numel() >= M)
        opacus_canaries.attach_to_parameter(canaries, optimizer, first, q)
    criterion = nn.CrossEntropyLoss()
    for _ in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
    claim = RDPAccountant()
    claim.history = [(SIGMA, q, canaries.steps)]
    return canaries, claim.get_epsilon(DELTA), q


#: scenario -> (canaries as records, loader, noise cut after attach, micro-batches per step,
#: set-up noise multiplier, the user's records)
BUGS: dict[str, tuple[bool, str, float, int, float, int]] = {
    "correct, canaries at the optimiser": (False, "opacus", 1.0, 1, 1.0, 1800),
    "noise cut to 0.3x after attach": (False, "opacus", 0.3, 1, 1.0, 1800),
    "noise cut to 0.5x after attach": (False, "opacus", 0.5, 1, 1.0, 1800),
    "correct, 4 micro-batches a step": (False, "opacus", 1.0, 4, 1.0, 1800),
    "noise 0.3x, 4 micro-batches a step": (False, "opacus", 0.3, 4, 1.0, 1800),
    "correct, canary records, Poisson loader": (True, "opacus", 1.0, 1, 1.0, 1800),
    "canary records, loader of 3x the batch": (True, "3x", 1.0, 1, 2.0, 1800),
    "canary records, weighted sampler (10x)": (True, "weighted", 1.0, 1, 1.5, 5000),
}


def train_bug(seed: int, records: bool, loader_kind: str, cut: float, accumulate: int,
              sigma: float, n: int, m: int | None = None) -> tuple[GradientCanaries, object]:
    """One synthetic-data Opacus run of a :data:`BUGS` scenario (``m`` canaries, by default
    2,000, 1,000 with 5,000 records); the canaries and engine."""
    from opacus import PrivacyEngine

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    data: torch.utils.data.Dataset = torch.utils.data.TensorDataset(
        x, (x[:, 0] + 0.5 * x[:, 1] > 0).long())
    m = m if m is not None else 2000 if n < 5000 else 1000
    batch, epochs = (120, 8) if n < 5000 else (200, 3)
    canaries = GradientCanaries(m=m)
    model = canaries.wrap(nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    if records:
        data = canaries.wrap_dataset(data)
    poisson = accumulate == 1
    loader = torch.utils.data.DataLoader(data, batch_size=batch // accumulate,
                                         shuffle=not poisson)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma,
        max_grad_norm=CLIP, poisson_sampling=poisson)
    canaries.attach(optimizer)
    optimizer.noise_multiplier *= cut
    if loader_kind == "3x":
        loader = torch.utils.data.DataLoader(data, batch_size=3 * batch, shuffle=True)
    elif loader_kind == "weighted":
        weights = torch.ones(len(data))
        weights[n:] = 10.0
        loader = torch.utils.data.DataLoader(
            data, batch_size=batch,
            sampler=torch.utils.data.WeightedRandomSampler(weights, len(data)))
    criterion = nn.CrossEntropyLoss()
    for _ in range(epochs):
        for i, (xb, yb) in enumerate(loader):
            criterion(model(xb), yb).backward()
            if (i + 1) % accumulate == 0:
                optimizer.step()
                optimizer.zero_grad()
    return canaries, engine


def timed(seed: int, route: str) -> float:
    """Seconds per released step of the digits run with canaries on ``route`` (``none``,
    ``optimizer`` or ``records``)."""
    from opacus import PrivacyEngine

    torch.manual_seed(seed)
    data: torch.utils.data.Dataset = _data()
    model: nn.Module = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    canaries = GradientCanaries(m=M)
    if route != "none":
        model = canaries.wrap(model)
    if route == "records":
        data = canaries.wrap_dataset(data)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    model, optimizer, loader = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=SIGMA,
        max_grad_norm=CLIP)
    if route != "none":
        canaries.attach(optimizer)
    criterion = nn.CrossEntropyLoss()
    steps = 0
    start = time.perf_counter()
    for _ in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
            steps += 1
    return (time.perf_counter() - start) / steps


def overhead(seeds: int) -> None:
    """The ``--overhead`` table (module docstring)."""
    best = {route: min(timed(seed, route) for seed in range(seeds))
            for route in ("none", "optimizer", "records")}
    base = best["none"]
    print("| canaries | ms per step (fastest) | overhead |")
    print("|---|---|---|")
    for route, per_step in best.items():
        print(f"| {route} | {1e3 * per_step:.2f} | {per_step / base:.2f}x |")


def bugs(seeds: int) -> None:
    """The ``--bugs`` table (module docstring)."""
    start = time.perf_counter()
    print("| scenario | claim (set up) | Opacus's epsilon | canary draws / accounted | "
          "bound (mean) | claim-curve p (median) | violations by the releases | "
          "violations |")
    print("|---|---|---|---|---|---|---|---|")
    for name, config in BUGS.items():
        found = []
        for seed in range(seeds):
            canaries, _ = train_bug(seed, *config)
            result = canaries.audit(delta=DELTA)
            run = result.run
            ratio = (run.canary_draws / run.accounted_draws if run.accounted_draws else None)
            found.append((result, ratio))
        claims = [r.claimed_epsilon for r, _ in found]
        opacus = [r.opacus_epsilon for r, _ in found]
        ratios = [x for _, x in found if x is not None]
        ps = [r.claim_curve_p_value for r, _ in found if r.claim_curve_p_value is not None]
        print(f"| {name} | {statistics.mean(claims):.2f} | {statistics.mean(opacus):.3g} | "
              f"{f'{statistics.mean(ratios):.2f}x' if ratios else 'n/a'} | "
              f"{statistics.mean(r.epsilon_lower_bound for r, _ in found):.2f} | "
              f"{statistics.median(ps):.2g} | "
              f"{sum(r.audit.violation for r, _ in found)}/{len(found)} | "
              f"{sum(r.violation for r, _ in found)}/{len(found)} |")
    print(f"{seeds} seeds, {time.perf_counter() - start:.0f} s (shared machine)")


def power(seeds: int) -> None:
    """The ``--power`` table (module docstring): noise cut to 0.5x after attach at a set-up
    claim near 1.5 (noise multiplier 2.3), against the number of canaries."""
    print("| canaries | claim (set up) | violations | seconds per run (mean) |")
    print("|---|---|---|---|")
    for m in (1000, 2000, 10000, 30000):
        found, spent = [], []
        for seed in range(seeds):
            start = time.perf_counter()
            canaries, _ = train_bug(100 + seed, False, "opacus", 0.5, 1, 2.3, 1800, m)
            found.append(canaries.audit(delta=DELTA))
            spent.append(time.perf_counter() - start)
        print(f"| {m} | {found[0].claimed_epsilon:.2f} | "
              f"{sum(r.violation for r in found)}/{seeds} | {statistics.mean(spent):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--bugs", action="store_true",
                        help="audit runs whose noise, accumulation or sampling goes wrong")
    parser.add_argument("--overhead", action="store_true",
                        help="time the training loop with and without canaries")
    parser.add_argument("--power", action="store_true",
                        help="noise at 0.5x at a claim near 1.5 against the number of canaries")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if args.bugs:
        bugs(args.seeds)
        return
    if args.overhead:
        overhead(args.seeds)
        return
    if args.power:
        power(args.seeds)
        return
    rows: dict[tuple[float, str, str], list[tuple[float, float | None, bool]]] = \
        defaultdict(list)
    start = time.perf_counter()
    claimed = q = steps = None
    for factor in FACTORS:
        for placement in ("block", "model"):
            for seed in range(args.seeds):
                canaries, claimed, q = train(seed, factor, placement)
                steps = canaries.steps
                mechanism = ClaimedMechanism(SIGMA, q, steps)
                scores = canaries.scores(SIGMA)
                for name in SCORES:
                    result = audit_canary_scores({name: scores[name]}, canaries.included,
                                                 claimed_epsilon=claimed, delta=DELTA,
                                                 mechanism=mechanism)
                    rows[(factor, placement, name)].append(
                        (result.epsilon_lower_bound, result.claim_curve_p_value,
                         result.violation))
    print(f"Opacus DP-SGD, digits MLP 64-32-10, sigma {SIGMA} claimed, rate {q:.4f}, "
          f"{steps} steps, C {CLIP}; claim: epsilon {claimed:.3f} at delta {DELTA} (Opacus "
          f"RDP); {M} canaries; {args.seeds} seeds; {time.perf_counter() - start:.0f} s "
          f"(shared machine)")
    print("| noise | canaries on | score | largest bound: mean (min-max) | claim-curve p "
          "(median) | violations |")
    print("|---|---|---|---|---|---|")
    for (factor, placement, name), found in rows.items():
        bounds = [b for b, _, _ in found]
        ps = [p for _, p, _ in found if p is not None]
        print(f"| {factor}x | {placement} | {name} | {statistics.mean(bounds):.2f} "
              f"({min(bounds):.2f}-{max(bounds):.2f}) | "
              f"{statistics.median(ps) if ps else float('nan'):.2g} | "
              f"{sum(v for _, _, v in found)}/{len(found)} |")


if __name__ == "__main__":
    main()
