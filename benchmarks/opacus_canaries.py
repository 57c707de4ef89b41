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
Each score is audited alone (:func:`~fedlap_privacy.audit.score_audit.audit_canary_scores`,
95%: Steinke's bound, the f-DP bound and the claim-curve test sharing it); the table gives,
over the seeds, the largest valid bound (mean, min-max), the claim-curve p-value (median)
and how many seeds found a violation.

    python benchmarks/opacus_canaries.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections import defaultdict

import torch
from torch import nn

from fedlap_privacy.audit import GradientCanaries, opacus_canaries
from fedlap_privacy.audit.score_audit import ClaimedMechanism, audit_canary_scores

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
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
