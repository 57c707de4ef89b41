"""Flattened-weight distances and the trust-region projection (docs/algorithms.md)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["clone_params", "distance", "project_to_ball"]


def clone_params(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def distance(model: nn.Module, anchor: list[Tensor]) -> float:
    """||w - w_anchor||_2 over all parameters flattened (the norm of the per-tensor norms)."""
    with torch.no_grad():
        diffs = torch._foreach_sub([p.detach() for p in model.parameters()], anchor)
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(diffs))))


def project_to_ball(model: nn.Module, anchor: list[Tensor], radius: float) -> bool:
    """If w left the ball of ``radius`` around the anchor, pull it back onto the sphere.

    Returns True when the radius was reached (the caller stops stepping), so neither the
    client nor the server ever ends a step past the trust region.
    """
    dist = distance(model, anchor)
    if dist < radius:
        return False
    scale = radius / dist
    with torch.no_grad():
        for p, a in zip(model.parameters(), anchor, strict=True):
            p.copy_(a + (p - a) * scale)
    return True
