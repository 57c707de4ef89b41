"""ALI-DPFL: record-level DP-FedAvg with adaptive local iterations (docs/algorithms.md#ali-dpfl).

Ling, Fu, Wang, Liu, Chen, "ALI-DPFL: Differentially private federated learning with adaptive
local iterations" (2024). Clients run ``tau`` local DP-SGD iterations (each one access to
private data, docs/accounting.md#sampled-gaussian-mechanism); the server averages the
weights as FedAvg (N_k / N) and recomputes
``tau`` every round with the authors' rule (:func:`ali_tau`) under two budgets:

* the privacy budget ``Rc``: the largest number of DP-SGD iterations ``n`` such that ``n``
  sampled-Gaussian steps at the rate ``q2 = B / min_k N_k`` stay within
  ``(target_eps, delta)`` (:func:`fedlap_privacy.accountant.plan_rounds` on the run's
  schedule with one step per "round" and client fraction 1, with the run's accountant: PLD
  by default, which admits more iterations than RDP for the same budget, e.g. 3,353 instead
  of 2,906 at B 256, N_k 10,000, sigma 1, epsilon 10; planned once per run in under a second,
  and each round's target check and ledger entry, composing every distinct tau, cost tens of
  milliseconds: ``benchmarks/speed/accountant.py``). This is conservative: a round of
  ``tau`` iterations is accounted (docs/accounting.md#theorem-58) as one step at ``q1 <= q2`` and
  ``tau - 1`` at ``q2``, and the sampled Gaussian's privacy loss grows with the rate, so any
  split of ``<= Rc`` iterations into rounds costs no more than ``Rc`` steps at ``q2``.
  Training stops (:meth:`ALIDPFL.stop_reason`) before the total would exceed ``Rc``; the
  driver's own target-epsilon check on the exact ledger stays in force too;
* the number of rounds ``Rs = cfg.rounds``; ``T = min(Rs * tau_prev, Rc)`` enters the rule.

Privacy accounting: each round enters the ledger with ITS tau as accounted T
(:meth:`ALIDPFL.accounted_steps`); the ledger composes the per-round schedules exactly
(adaptive composition of RDP / PLD). tau depends only on released (noisy) quantities, so
choosing it adaptively is allowed.

The rule needs mu (a strong-convexity estimate, mean over clients of
``||grad F_i(w_i) - grad F_i(w_g)|| / ||w_i - w_g||``) and
``Gamma = |sum_i p_i (F_i(w_i) - F_i(w_g))|``. The authors compute them from extra gradient
and loss evaluations on the clients' private data; those reads are NOT covered by the DP-SGD
accounting. We chose not to touch private data for them: every quantity below is
POST-PROCESSING of the DP gradients the client already released during its tau iterations,
so it is free and every access to private data stays counted. With ``noise_sq =
d (sigma C / Bhat)^2`` the expected squared norm of one step's Gaussian noise (d parameters,
Bhat = B the expected batch size), g_t the DP gradient of step t at weights w_t (w_0 = w_g):

* ``mu_i = sqrt(max(||g_last - g_first||^2 - 2 noise_sq, 0)) / ||w_last - w_g||`` with g_first
  the DP gradient at w_g and g_last the one at w_last, the weights of the last step (the two
  noises are independent, hence 2 noise_sq); unavailable when tau = 1 or w_last = w_g;
* ``Gamma_i = lr * sum_t max(||g_t||^2 - noise_sq, 0)``, the first-order estimate of
  ``F_i(w_g) - F_i(w_i)`` along the SGD path (each step lowers the loss by about
  lr ||grad F(w_t)||^2).

These are biased, noisy estimates (clipping, sampling noise); they change only tau, never the
privacy accounting.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor, nn

from fedlap_privacy.accountant import plan_rounds
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.methods.fedavg import average_weights, local_training, state_of
from fedlap_privacy.fl.methods.interface import Method, Reply, RoundInfo, State, weights_of
from fedlap_privacy.state.ledger import PrivacyLedger

__all__ = ["ALIDPFL", "ali_tau", "ali_tau_value", "privacy_iterations"]


def ali_tau_value(
    mu: float, gamma: float, T: float, clip: float, sigma: float, d: int, bhat: float
) -> float:
    """The unrounded tau* of ALI-DPFL's rule (docs/algorithms.md#ali-dpfl, Ling et al. 2024)::

        sqrt( 1 + (4/mu^2 + 3 C^2 + 2 Gamma T mu + sigma^2 C^2 d / Bhat^2)
                  / ((2 + 2/T) (C^2 + sigma^2 C^2 d / Bhat^2)) )

    Limits: ``mu -> 0`` makes 4/mu^2 infinite, so ``mu <= 0`` returns ``inf``; ``mu = inf``
    gives ``inf`` when ``Gamma > 0`` (2 Gamma T mu) and drops 4/mu^2 (-> 0) and
    2 Gamma T mu (Gamma = 0 exactly) otherwise. NaN inputs or a non-positive T, C, d, Bhat,
    a negative sigma or Gamma are errors.
    """
    values = (mu, gamma, T, clip, sigma, d, bhat)
    if any(math.isnan(float(v)) for v in values):
        raise ConfigError(f"ali_tau: NaN among its inputs {values}")
    if not (T >= 1 and clip > 0 and d >= 1 and bhat > 0 and sigma >= 0 and gamma >= 0):
        raise ConfigError(f"ali_tau: inputs out of range (T>=1, C>0, d>=1, Bhat>0, sigma>=0, "
                          f"Gamma>=0): {values}")
    if mu <= 0:
        return math.inf
    noise = sigma**2 * clip**2 * d / bhat**2
    inverse = 0.0 if math.isinf(mu) else 4.0 / mu**2
    drift = 0.0 if gamma == 0 else 2.0 * gamma * T * mu
    numerator = inverse + 3.0 * clip**2 + drift + noise
    denominator = (2.0 + 2.0 / T) * (clip**2 + noise)
    return math.sqrt(1.0 + numerator / denominator)


def ali_tau(
    mu: float, gamma: float, T: float, clip: float, sigma: float, d: int, bhat: float,
    tau_max: int = 100,
) -> int:
    """ALI-DPFL's tau: :func:`ali_tau_value` rounded half up, clamped to [1, tau_max]
    (docs/algorithms.md#ali-dpfl).

    ``mu -> 0`` (or an infinite value of the rule) gives ``tau_max``. (Half-up rounding:
    ties have probability zero for estimated inputs.)
    """
    if tau_max < 1:
        raise ConfigError(f"tau_max {tau_max} must be >= 1")
    value = ali_tau_value(mu, gamma, T, clip, sigma, d, bhat)
    if math.isinf(value):
        return int(tau_max)
    return int(min(max(math.floor(value + 0.5), 1), tau_max))


def privacy_iterations(ledger: PrivacyLedger, target_eps: float) -> int:
    """Rc: the largest n such that n sampled-Gaussian steps at ``q2`` stay within
    ``(target_eps, delta)`` (module docstring: conservative for any split into rounds)."""
    if ledger.schedule is None or ledger.sigma is None or ledger.delta is None:
        raise ConfigError("ALI-DPFL needs a record-level ledger")
    one_step = dataclasses.replace(ledger.schedule, local_steps=1, client_fraction=1.0)
    return plan_rounds(one_step, ledger.sigma, target_eps, ledger.delta, ledger.accountant)


def _flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


class ALIDPFL(Method):
    """ALI-DPFL (docs/algorithms.md#ali-dpfl): DP-FedAvg whose local iteration count tau
    the server adapts.

    Server state (plain values): ``tau`` (this round's, starts at ``cfg.local_steps``),
    ``total`` (iterations of the rounds aggregated so far), ``rc`` (the privacy budget in
    iterations), ``taus`` (tau of every aggregated round), ``d`` (parameters), ``bhat`` (B).
    The stop rule counts the iterations the LEDGER has accounted (it also holds interrupted
    rounds and rounds in which no client was selected), never fewer than ``total``.
    """

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self._ledger: PrivacyLedger | None = None

    def init_server_state(self, model: nn.Module, ledger: PrivacyLedger) -> State:
        cfg = self.cfg
        cfg.spec.check(cfg)  # the method table's rule: a budget and a fixed sigma
        assert cfg.target_eps is not None
        self._ledger = ledger
        return {
            "tau": int(cfg.local_steps),
            "total": 0,
            "rc": privacy_iterations(ledger, cfg.target_eps),
            "taus": [],
            "d": sum(p.numel() for p in model.parameters()),
            "bhat": float(cfg.batch_size),
        }

    def extras(self, server_state: State) -> dict[str, Any]:
        return {"tau": int(server_state["tau"])}

    def accounted_steps(self, server_state: State) -> int:
        return int(server_state["tau"])

    def _spent(self, server_state: State) -> int:
        spent = int(server_state["total"])
        if self._ledger is not None:
            spent = max(spent, sum(e.local_steps or 0 for e in self._ledger.entries))
        return spent

    def stop_reason(self, server_state: State) -> str | None:
        tau, rc = int(server_state["tau"]), int(server_state["rc"])
        spent = self._spent(server_state)
        if spent + tau > rc:
            return (f"ALI-DPFL privacy budget Rc = {rc} local iterations would be exceeded "
                    f"({spent} spent + tau {tau})")
        return None

    def client(
        self, model: nn.Module, x: Tensor, y: Tensor, state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> Reply:
        cfg = self.cfg
        tau = int(info.extras["tau"])
        assert cfg.sigma is not None
        d = sum(p.numel() for p in model.parameters())
        noise_sq = d * (cfg.sigma * cfg.clip / cfg.batch_size) ** 2
        seen: dict[str, Any] = {"signal": 0.0}

        def observe(step: int, grads: list[Tensor], params: list[Tensor]) -> None:
            g = _flat(grads)  # the released DP gradient: post-processing from here on
            seen["signal"] += max(float(g.square().sum()) - noise_sq, 0.0)
            if step == 0:
                seen["first"] = g
            if step == tau - 1:
                seen["last"], seen["w_last"] = g, _flat(params)

        trained, used = local_training(
            model, x, y, steps=tau, lr=info.lr, batch_size=cfg.batch_size,
            generator=generator, dp=(cfg.clip, cfg.sigma), on_step=observe,
        )
        stats = {"gamma": info.lr * seen["signal"]}
        if tau > 1:
            moved = float((seen["w_last"] - _flat(list(model.parameters()))).norm())
            if moved > 0:
                change = float((seen["last"] - seen["first"]).square().sum())
                stats["mu"] = math.sqrt(max(change - 2.0 * noise_sq, 0.0)) / moved
        return Reply(state_of(trained), used, len(y), stats)

    def aggregate(
        self, model: nn.Module, replies: list[Reply], server_state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> dict[str, Any]:
        cfg = self.cfg
        assert cfg.sigma is not None
        p = weights_of(replies)
        model.load_state_dict(average_weights([r.payload for r in replies], p))
        tau = int(server_state["tau"])
        gamma = abs(sum(w * r.stats["gamma"] for w, r in zip(p, replies, strict=True)))
        with_mu = [(w, r.stats["mu"]) for w, r in zip(p, replies, strict=True) if "mu" in r.stats]
        mu = (sum(w * m for w, m in with_mu) / sum(w for w, _ in with_mu)) if with_mu else None
        server_state["total"] = int(server_state["total"]) + tau
        server_state["taus"] = [*server_state["taus"], tau]
        T = max(min(cfg.rounds * tau, int(server_state["rc"])), 1)
        # mu == 0: every client's signal was below the noise floor — no usable estimate (the
        # rule's limit mu -> 0 would jump to tau_max on noise alone); keep tau as without one.
        if mu is not None and mu > 0:
            server_state["tau"] = ali_tau(
                mu, gamma, T, cfg.clip, cfg.sigma, int(server_state["d"]),
                float(server_state["bhat"]), cfg.tau_max,
            )
        return {"tau": tau, "next_tau": int(server_state["tau"]), "mu": mu, "gamma": gamma}
