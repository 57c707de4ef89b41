"""White-box canaries scored on every round against the final model only.

In federated training the server receives every round's update, and a DP-FedAvg client's
update is minus the local learning rate times the sum of its released noisy gradients, so
the white-box score of a Dirac canary (the sum, over every release of its client, of the
released noisy sum on its weight: ``fedlap_privacy.fl.auditing.canaries``) is the sum of the
per-round alignments of that client's updates with the canary's direction: the optimal statistic for
Gaussian noise. An auditor holding only the final model sees less: the change of the weight
from its (public, seeded) initial value to its final one, which also carries every other
client's noise. This trains one multi-round DP-FedAvg run with white-box canaries on its
weights and audits the same canaries both ways (each statistic alone, 95%, delta of the
run): Steinke, Nasr, Jagielski's bound, the f-DP bound and the claim-curve p-value.

    python benchmarks/audit_power/canary_rounds.py [--rounds 5] [--sigma 0.6] [--noise-scale 1.0]

``--noise-scale`` multiplies the noise actually drawn (below 1: a fault the audit should
find), never the noise the ledger accounts.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch

from fedlap_privacy.audit.bounds.claim_curve import ClaimCurve, ledger_steps
from fedlap_privacy.audit.canaries.canary_audit import run_canary_audits
from fedlap_privacy.data.datasets import load_dataset
from fedlap_privacy.fl.auditing.canaries import flat_weights
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.simulation import train
from fedlap_privacy.fl.methods import dp
from fedlap_privacy.fl.run.run_files import load_private, load_release
from fedlap_privacy.fl.run.user_runs import run_model
from fedlap_privacy.state.canary_state import CanaryState
from fedlap_privacy.state.ledger import PrivacyLedger


def _initial_weights(cfg: TrainConfig) -> torch.Tensor:
    """The run's initial weights, rebuilt from its public seed as training builds them."""
    data = load_dataset(cfg.dataset, cfg.data_dir)
    torch.manual_seed(cfg.seed)
    return flat_weights(run_model(cfg, data.input_shape, data.num_classes).model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sigma", type=float, default=0.6)
    parser.add_argument("--noise-scale", type=float, default=1.0)
    parser.add_argument("--canaries", type=int, default=1000)
    args = parser.parse_args()
    if args.noise_scale != 1.0:
        real = dp.release
        dp.release = lambda t, c, s, b, g: real(t, c, s * args.noise_scale, b, g)
    cfg = TrainConfig(method="dp-fedavg", rounds=args.rounds, local_steps=10, batch_size=16,
                      sigma=args.sigma, canaries=args.canaries)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run"
        result = train(cfg, out)
        state = CanaryState.from_state(load_private(out).canaries)
        release = load_release(out)
        model = release.build_model()
        assert state.coordinates is not None and not state.dedicated
        final = (_initial_weights(cfg) - flat_weights(model))[state.coordinates].double()
        claim, delta = result.summary.privacy.epsilon, cfg.delta
        steps = ledger_steps(PrivacyLedger.replay(release.ledger))
        assert steps is not None
        curve = ClaimCurve.from_steps(steps, delta)  # the curve the audit tests
        print(f"DP-FedAvg, digits, {args.rounds} rounds, sigma {args.sigma} (noise drawn x "
              f"{args.noise_scale}), {args.canaries} canaries, claim {claim:.2f}")
        print("| statistic | Steinke LB | f-DP LB | claim-curve p | verdict |")
        print("|---|---|---|---|---|")
        for name, scores in (("all rounds (per-client updates)", state.scores),
                             ("final model only", final)):
            (audit,) = run_canary_audits(dataclasses.replace(state, scores=scores), None,
                                         claim, delta, curve=curve)
            m = audit.methods()
            print(f"| {name} | {m['steinke']['epsilon_lower_bound']:.2f} | "
                  f"{m['fdp']['epsilon_lower_bound']:.2f} | {m['claim-curve']['p_value']:.2g} "
                  f"| {audit.verdict} |")


if __name__ == "__main__":
    main()
