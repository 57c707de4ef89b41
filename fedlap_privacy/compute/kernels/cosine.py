"""The gradient of gradient matching's row-wise cosine distance in one C call
(``cosine_rows.c``; FedLAP-DP Eq. 9-10, docs/algorithms.md#matching-distance).

:func:`cosine_rows_grad` is what :meth:`fedlap_privacy.fl.methods.matching.MatchTarget.gradient`
computes with a dozen torch operations (two segment sums, gathers, the arithmetic), in two
passes over each row. The torch version is its oracle in the tests.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedlap_privacy.compute.kernels.block import run_split

__all__ = ["cosine_rows_grad"]


def cosine_rows_grad(a: Tensor, b: Tensor, start: Tensor, norm_a: Tensor, weight: Tensor,
                     eps: float, mse: float) -> Tensor:
    """dD/db for ``D = sum_r weight_r (1 - <a_r, b_r> / (norm_a_r |b_r| + eps)) +
    mse |a - b|^2``, rows ``r = [start[r], start[r + 1])`` of the flat vectors ``a`` and
    ``b``; ``norm_a`` holds the rows' norms of ``a``. Call where :func:`fusable` holds for
    the four float tensors (:func:`~fedlap_privacy.compute.kernels.block.fusable`)."""
    a, b = a.contiguous(), b.detach().contiguous()
    start, norm_a, weight = (start.to(torch.int64).contiguous(), norm_a.contiguous(),
                             weight.contiguous())
    grad = torch.empty_like(b)
    run_split("cosine_rows_grad", b.dtype, norm_a.shape[0], b.numel(),
              (a.data_ptr(), b.data_ptr(), start.data_ptr(), norm_a.data_ptr(),
               weight.data_ptr(), float(eps), float(mse)), (grad.data_ptr(),))
    return grad

