"""FedAvg, DP-FedAvg and DP-FedProx: local (DP-)SGD and weighted averaging (SPEC 3).

Local training draws ``local_steps`` Poisson batches at rate B/N_k. DP variants release
each step's gradient through :func:`fedlap_privacy.fl.dp.dp_gradient` (record-level DP-SGD,
accounted with the same two-rate composition as FedLAP-DP, T = local steps). FedProx adds
the gradient mu (w - w_g) of (mu/2)||w - w_g||^2, which does not touch data
(post-processing). The server averages the clients' weights with weights N_k / N.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.dp import dp_gradient, poisson_sample
from fedlap_privacy.fl.trust_region import clone_params

__all__ = ["average_weights", "local_training"]


def local_training(
    global_model: nn.Module,
    x: Tensor,
    y: Tensor,
    cfg: TrainConfig,
    lr: float,
    generator: torch.Generator,
) -> tuple[dict[str, Tensor], int]:
    """Run the client's local steps from w_g; returns its weights and the accesses made."""
    model = copy.deepcopy(global_model)
    params = list(model.parameters())
    anchor = clone_params(global_model)
    rate = cfg.batch_size / x.shape[0]
    mu = cfg.prox_mu if cfg.method == "dp-fedprox" else 0.0
    for _ in range(cfg.local_steps):
        batch = poisson_sample(x.shape[0], rate, generator).to(x.device)
        if cfg.private:
            assert cfg.sigma is not None
            grads = dp_gradient(
                model, x[batch], y[batch], cfg.clip, cfg.sigma, cfg.batch_size, generator
            )
        elif batch.numel() == 0:
            continue
        else:
            loss = F.cross_entropy(model(x[batch]), y[batch])
            grads = list(torch.autograd.grad(loss, params))
        with torch.no_grad():
            for p, g, a in zip(params, grads, anchor, strict=True):
                p.sub_(lr * (g + mu * (p - a)))
    return {k: v.detach() for k, v in model.state_dict().items()}, cfg.local_steps


def average_weights(states: list[dict[str, Tensor]], weights: list[float]) -> dict[str, Tensor]:
    """sum_k (N_k / N) w_k over the participating clients (weights renormalised to 1)."""
    total = sum(weights)
    return {
        key: sum(s[key] * (w / total) for s, w in zip(states, weights, strict=True))
        for key in states[0]
    }
