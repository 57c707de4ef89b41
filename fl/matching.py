"""The gradient-matching distance L_dis of FedLAP-DP (SPEC 2.1, Eq. 9-10).

For every parameter tensor (layer) l, the real and the synthetic gradient are reshaped to
``(out, rest)`` — a conv weight ``(out, in, kh, kw)`` to ``(out, in * kh * kw)``, a linear
weight stays ``(out, in)``, a 1-D tensor (bias, norm scale) is ONE row — and the layer adds
the MEAN over rows of ``1 - cos(row_real, row_syn)``, with
``cos(a, b) = <a, b> / (||a|| ||b|| + 1e-6)``. Each layer contributes at most 2 (the
authors divide the row sum of Eq. 10 by the number of rows). An optional MSE regulariser adds
``lambda * sum_l ||g_real_l - g_syn_l||^2``.

Layers whose real gradient is identically zero (a conv bias followed by GroupNorm) are
skipped: their cosine is numerical noise. Note that a DP real gradient is never zero — noise
is added to every coordinate — so for DP runs pass ``include`` to leave out the layers known
to have a structurally zero gradient, if they should not be matched against pure noise.

Everything here is differentiable with respect to the synthetic gradients (computed with
``create_graph=True``), so the distance back-propagates to the synthetic images.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fedlap_privacy.errors import ConfigError

__all__ = ["layer_distance", "match_distance"]

_EPS = 1e-6


def _rows(g: Tensor) -> Tensor:
    """``(out, rest)`` view of a gradient; a 0-D or 1-D tensor is one row (SPEC 2.1)."""
    return g.reshape(1, -1) if g.dim() <= 1 else g.reshape(g.shape[0], -1)


def layer_distance(g_real: Tensor, g_syn: Tensor) -> Tensor:
    """Mean over rows of ``1 - cos(row_real, row_syn)`` for one parameter tensor (Eq. 10)."""
    if g_real.shape != g_syn.shape:
        raise ConfigError(
            f"real and synthetic gradients differ in shape: {tuple(g_real.shape)} vs "
            f"{tuple(g_syn.shape)}"
        )
    a, b = _rows(g_real), _rows(g_syn)
    dot = (a * b).sum(dim=1)
    norms = torch.linalg.vector_norm(a, dim=1) * torch.linalg.vector_norm(b, dim=1)
    return (1.0 - dot / (norms + _EPS)).mean()


def match_distance(
    g_real: Sequence[Tensor],
    g_syn: Sequence[Tensor],
    mse_weight: float = 0.0,
    *,
    include: Sequence[bool] | None = None,
) -> Tensor:
    """L_dis of SPEC 2.1: sum of :func:`layer_distance` over layers, plus the MSE term.

    Layers whose real gradient is identically zero are skipped (without a host sync: their
    term is masked, not branched on); ``include`` (one flag per layer) leaves out more. The
    MSE term ``mse_weight * sum ||g_real - g_syn||^2`` runs over all included layers, and is
    computed only when ``mse_weight != 0``. Returns a scalar tensor.
    """
    if len(g_real) != len(g_syn):
        raise ConfigError(f"{len(g_real)} real gradients but {len(g_syn)} synthetic ones")
    if include is not None and len(include) != len(g_real):
        raise ConfigError(f"include has {len(include)} flags for {len(g_real)} layers")
    if not g_real:
        raise ConfigError("match_distance needs at least one layer")
    total = g_syn[0].new_zeros(())
    for i, (real, syn) in enumerate(zip(g_real, g_syn, strict=True)):
        if include is not None and not include[i]:
            continue
        term = layer_distance(real, syn)
        total = total + torch.where(real.ne(0).any(), term, term.new_zeros(()))
        if mse_weight != 0.0:
            total = total + mse_weight * (real - syn).square().sum()
    return total
