"""The memory an exported program may hold while it runs
(docs/audit.md#auditing-a-model-trained-elsewhere).

A program's size arithmetic is the file's: a 12 KB graph can ask ``aten.ones`` for 3.5 GB,
and a graph that never drops a value holds every intermediate. :class:`Ledger` bounds what a
program holds by a :class:`MemoryBudget` derived from the model's own weights and the batch
it is given: ``128 MiB + 8 x weights + batch x (4 MiB + 1024 x record bytes)``, where a
record's allowance covers the activations of a deep convolutional network on it (a ResNet-18
keeps about 500 times a CIFAR-10 image in activations) and the weights' covers a program
that transforms its weights (casts, weight normalisation).

Before each operator runs, its outputs are sized without allocating (the operator on
``meta`` tensors of the inputs' shapes); a call whose outputs, added to what the program
holds, exceed the budget is refused with one line naming the node and the numbers. After it
runs, each output is charged by the storage it holds (a view of a held value, or of a
weight, costs nothing more), and a value is released when its last reader has run. With
gradients enabled nothing is released (autograd keeps what the backward pass needs), so the
whole forward pass stays within the budget.

A convolution is also charged the buffer its CPU kernel may unfold the input into: the
kernels without a oneDNN path (float64, transposed, some strides) copy every input window
a kernel position reads (im2col), ``records x weight elements per output channel x
positions`` -- a 24 KB program convolving a 700 x 700 float64 plane with a 24 x 24 kernel
returned 3.9 MB and held 2.2 GB on the way.

Under ``torch.func.vmap`` (the per-record gradients of the grad-norm attack) a value is one
record's slice of a tensor of the whole batch: sizes are charged by that tensor, the
records' logical size times the batch sizes of the vmap levels it is batched over.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C import _functorch

from fedlap_privacy.audit.readers.exported_ops import CONVOLUTIONS, NO_META
from fedlap_privacy.audit.readers.exported_schema import Refused

__all__ = ["Ledger", "MemoryBudget", "meta_call", "output_bytes", "physical",
           "result_bytes", "tensors_in"]

_MB = 1 << 20
FLOOR = 128 * _MB
WEIGHT_FACTOR = 8
RECORD_FACTOR = 1024
PER_RECORD = 4 * _MB


def physical(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor under ``torch.func``'s wrappers, and how many records of a vmapped batch
    each of ``t``'s elements stands for (1 outside vmap)."""
    factor = 1
    while _functorch.is_functorch_wrapped_tensor(t):
        if _functorch.is_batchedtensor(t):
            inner = _functorch.get_unwrapped(t)
            factor *= inner.shape[_functorch.maybe_get_bdim(t)]
            t = inner
        else:
            t = _functorch.get_unwrapped(t)
    return t, factor


