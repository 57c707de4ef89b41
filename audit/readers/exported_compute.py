"""The arithmetic an exported program may do per record
(docs/audit.md#auditing-a-model-trained-elsewhere).

The memory budget (:mod:`.exported_budget`) does not bound time: a 6 MB graph of 20,000
``aten.mm`` on a 512 x 512 weight holds two products at a time and runs for minutes per
batch, and a program can build a 64 MiB matrix with ``aten.full`` and multiply it by itself
(137 GFLOP a product). Before the first operator runs, the interpreter
(:class:`~fedlap_privacy.audit.readers.exported_graph.ExportedModule`) walks the graph once on
``meta`` tensors of the records' shape (nothing is allocated or computed) and adds up each
call's floating-point operations (:func:`flops`):

* a product (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``matmul``, ``linear``):
  ``2 x m x n x k`` (``2 x`` the output's elements ``x`` the inner dimension);
* a convolution: ``2 x`` the output's elements ``x`` ``C_in / groups x`` the kernel's
  positions (a transposed one: ``2 x`` the input's elements ``x`` ``C_out / groups x`` the
  kernel's positions), plus one addition per output element for the bias;
* pooling: the output's elements ``x`` the window's (an adaptive pooling: ``2**d x`` the
  elements, its windows overlap by at most one position along each of ``d`` dimensions);
* a view or a size query: nothing; any other operator (element-wise arithmetic, reductions,
  copies, factories, norms): the elements of its largest input or output;
* and every node at least :data:`CALL` (``2**16``), the cost of dispatching it (about ten
  microseconds), so that a graph of many tiny calls is bounded too.

A program whose total, divided by the records of the batch, exceeds the
:class:`ComputeBudget` of its weights is refused in one line before anything runs. The
budget is that of the most expensive genuine network the weights could form, times a margin:
a dense layer uses each weight once per record (``2 x weights`` FLOP), a convolution at most
once per position of the record (``positions``: a record's elements past its first, channel,
dimension; 1 for a vector), so a model of ``W`` weights costs at most about
``2 x W x positions`` per record, and the budget is ``16 x`` that plus a floor of
``2**27`` FLOP, one per byte of the memory budget's floor (a few milliseconds of one core),
for the norms, activations and losses of tiny models. On the models of
benchmarks/speed/pt2_flop_margins.py the walk counts 0.3 % of the budget of a ResNet-18 on
CIFAR-10 records, 1.2 % of the project's ConvNet on MNIST; a large MLP, whose weights are
used once, up to 1/16.

``nonzero``, whose output size depends on the data, is counted at its largest; ``item`` (a
size read from a tensor) is unknown on ``meta`` and stops the walk. From the first
step the walk could not size, each call's operations are counted just before it runs (the
same rule, on the real inputs), so the program is refused there, having spent at most its
budget.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from fedlap_privacy.audit.readers.exported_budget import tensors_in
from fedlap_privacy.audit.readers.exported_ops import CONVOLUTIONS
from fedlap_privacy.audit.readers.exported_schema import Refused

__all__ = ["CALL", "ComputeBudget", "flops"]

#: the least a node costs: its dispatch, counted as FLOP (module doc)
CALL = 1 << 16
#: the margin over the costliest genuine network of the same weights (module doc)
FACTOR = 16
#: FLOP per record every program may spend, whatever its weights (module doc)
FLOOR = 1 << 27
_PRODUCTS = {"mm.default", "addmm.default", "bmm.default", "baddbmm.default",
             "matmul.default", "linear.default"}
#: pooling: each output reads a window (``max_pool2d_with_indices``: adaptive no, 2-d)
_POOLING = re.compile(r"_?(adaptive_)?(?:max|avg)_pool(\d)d(?:_with_indices)?\.default")
_BIASED = {"addmm.default", "baddbmm.default"}
#: operators that only relabel their input's memory (or read sizes): no arithmetic
_FREE = {"view.default", "_unsafe_view.default", "t.default", "transpose.int",
         "permute.default", "unsqueeze.default", "squeeze.default", "squeeze.dim",
         "squeeze.dims", "expand.default", "slice.Tensor", "select.int", "narrow.default",
         "alias.default", "detach.default", "detach_.default", "split.Tensor",
         "split_with_sizes.default", "chunk.default", "unbind.int", "unflatten.int",
         "sym_size.int", "sym_numel.default", "sym_stride.int", "_assert_scalar.default",
         "_assert_tensor_metadata.default", "sym_constrain_range_for_size.default",
         "_local_scalar_dense.default", "item.default"}


def flops(target: str, args: list[Any], out: Any) -> int:
    """The floating-point operations of ``aten.<target>(*args)`` returning ``out`` (module
    doc), from the shapes alone."""
    if target in _FREE:
        return 0
    if target in _PRODUCTS or target in CONVOLUTIONS:
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        if isinstance(out, torch.Tensor) and len(inputs) >= 2:
            return _linear(target, args, inputs, out)
    elements = max((t.numel() for t in tensors_in([args, out])), default=0)
    pooled = _POOLING.fullmatch(target)
    if pooled is None:
        return elements
    dims = int(pooled[2])
    if pooled[1]:  # adaptive: windows of at most (input / output + 1) along each dimension
        return elements << dims
    kernel = args[1] if len(args) > 1 else 1
    window = math.prod(kernel) if isinstance(kernel, list) else 1
    if isinstance(kernel, int) or (isinstance(kernel, list) and len(kernel) == 1):
        window = int(kernel if isinstance(kernel, int) else kernel[0]) ** dims
    outputs = max((t.numel() for t in tensors_in(out)), default=0)
    return max(elements, outputs * window)


def _linear(target: str, args: list[Any], inputs: list[torch.Tensor],
            out: torch.Tensor) -> int:
    if target in CONVOLUTIONS:
        x, weight = args[0], args[1]
        transposed = target.startswith("conv_transpose") or (
            target == "convolution.default" and len(args) > 6 and bool(args[6]))
        per_output = math.prod(weight.shape[1:])
        return 2 * (x.numel() if transposed else out.numel()) * per_output + out.numel()
    # the inner dimension: the last of the left operand (the input of linear); the bias
    # of addmm / baddbmm / linear adds one operation per output element
    left = 1 if target in _BIASED else 0
    inner = inputs[left].shape[-1] if inputs[left].dim() else 1
    biased = target in _BIASED or (target == "linear.default" and len(inputs) > 2)
    return 2 * out.numel() * inner + (out.numel() if biased else 0)


@dataclass(frozen=True)
class ComputeBudget:
    """The FLOP one call of a program may spend (module doc)."""

    per_record: int
    records: int
    weights: int
    positions: int

    @classmethod
    def of(cls, weights: int, shape: tuple[int, ...]) -> ComputeBudget:
        """The budget of a program of ``weights`` elements on records of ``shape`` (the
        batch's, first dimension the records)."""
        records = shape[0] if shape else 1
        positions = math.prod(shape[2:])
        return cls(FLOOR + FACTOR * 2 * weights * positions, records, weights, positions)

    @property
    def limit(self) -> int:
        return self.per_record * max(self.records, 1)

    def refusal(self, where: str) -> Refused:
        """The one line of a program whose count passes the budget at ``where`` (a node)."""
        return Refused(f"this program needs more than {self.per_record / 1e9:.3g} GFLOP per "
                       f"record, its budget for a model of {self.weights} weights on records "
                       f"of {self.positions} positions ({FACTOR} x 2 x weights x positions + "
                       f"{FLOOR / 1e9:.3g}): the count passes it at {where}")
