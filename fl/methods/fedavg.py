"""FedAvg, FedProx and their record-level DP versions: local (DP-)SGD, weighted averaging.

Local training draws ``steps`` Poisson batches at rate B/N_k. DP variants release each
step's gradient through :func:`fedlap_privacy.fl.methods.dp.dp_gradient` (record-level DP-SGD,
accounted with the same two-rate composition as FedLAP-DP, T = local steps;
docs/algorithms.md#dp-fedavg-and-dp-fedprox).
FedProx adds the gradient mu (w - w_g) of (mu/2)||w - w_g||^2 to the local loss's, which does
not touch data (post-processing). The server averages the clients' weights with weights
N_k / N. :func:`local_training` is shared by SCAFFOLD (gradient correction), ALI-DPFL
(per-step gradients observed) and DP-NormFedAvg (its local phase).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.cohort import ClientBatches, cohort_local_sgd
from fedlap_privacy.fl.engine.progress import report_step
from fedlap_privacy.fl.methods.dp import batch_rate, dp_gradient, poisson_sample
from fedlap_privacy.fl.methods.interface import Method, Reply, RoundInfo, State, weights_of
from fedlap_privacy.fl.methods.trust_region import clone_params

__all__ = ["LocalSGD", "average_weights", "local_training"]

#: called after each step's gradient is formed: (step, gradient, parameters before the step)
StepHook = Callable[[int, list[Tensor], list[Tensor]], None]


def local_training(
    global_model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    steps: int,
    lr: float,
    batch_size: float,
    generator: torch.Generator,
    dp: tuple[float, float] | None = None,
    mu: float = 0.0,
    correction: list[Tensor] | None = None,
    on_step: StepHook | None = None,
) -> tuple[nn.Module, int]:
    """Run ``steps`` local SGD steps from w_g; returns the trained copy and the accesses made.

    Each step samples a Poisson batch at rate ``batch_size / N_k`` (one access; without
    ``dp`` at most 1, so a client of fewer than B records takes all of them each step:
    :func:`~fedlap_privacy.fl.methods.dp.batch_rate`). With
    ``dp = (clip, sigma)`` the step's gradient is the DP gradient
    (docs/accounting.md#sampled-gaussian-mechanism) — an empty batch
    still releases noise; without, an empty batch skips the step. The update is
    ``w -= lr (g + mu (w - w_g) + correction)`` (FedProx's proximal gradient, SCAFFOLD's
    c - c_k), both data-independent given g.
    """
    model = copy.deepcopy(global_model)
    params = list(model.parameters())
    anchor = clone_params(global_model)
    rate = batch_rate(batch_size, x.shape[0], accounted=dp is not None)
    for step in range(steps):
        batch = poisson_sample(x.shape[0], rate, generator).to(x.device)
        if dp is not None:
            clip, sigma = dp
            grads = dp_gradient(model, x[batch], y[batch], clip, sigma, batch_size, generator)
        elif batch.numel() == 0:
            continue
        else:
            loss = F.cross_entropy(model(x[batch]), y[batch])
            grads = list(torch.autograd.grad(loss, params))
        if on_step is not None:
            on_step(step, grads, params)
        with torch.no_grad():
            for i, (p, g, a) in enumerate(zip(params, grads, anchor, strict=True)):
                d = g + mu * (p - a) if mu else g
                if correction is not None:
                    d = d + correction[i]
                p.sub_(lr * d)
        report_step(step + 1, steps)
    return model, steps


def state_of(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def average_weights(states: list[dict[str, Tensor]], weights: list[float]) -> dict[str, Tensor]:
    """sum_k (N_k / N) w_k over the participating clients (weights renormalised to 1)."""
    total = sum(weights)
    return {
        key: sum(s[key] * (w / total) for s, w in zip(states, weights, strict=True))
        for key in states[0]
    }


class LocalSGD(Method):
    """FedAvg, FedProx, DP-FedAvg, DP-FedProx: upload the locally trained weights."""

    def client(
        self, model: nn.Module, x: Tensor, y: Tensor, state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> Reply:
        cfg = self.cfg
        trained, used = local_training(
            model, x, y, steps=cfg.local_steps, lr=info.lr, batch_size=cfg.batch_size,
            generator=generator, dp=(cfg.clip, cfg.sigma) if cfg.private else None,  # type: ignore[arg-type]
            mu=cfg.prox_mu if cfg.spec.proximal else 0.0,
        )
        return Reply(state_of(trained), used, len(y))

    def probe_config(self) -> tuple[TrainConfig, int]:
        """One local step."""
        return dataclasses.replace(self.cfg, local_steps=1), 1

    def vectorises(self) -> bool:
        """FedAvg and FedProx; not the record-level DP variants, whose steps draw noise from
        the same generator between the batches (the loop keeps that order)."""
        return not self.cfg.private

    def cohort_client(
        self, model: nn.Module, x: Tensor, y: Tensor, indices: list[Tensor], info: RoundInfo,
        generators: list[torch.Generator],
        *,
        packed: bool = False,
    ) -> list[Reply]:
        """FedAvg's and FedProx's local SGD vectorised over the cohort
        (:func:`~fedlap_privacy.fl.engine.cohort.cohort_local_sgd`)."""
        cfg = self.cfg
        clients = [ClientBatches.draw(index, cfg.local_steps, cfg.batch_size, generator)
                   for index, generator in zip(indices, generators, strict=True)]
        states = cohort_local_sgd(model, x, y, clients, lr=info.lr,
                                  mu=cfg.prox_mu if cfg.spec.proximal else 0.0, packed=packed)
        return [Reply(state, cfg.local_steps, int(index.numel()))
                for state, index in zip(states, indices, strict=True)]

    def aggregate(
        self, model: nn.Module, replies: list[Reply], server_state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> dict[str, Any]:
        model.load_state_dict(average_weights([r.payload for r in replies], weights_of(replies)))
        return {}
