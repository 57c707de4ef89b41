"""The fused GroupNorm -> ReLU -> 2x2 average pooling block of the ConvNet, with autograd to
second order (docs/algorithms.md#fused-normalisation-block).

``gn_relu_pool(z, weight, bias, eps)`` equals
``F.avg_pool2d(F.relu(F.group_norm(z, C, weight, bias, eps)), 2)`` (one channel per group:
:func:`reference_block`) up to floating-point rounding, through the C kernels of
``gn_relu_pool.c``: one pass over each (n, c) plane for the forward, the backward and the
backward of the backward, where torch's separate kernels make seven to twenty passes over
the block's largest tensor. The gradient-matching step of FedLAP-DP differentiates the
network's weight gradients with respect to the synthetic images, so its backward must be
differentiable itself: :class:`_Block`'s backward is :class:`_BlockBackward`, whose
backward is the C double backward (a third order raises).

Rounding can put a pre-activation on the other side of the ReLU's kink than torch's kernels
do (about one in ten million on random data); that element's gradient then differs by its
full size, as it would between any two correct implementations. Where the kernels cannot be
used (not built, a CUDA or non-float tensor, tracing or export, functorch transforms), the
block runs :func:`reference_block`.

The primitives (:func:`block_forward`, :func:`block_backward`) also serve the ConvNet's
per-record gradients (:mod:`fedlap_privacy.compute.per_sample`): the backward returns each plane's
share of the GroupNorm weight and bias gradients, which are the per-record gradients of
those parameters.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from fedlap_privacy.compute.kernels.library import KernelLibrary, load_kernels

__all__ = [
    "block_backward",
    "block_double_backward",
    "block_forward",
    "fusable",
    "gn_relu_pool",
    "reference_block",
]

_SUFFIX = {torch.float32: "_f32", torch.float64: "_f64"}
# below this many elements per thread, one thread does the whole call (a hand-off to the
# pool costs tens of microseconds)
_MIN_ELEMENTS_PER_THREAD = 1 << 17


def reference_block(z: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """The block with torch's kernels: GroupNorm with one channel per group, ReLU, 2x2 mean."""
    return F.avg_pool2d(F.relu(F.group_norm(z, z.shape[1], weight, bias, eps)), 2)


def _plain(t: Tensor) -> bool:
    """A dense CPU tensor or parameter of its own data (not a functorch wrapper, a fake tensor
    or another subclass)."""
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda _: False)
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
            and t.device.type == "cpu" and not wrapped(t))


def fusable(*tensors: Tensor | None) -> bool:
    """True when the kernels can run on these tensors: dense CPU tensors of one dtype,
    float32 or float64, outside TorchScript, tracing, compilation and export, with the
    kernels loaded (:func:`~fedlap_privacy.compute.kernels.library.load_kernels`)."""
    if not tensors or any(t is None for t in tensors):
        return False
    dtype = tensors[0].dtype
    if dtype not in _SUFFIX or not all(_plain(t) and t.dtype == dtype for t in tensors):
        return False
    if torch.jit.is_scripting() or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    if getattr(torch.compiler, "is_exporting", lambda: False)():
        return False
    return load_kernels() is not None


class _Pool:
    """A thread pool for splitting one call's planes, rebuilt after a fork or a resize."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._key: tuple[int, int] = (0, 0)

    def get(self, workers: int) -> ThreadPoolExecutor:
        with self._lock:
            key = (os.getpid(), workers)
            if self._pool is None or self._key != key:
                if self._pool is not None and self._key[0] == key[0]:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="fedlap-kernels")
                self._key = key
            return self._pool


_POOL = _Pool()


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


def _run(name: str, z: Tensor, head: tuple[object, ...], tail: tuple[object, ...]) -> None:
    """Call kernel ``name`` on every plane of ``z``, split over torch's thread count."""
    run_split(name, z.dtype, z.shape[0] * z.shape[1], z.numel(), head, tail)


