"""Route the callers of one C kernel to its torch twin, for a benchmark that measures what
that kernel alone buys (``fedlap_round.py --without gn-relu-pool``, say).

The ``kernels`` fast path (:mod:`fedlap_privacy.compute.fast_paths`) switches every C kernel
off at once, and with them the written-out matching step, the fused per-record gradients and
Winograd's convolutions, which run on them. :func:`route_to_twin` leaves all of those on and
replaces one kernel's entry points, in the modules that call them, by torch's operations
computing the same function. ``gn-relu-pool``: the GroupNorm -> ReLU -> 2x2 pooling
block's forward, backward (with each plane's GroupNorm weight and bias gradients) and double
backward (``fedlap_privacy.compute.kernels.block``): the forward and backward through
torch's GroupNorm kernels, the double backward by autograd through that backward.
(``winograd.c``'s twin is the ``winograd`` fast path itself.) The ``few-channels``,
``conv-gram`` and ``cosine-rows`` kernels measured this way bought less than 1.3x and were
removed (docs/performance.md, Tried and not kept).

Benchmark code only: the package never calls this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

KERNELS = ("gn-relu-pool",)


def block_forward(z: Tensor, weight: Tensor, bias: Tensor, eps: float
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, mean, rstd)`` of the block through torch's GroupNorm kernel."""
    n, c, h, w = z.shape
    y, mean, rstd = torch.ops.aten.native_group_norm(
        z.detach(), weight.detach(), bias.detach(), n, c, h * w, c, eps)
    return F.avg_pool2d(F.relu(y), 2), mean, rstd


def block_backward(z: Tensor, gp: Tensor, weight: Tensor, bias: Tensor, mean: Tensor,
                   rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(gz, sgx, sgy)`` as :func:`fedlap_privacy.compute.kernels.block.block_backward`."""
    z, gp, weight, bias = z.detach(), gp.detach(), weight.detach(), bias.detach()
    n, c, h, w = z.shape
    xhat = (z - mean[:, :, None, None]) * rstd[:, :, None, None]
    a = xhat * weight.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)
    gy = torch.ops.aten.avg_pool2d_backward(gp, a, [2, 2], [2, 2], [0, 0], False, True, None)
    ga = torch.ops.aten.threshold_backward(gy, a, 0)
    sgy, sgx = ga.sum((2, 3)), (ga * xhat).sum((2, 3))
    gz = torch.ops.aten.native_group_norm_backward(
        ga, z, mean, rstd, weight, n, c, h * w, c, [True, False, False])[0]
    return gz, sgx, sgy


def block_double_backward(z: Tensor, gp: Tensor, weight: Tensor, bias: Tensor, mean: Tensor,
                          rstd: Tensor, u: Tensor, ug: Tensor, ub: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """``(dz, dgp, dgamma)`` as :func:`fedlap_privacy.compute.kernels.block.block_double_backward`,
    by autograd through the block's backward written in torch's operations."""
    n, c, h, w = z.shape
    with torch.enable_grad():
        zz = z.detach().requires_grad_()
        gpp = gp.detach().requires_grad_()
        gam = weight.detach().view(1, c).expand(n, c).clone().requires_grad_()
        var, mu = torch.var_mean(zz, dim=(2, 3), correction=0)
        rs = (var + _eps(rstd, var)).rsqrt()[:, :, None, None]
        xhat = (zz - mu[:, :, None, None]) * rs
        a = xhat.detach() * gam[:, :, None, None] + bias.detach().view(1, c, 1, 1)
        gy = F.interpolate(gpp, scale_factor=2.0, mode="nearest") / 4
        if gy.shape[2:] != z.shape[2:]:
            gy = F.pad(gy, (0, w - gy.shape[3], 0, h - gy.shape[2]))
        ga = gy * (a.detach() > 0)
        sgy = ga.sum((2, 3))
        sgx = (ga * xhat).sum((2, 3))
        gxhat = ga * gam[:, :, None, None]
        gz = (gxhat - gxhat.mean((2, 3), keepdim=True)
              - xhat * (gxhat * xhat).mean((2, 3), keepdim=True)) * rs
        loss = (u * gz).sum() + (ug.view(1, c) * sgx).sum() + (ub.view(1, c) * sgy).sum()
        dz, dgp, dgam = torch.autograd.grad(loss, (zz, gpp, gam))
    return dz, dgp, dgam


def _eps(rstd: Tensor, var: Tensor) -> Tensor:
    """The GroupNorm's epsilon, recovered from the saved statistics: 1/rstd^2 - var."""
    return rstd.detach().square().reciprocal() - var.detach()


def route_to_twin(kernel: str) -> None:
    """Make the package call ``kernel``'s torch twin (module docstring) in this process."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; one of {', '.join(KERNELS)}")
    import fedlap_privacy.models as models
    from fedlap_privacy.compute import per_sample, second_order
    from fedlap_privacy.compute.kernels import block
    from fedlap_privacy.fl.engine import packed_cohort

    models.gn_relu_pool = block.reference_block
    packed_cohort.gn_relu_pool = block.reference_block
    for module in (per_sample, second_order):
        module.block_forward = block_forward
        module.block_backward = block_backward
    second_order.block_double_backward = block_double_backward