def tensors_in(value: Any) -> Iterable[torch.Tensor]:
    """Every tensor in ``value``, a tensor or (nested) lists and tuples of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)


def _meta(value: Any) -> Any:
    """``value`` with every tensor replaced by a ``meta`` tensor of its shape (no memory)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device="meta")
    if isinstance(value, torch.device):
        return torch.device("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v) for v in value)
    return value


@dataclass(frozen=True)
class MemoryBudget:
    """What one call of a program may hold, in bytes (module doc)."""

    limit: int
    weight_bytes: int
    batch: int
    record_bytes: int

    @classmethod
    def of(cls, weight_bytes: int, x: torch.Tensor) -> MemoryBudget:
        factor = physical(x)[1]
        batch = (x.shape[0] if x.dim() else 1) * factor
        record = x.numel() * x.element_size() // max(x.shape[0] if x.dim() else 1, 1)
        limit = FLOOR + WEIGHT_FACTOR * weight_bytes + batch * (PER_RECORD
                                                               + RECORD_FACTOR * record)
        return cls(limit, weight_bytes, batch, record)

    def refusal(self, wanted: int, where: str) -> Refused:
        return Refused(f"the program asks for {wanted / _MB:.1f} MB at {where}, above its "
                       f"budget of {self.limit / _MB:.1f} MB: weights "
                       f"{self.weight_bytes / _MB:.1f} MB, batch {self.batch} records of "
                       f"{self.record_bytes} bytes")


def output_bytes(op: Any, target: str, args: list[Any], kwargs: dict[str, Any]) -> int:
    """The bytes ``op(*args, **kwargs)`` would allocate, found without allocating: its
    outputs' sizes from the operator's meta kernel (or, for a data-dependent size, its
    bound), each times the vmap batch of its inputs."""
    factor = max((physical(t)[1] for t in tensors_in([args, list(kwargs.values())])),
                 default=1)
    if not any("Tensor" in str(r.type) for r in op._schema.returns):
        return 0
    if target in NO_META:
        x = args[0]
        return NO_META[target] * x.numel() * max(x.dim(), 1) * 8 * factor
    try:
        out = meta_call(op, args, kwargs)
    except NotImplementedError:
        raise Refused(f"aten.{target} cannot be sized before it runs (no meta kernel)") from None
    return result_bytes(target, args, out) * factor


def result_bytes(target: str, args: list[Any], out: Any) -> int:
    """The bytes of ``out``, the outputs of ``aten.<target>(*args)``, with a convolution's
    im2col buffer."""
    total = sum(t.numel() * t.element_size() for t in tensors_in(out))
    if target in CONVOLUTIONS and isinstance(out, torch.Tensor):
        total += _columns(args[0], args[1], out)
    return total


def meta_call(op: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``op(*args, **kwargs)`` on ``meta`` tensors of the arguments' shapes, with any device
    it is asked for made ``meta``: the outputs' shapes, nothing allocated or computed."""
    meta_kwargs = {k: _meta(v) for k, v in kwargs.items()}
    if any(a.name == "device" and a.kwarg_only for a in op._schema.arguments):
        meta_kwargs["device"] = torch.device("meta")
    return op(*_meta(list(args)), **meta_kwargs)


def _columns(x: Any, weight: Any, out: torch.Tensor) -> int:
    """The im2col buffer of a convolution (module doc): records x the weight's elements per
    output channel (per input channel of a transposed one) x the larger of the input's and
    the output's positions."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)) or (
            weight.dim() < 3):
        return 0
    spatial = weight.dim() - 2
    records = x.shape[0] if x.dim() == weight.dim() else 1
    positions = max(math.prod(x.shape[-spatial:]), math.prod(out.shape[-spatial:]))
    return records * math.prod(weight.shape[1:]) * positions * out.element_size()


@dataclass
class Ledger:
    """What one call of a program holds (module doc): each held storage charged once, with
    how many of the program's values point into it."""

    budget: MemoryBudget
    keep: bool  # gradients enabled: nothing is released
    free: set[int]  # the weights' storages, never charged
    held: int = 0
    peak: int = 0
    storages: dict[int, list[int]] = field(default_factory=dict)  # key -> [bytes, users]
    names: dict[str, int] = field(default_factory=dict)  # value -> its storage's key

    def check(self, wanted: int, where: str) -> None:
        if self.held + wanted > self.budget.limit:
            raise self.budget.refusal(self.held + wanted, where)

    def hold(self, name: str, value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            return
        storage = physical(value)[0].untyped_storage()
        key = storage.data_ptr()
        if key in self.free:
            return
        if key in self.storages:
            self.storages[key][1] += 1
        else:
            self.storages[key] = [storage.nbytes(), 1]
            self.held += storage.nbytes()
            self.peak = max(self.peak, self.held)
        self.names[name] = key

    def release(self, name: str) -> None:
        key = self.names.pop(name, None)
        if key is None:
            return
        entry = self.storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.storages[key]
            if not self.keep:
                self.held -= entry[0]