def run_split(name: str, dtype: torch.dtype, units: int, elements: int,
              head: tuple[object, ...], tail: tuple[object, ...]) -> None:
    """Call kernel ``name`` as ``name(*head, lo, hi, *tail)`` on units ``[0, units)`` (planes,
    rows) of ``elements`` scalars in all, split over torch's thread count where that pays."""
    library = load_kernels()
    if library is None:  # pragma: no cover - fusable() checked it
        raise RuntimeError("the fused kernels are not loaded")
    fn = _kernel(library, name, dtype)
    parts = min(torch.get_num_threads(), units, max(1, elements // _MIN_ELEMENTS_PER_THREAD))
    bounds = [units * i // parts for i in range(parts + 1)]
    if parts == 1:
        codes = [fn(*head, 0, units, *tail)]
    else:
        pool = _POOL.get(parts - 1)
        futures = [pool.submit(fn, *head, lo, hi, *tail)
                   for lo, hi in itertools.pairwise(bounds[1:])]
        codes = [fn(*head, bounds[0], bounds[1], *tail)] + [f.result() for f in futures]
    if any(code != 0 for code in codes):
        raise MemoryError(f"{name}: out of memory for the kernel's scratch space")


def _kernel(library: KernelLibrary, name: str, dtype: torch.dtype) -> Callable[..., int]:
    return library.function(name, _SUFFIX[dtype])


def _params(weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    return weight.detach().contiguous(), bias.detach().contiguous()


def block_forward(z: Tensor, weight: Tensor, bias: Tensor, eps: float
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, mean, rstd)``: the block's output and each plane's mean and 1/sqrt(var+eps)."""
    z = z.detach().contiguous()
    w, b = _params(weight, bias)
    n, c, h, width = z.shape
    out = z.new_empty(n, c, h // 2, width // 2)
    mean, rstd = z.new_empty(n, c), z.new_empty(n, c)
    _run("gnrp_forward", z, (_ptr(z), _ptr(w), _ptr(b), float(eps), c, h, width),
         (_ptr(out), _ptr(mean), _ptr(rstd)))
    return out, mean, rstd


def block_backward(z: Tensor, gp: Tensor, weight: Tensor, bias: Tensor, mean: Tensor,
                   rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(gz, sgx, sgy)`` from ``gp`` = dL/d(output): dL/dz and, per (n, c) plane, that
    record's gradient of the GroupNorm weight (``sgx``) and bias (``sgy``)."""
    z, gp = z.detach().contiguous(), gp.detach().contiguous()
    w, b = _params(weight, bias)
    n, c, h, width = z.shape
    gz = torch.empty_like(z)
    sgx, sgy = z.new_empty(n, c), z.new_empty(n, c)
    _run("gnrp_backward", z,
         (_ptr(z), _ptr(gp), _ptr(w), _ptr(b), _ptr(mean), _ptr(rstd), c, h, width),
         (_ptr(gz), _ptr(sgx), _ptr(sgy)))
    return gz, sgx, sgy


def block_double_backward(z: Tensor, gp: Tensor, weight: Tensor, bias: Tensor, mean: Tensor,
                          rstd: Tensor, u: Tensor, ug: Tensor, ub: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """``(dz, dgp, dgamma)``: the gradients of sum(u * gz) + ug . dgamma + ub . dbeta (the
    outputs of :func:`block_backward`, summed over the batch) with respect to ``z``, ``gp``
    and, per plane, the GroupNorm weight."""
    z, gp, u = z.detach().contiguous(), gp.detach().contiguous(), u.detach().contiguous()
    w, b = _params(weight, bias)
    ug, ub = ug.detach().contiguous(), ub.detach().contiguous()
    n, c, h, width = z.shape
    dz, dgp, dgam = torch.empty_like(z), torch.empty_like(gp), z.new_empty(n, c)
    _run("gnrp_double_backward", z,
         (_ptr(z), _ptr(gp), _ptr(w), _ptr(b), _ptr(mean), _ptr(rstd), _ptr(u), _ptr(ug),
          _ptr(ub), c, h, width),
         (_ptr(dz), _ptr(dgp), _ptr(dgam)))
    return dz, dgp, dgam


class _Block(torch.autograd.Function):
    """out = pool(relu(group_norm(z))); its backward is :class:`_BlockBackward`."""

    @staticmethod
    def forward(ctx, z: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        out, mean, rstd = block_forward(z, weight, bias, eps)
        ctx.save_for_backward(z, weight, bias)
        ctx.stats = (mean, rstd)
        return out

    @staticmethod
    def backward(ctx, gp: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        z, weight, bias = ctx.saved_tensors
        gz, gw, gb = _BlockBackward.apply(z, gp, weight, bias, *ctx.stats)
        return gz, gw, gb, None


class _BlockBackward(torch.autograd.Function):
    """(gz, dgamma, dbeta) = the block's backward, differentiable once more."""

    @staticmethod
    def forward(ctx, z: Tensor, gp: Tensor, weight: Tensor, bias: Tensor, mean: Tensor,
                rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        gz, sgx, sgy = block_backward(z, gp, weight, bias, mean, rstd)
        ctx.save_for_backward(z, gp, weight, bias)
        ctx.stats = (mean, rstd)
        return gz, sgx.sum(0), sgy.sum(0)

    @staticmethod
    @once_differentiable
    def backward(ctx, u: Tensor, ug: Tensor, ub: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
        z, gp, weight, bias = ctx.saved_tensors
        dz, dgp, dgam = block_double_backward(z, gp, weight, bias, *ctx.stats, u, ug, ub)
        return dz, dgp, dgam.sum(0), None, None, None


def gn_relu_pool(z: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """The block: the C kernels where :func:`fusable`, else :func:`reference_block`."""
    n, c, h, w = z.shape if z.dim() == 4 else (0, 0, 0, 0)
    if n * c > 0 and h >= 2 and w >= 2 and fusable(z, weight, bias):
        return _Block.apply(z, weight, bias, eps)
    return reference_block(z, weight, bias, eps)
