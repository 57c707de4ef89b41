"""FedSGD (McMahan et al. 2017, the B = infinity, E = 1 case of FedAvg;
docs/algorithms.md#fedsgd).

Each selected client computes ONE gradient per round: the gradient at w_g of its mean
cross-entropy over ALL its N_k local records (full batch, evaluated in chunks so memory stays
bounded; the chunks' summed losses are divided by N_k, so the result is the exact full-batch
gradient). The server takes one gradient step with the N_k / N weighted average of the
gradients (N over the replying clients)::

    w_g <- w_g - lr * sum_k (N_k / N) g_k

which is exactly one full-batch gradient-descent step on the union of the clients' data.

Privacy: none (notion "none"); one access to the client's data per round.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlap_privacy.fl.methods.interface import Method, Reply, RoundInfo, State, weights_of

__all__ = ["FedSGD", "full_gradient"]

#: records per forward pass when forming the full-batch gradient
CHUNK = 1024


def full_gradient(model: nn.Module, x: Tensor, y: Tensor, chunk: int = CHUNK) -> dict[str, Tensor]:
    """grad_w (1/N) sum_i CE(model(x_i), y_i) at the model's weights, parameter name -> tensor.

    Chunked: each chunk's summed loss is back-propagated and the gradients accumulated, then
    divided by N. Does not modify ``model`` (its ``.grad`` fields are not touched).
    """
    named = [(n, p) for n, p in model.named_parameters()]
    params = [p for _, p in named]
    total = [torch.zeros_like(p) for p in params]
    n = x.shape[0]
    for start in range(0, n, chunk):
        loss = F.cross_entropy(model(x[start : start + chunk]), y[start : start + chunk],
                               reduction="sum")
        grads = torch.autograd.grad(loss, params)
        for acc, g in zip(total, grads, strict=True):
            acc.add_(g)
    return {name: acc / n for (name, _), acc in zip(named, total, strict=True)}


class FedSGD(Method):
    """FedSGD: clients upload one full-batch gradient, the server takes one SGD step."""

    def client(
        self, model: nn.Module, x: Tensor, y: Tensor, state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> Reply:
        """g_k = full-batch gradient at w_g over all N_k records; one access."""
        return Reply(full_gradient(model, x, y), 1, len(y))

    def aggregate(
        self, model: nn.Module, replies: list[Reply], server_state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> dict[str, Any]:
        """w_g -= lr sum_k (N_k / N) g_k (weights renormalised over the repliers)."""
        weights = weights_of(replies)
        with torch.no_grad():
            for name, p in model.named_parameters():
                g = sum(w * r.payload[name] for r, w in zip(replies, weights, strict=True))
                p.sub_(info.lr * g)
        return {}
