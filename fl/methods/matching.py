"""The gradient-matching distance L_dis of FedLAP-DP (Eq. 9-10; docs/algorithms.md).

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

__all__ = ["MatchTarget", "layer_distance", "match_distance"]

_EPS = 1e-6


def _rows(g: Tensor) -> Tensor:
    """``(out, rest)`` view of a gradient; a 0-D or 1-D tensor is one row
    (docs/algorithms.md#matching-distance)."""
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


class MatchTarget:
    """The real-gradient side of L_dis (Eq. 9-10), prepared once per real batch.

    FedLAP-DP (Wang et al., PoPETs 2024, Algorithm 3) matches the same DP real gradient
    R_s times per real batch. Everything that depends on it alone is computed here once: the
    rows of every included layer flattened into one vector, their norms, each row's weight
    ``1 / rows_l`` (0 for a layer whose real gradient is identically zero). :meth:`distance`
    then evaluates all layers at once: two segment sums (``index_add``) for the row dot
    products and the synthetic row norms, instead of a dozen small operations per layer.
    The value equals :func:`layer_distance` summed over the layers up to rounding.

    ``include`` (one flag per layer) leaves layers out; :meth:`distance` takes the synthetic
    gradients of the INCLUDED layers only, in order (:attr:`included` lists their indices),
    so the caller need not differentiate the others.
    """

    def __init__(
        self,
        g_real: Sequence[Tensor],
        mse_weight: float = 0.0,
        *,
        include: Sequence[bool] | None = None,
    ) -> None:
        if include is not None and len(include) != len(g_real):
            raise ConfigError(f"include has {len(include)} flags for {len(g_real)} layers")
        if not g_real:
            raise ConfigError("match_distance needs at least one layer")
        self.included = [i for i in range(len(g_real)) if include is None or include[i]]
        self.shapes = [g_real[i].shape for i in self.included]
        self.mse_weight = mse_weight
        rows = [_rows(g_real[i].detach()) for i in self.included]
        if not rows:
            self.flat = None
            return
        reference = rows[0]
        self.flat = torch.cat([r.reshape(-1) for r in rows])
        counts = torch.tensor([r.shape[0] for r in rows], device=reference.device)
        lengths = torch.tensor([r.shape[1] for r in rows], device=reference.device)
        # row id of every flattened coordinate
        row_lengths = lengths.repeat_interleave(counts)
        self.row_of = torch.arange(int(counts.sum()), device=reference.device).repeat_interleave(
            row_lengths)
        self.norm_real = torch.cat([torch.linalg.vector_norm(r, dim=1) for r in rows])
        # mean over a layer's rows; a layer whose real gradient is all zero adds nothing
        weights = [r.ne(0).any().to(r.dtype) / r.shape[0] for r in rows]
        self.row_weight = torch.cat([w.expand(r.shape[0]) for w, r in zip(weights, rows,
                                                                           strict=True)])

    def distance(self, g_syn: Sequence[Tensor]) -> Tensor:
        """L_dis between the prepared real gradient and ``g_syn`` (the included layers)."""
        b = self._flat_syn(g_syn)
        if self.flat is None:
            return b.new_zeros(())
        dot, norm_syn = self._row_sums(b)
        cosine = dot / (self.norm_real * norm_syn + _EPS)
        total = ((1.0 - cosine) * self.row_weight).sum()
        if self.mse_weight != 0.0:
            total = total + self.mse_weight * (self.flat - b).square().sum()
        return total

    def gradient(self, g_syn: Sequence[Tensor]) -> list[Tensor]:
        """dL_dis/dg_syn for the included layers, in closed form (the gradient of
        :meth:`distance`, without autograd).

        Per row r with real part ``a``, synthetic part ``b``, ``den = |a| |b| + 1e-6`` and
        weight ``w_r``: ``-w_r (a / den - <a, b> |a| b / (|b| den^2))``, plus
        ``-2 lambda (a - b)`` for the MSE term. A synthetic row of norm 0 takes only the
        first term (the cosine's derivative along ``b`` is undefined there).
        """
        b = self._flat_syn(g_syn)
        if self.flat is None:
            return [torch.zeros_like(g) for g in g_syn]
        flat = self._gradient_flat(b)
        return [part.view(shape) for part, shape in
                zip(flat.split([s.numel() for s in self.shapes]), self.shapes, strict=True)]

    def _gradient_flat(self, b: Tensor) -> Tensor:
        """:meth:`gradient` of the flat synthetic vector ``b``, as one flat vector."""
        dot, norm_syn = self._row_sums(b)
        den = self.norm_real * norm_syn + _EPS
        along_a = self.row_weight / den
        along_b = torch.where(norm_syn > 0, self.row_weight * dot * self.norm_real
                              / (norm_syn * den * den), 0.0)
        flat = along_b[self.row_of] * b - along_a[self.row_of] * self.flat
        if self.mse_weight != 0.0:
            flat = flat - 2.0 * self.mse_weight * (self.flat - b)
        return flat

    def _row_sums(self, b: Tensor) -> tuple[Tensor, Tensor]:
        """Per row: the dot product with the real gradient and the synthetic norm."""
        assert self.flat is not None
        zeros = b.new_zeros(self.norm_real.shape[0])
        dot = zeros.index_add(0, self.row_of, self.flat * b)
        square = zeros.index_add(0, self.row_of, b * b)
        # sqrt's derivative is infinite at 0: a synthetic row of norm 0 (a ReLU unit no
        # synthetic record activates, common in MLPs) would turn autograd's gradient into
        # NaN. Such a row's norm is 0 with derivative 0, as in :meth:`gradient`.
        nonzero = square > 0
        return dot, torch.where(nonzero, square, 1.0).sqrt() * nonzero

    def _flat_syn(self, g_syn: Sequence[Tensor]) -> Tensor:
        """The included synthetic gradients, checked against the real ones, as one vector."""
        if len(g_syn) != len(self.shapes):
            raise ConfigError(f"{len(self.shapes)} real gradients but {len(g_syn)} synthetic "
                              "ones")
        for real_shape, syn in zip(self.shapes, g_syn, strict=True):
            if real_shape != syn.shape:
                raise ConfigError(
                    f"real and synthetic gradients differ in shape: {tuple(real_shape)} vs "
                    f"{tuple(syn.shape)}"
                )
        return torch.cat([g.reshape(-1) for g in g_syn]) if g_syn else torch.zeros(0)


def match_distance(
    g_real: Sequence[Tensor],
    g_syn: Sequence[Tensor],
    mse_weight: float = 0.0,
    *,
    include: Sequence[bool] | None = None,
) -> Tensor:
    """L_dis (docs/algorithms.md#matching-distance): sum of :func:`layer_distance` over layers,
    plus the MSE term.

    Layers whose real gradient is identically zero are skipped (without a host sync: their
    term is weighted by zero, not branched on); ``include`` (one flag per layer) leaves out
    more. The MSE term ``mse_weight * sum ||g_real - g_syn||^2`` runs over all included
    layers, and is computed only when ``mse_weight != 0``. Returns a scalar tensor. To match
    one real gradient several times, build a :class:`MatchTarget` once instead.
    """
    if len(g_real) != len(g_syn):
        raise ConfigError(f"{len(g_real)} real gradients but {len(g_syn)} synthetic ones")
    target = MatchTarget(g_real, mse_weight, include=include)
    return target.distance([g_syn[i] for i in target.included])
