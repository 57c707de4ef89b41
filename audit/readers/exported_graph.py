"""The graph of an exported program, run node by node
(docs/audit.md#auditing-a-model-trained-elsewhere).

:class:`GraphReader` turns the serialized nodes into :class:`Step` records: each calls an
``aten`` operator of the positive list of :mod:`.exported_ops`, looked up by name
(``torch.ops.aten.<op>.<overload>``), or bounded integer arithmetic on sizes. Any other
operator, and higher-order, custom and Python-level targets, are refused by name before
anything runs; nothing from the file is evaluated or compiled, node names are only
dictionary keys, and no string from the file is printed. :class:`ExportedModule` runs the
steps on the weights :mod:`.exported` read, sizing each call's outputs before it allocates
them and releasing each value after its last reader (:mod:`.exported_budget`), once a walk
of the graph on ``meta`` tensors has counted its arithmetic within its compute budget
(:mod:`.exported_compute`).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedlap_privacy.audit.readers.exported_budget import (
    Ledger,
    MemoryBudget,
    meta_call,
    output_bytes,
    physical,
    result_bytes,
)
from fedlap_privacy.audit.readers.exported_compute import CALL, ComputeBudget, flops
from fedlap_privacy.audit.readers.exported_ops import (
    ALLOWED,
    NO_META,
    check_arguments,
    check_string,
)
from fedlap_privacy.audit.readers.exported_schema import (
    Refused,
    read_bool,
    read_dtype,
    read_float,
    read_int,
    read_list,
    read_str,
    read_union,
)
from fedlap_privacy.errors import CheckpointError, ConfigError

__all__ = ["ExportedModule", "GraphReader", "input_shape"]

_KEYWORD = 2  # torch._export.serde.schema.ArgumentKind.KEYWORD
_ATEN = re.compile(r"torch\.ops\.aten\.((?!__)[A-Za-z_]\w*)\.((?!__)[A-Za-z_]\w*)")
#: the integer arithmetic on sizes a program may do (torch.export's _SYM_OPS, by name)
_SYMBOLIC: dict[str, Callable[..., Any]] = {
    **{f"_operator.{name}": getattr(operator, name) for name in (
        "eq", "ne", "le", "ge", "lt", "gt", "neg", "pos", "mul", "add", "sub", "floordiv",
        "mod", "pow", "truediv", "and_", "or_", "lshift", "rshift")},
    "math.trunc": math.trunc,
    **{f"torch.{name}": getattr(torch, name) for name in (
        "sym_not", "sym_int", "sym_float", "sym_ite", "sym_max", "sym_min", "sym_sqrt")},
}
_SIZE_LIMIT = 1 << 62  # a size or count beyond any real tensor's


def _bounded(target: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` on sizes, refusing operands and results beyond any tensor's size (a Python
    integer has no bound: ``1 << 10**12`` alone would take 125 GB) and failures of the
    arithmetic itself (a division by zero) in one line."""

    def run(*args: Any) -> Any:
        big = [a for a in args if isinstance(a, int) and abs(a) > _SIZE_LIMIT]
        if target in ("_operator.pow", "_operator.lshift") and len(args) == 2 and all(
                isinstance(a, int) for a in args) and args[1] > 64 and (
                abs(args[0]) > 1 or (target == "_operator.lshift" and args[0])):
            big.append(args[1])
        if not big:
            try:
                result = fn(*args)
            except (ArithmeticError, ValueError) as exc:
                raise CheckpointError(f"the program's size arithmetic fails in {target} "
                                      f"({type(exc).__name__})") from None
            if not (isinstance(result, int) and abs(result) > _SIZE_LIMIT):
                return result
        raise Refused(f"the program's size arithmetic in {target} goes beyond any tensor's "
                      "size")

    return run



@dataclass(frozen=True)
class Ref:
    """A value of the graph, by name: an input, a weight or a node's output."""

    name: str


@dataclass(frozen=True)
class Step:
    """One node: ``op(*args, **kwargs)``, with the result bound to the names in ``outputs``
    (a name, a list of names or None per output; ``single``: the op returns one value)."""

    target: str
    op: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[Any, ...]
    single: bool
    aten: str | None  # ``name.overload`` of an aten operator; None for size arithmetic

    def reads(self) -> set[str]:
        """The names of the values this step reads."""
        found: set[str] = set()
        stack: list[Any] = [*self.args, *self.kwargs.values()]
        while stack:
            value = stack.pop()
            if isinstance(value, Ref):
                found.add(value.name)
            elif isinstance(value, list):
                stack.extend(value)
        return found

    def writes(self) -> list[str]:
        """The names this step binds."""
        return [n for names in self.outputs
                for n in (names if isinstance(names, list) else [names]) if n is not None]


def resolve_operator(target: str) -> tuple[Callable[..., Any], bool]:
    """The callable a node's target names (and whether it returns one value), or a refusal."""
    if target in _SYMBOLIC:
        return _bounded(target, _SYMBOLIC[target]), True
    found = _ATEN.fullmatch(target)
    if found is None:
        raise Refused(f"the program calls {target[:80]!r}: only aten operators and integer "
                       "arithmetic are run (no higher-order, custom or Python functions)")
    try:
        op = getattr(getattr(torch.ops.aten, found[1]), found[2])
    except (AttributeError, RuntimeError):
        raise CheckpointError(f"the program calls {target!r}, which this torch does "
                              "not have") from None
    if not isinstance(op, torch._ops.OpOverload):
        raise Refused(f"the program calls {target!r}, which is not an aten operator")
    if any("file" in a.name or "path" in a.name for a in op._schema.arguments):
        raise Refused(f"the program calls {target!r}, which reads or writes files")
    if f"{found[1]}.{found[2]}" not in ALLOWED:
        raise Refused(f"the program calls aten.{found[1]}.{found[2]}, which is not among the "
                      "dense operators the audit runs")
    return op, len(op._schema.returns) == 1


class GraphReader:
    """Turns the serialized graph into :class:`Step` records, checking that every value a
    node reads was defined before it."""

    def __init__(self, defined: set[str]) -> None:
        self.defined = defined
        self.target = ""  # ``name.overload`` of the node being read

    def ref(self, name: Any) -> Ref:
        name = read_str(name)
        if name not in self.defined:
            raise CheckpointError(f"the program reads {name[:60]!r} before it is defined")
        return Ref(name)

    def tensor(self, value: Any) -> Ref:
        if not isinstance(value, dict):
            raise CheckpointError(f"malformed tensor argument {str(value)[:60]}")
        return self.ref(value.get("name"))

    def optional(self, value: Any) -> Ref | None:
        kind, inner = read_union(value, "optional tensor")
        return self.tensor(inner) if kind == "as_tensor" else None

    def symbolic(self, value: Any, cast: Callable[[Any], Any]) -> Any:
        kind, inner = read_union(value, "symbolic argument")
        return self.ref(inner) if kind == "as_name" else cast(inner)

    def argument(self, value: Any) -> Any:
        """A node input: a literal, or :class:`Ref` (in lists where the schema has lists)."""
        kind, v = read_union(value, "argument")
        scalars: dict[str, Callable[[Any], Any]] = {
            "as_int": read_int, "as_float": read_float, "as_bool": read_bool, "as_string": read_str}
        if kind == "as_none":
            return None
        if kind == "as_string":
            return check_string(self.target, read_str(v))
        if kind in scalars:
            return scalars[kind](v)
        if kind == "as_strings":
            return [check_string(self.target, read_str(x)) for x in read_list(v)]
        if kind[:-1] in scalars:  # as_ints, as_floats, as_bools
            return [scalars[kind[:-1]](x) for x in read_list(v)]
        if kind in ("as_int_lists", "as_float_lists"):
            cast = read_int if kind == "as_int_lists" else read_float
            return [[cast(x) for x in read_list(row)] for row in read_list(v)]
        if kind == "as_tensor":
            return self.tensor(v)
        if kind == "as_tensors":
            return [self.tensor(x) for x in read_list(v)]
        if kind == "as_optional_tensor":
            return self.optional(v)
        if kind == "as_optional_tensors":
            return [self.optional(x) for x in read_list(v)]
        symbolic = {"as_sym_int": read_int, "as_sym_float": read_float, "as_sym_bool": read_bool}
        if kind in symbolic:
            return self.symbolic(v, symbolic[kind])
        if kind[:-1] in symbolic:
            return [self.symbolic(x, symbolic[kind[:-1]]) for x in read_list(v)]
        return self.enum(kind, v)

    def enum(self, kind: str, v: Any) -> Any:
        from torch._export.serde.serialize import (
            _SERIALIZE_TO_TORCH_LAYOUT,
            _SERIALIZE_TO_TORCH_MEMORY_FORMAT,
        )

        try:
            if kind == "as_scalar_type":
                return read_dtype(v)
            if kind == "as_layout":
                layout = _SERIALIZE_TO_TORCH_LAYOUT[read_int(v)]  # type: ignore[index]
                if layout != torch.strided:
                    raise Refused(f"the program asks aten.{self.target} for a {layout} "
                                  "tensor: only dense tensors are run")
                return layout
            if kind == "as_memory_format":
                return _SERIALIZE_TO_TORCH_MEMORY_FORMAT[read_int(v)]  # type: ignore[index]
            if kind == "as_device":
                index = v.get("index")
                if read_str(v.get("type")) not in ("cpu", "cuda"):
                    raise Refused(f"the program asks aten.{self.target} for a device other "
                                  "than cpu or cuda")
                return torch.device(read_str(v.get("type")),
                                    None if index is None else read_int(index))
            if kind == "as_complex":
                return complex(read_float(v.get("real")), read_float(v.get("imag")))
        except (KeyError, RuntimeError, AttributeError):
            raise CheckpointError(f"malformed {kind} argument {str(v)[:60]}") from None
        raise Refused(f"the program passes a {kind[3:]} argument, which is not run "
                       "(only tensors, numbers, strings, dtypes and devices)")

    def output(self, value: Any) -> Any:
        """A node output: the name(s) its value is bound to, None for an unused one."""
        kind, v = read_union(value, "output")
        if kind == "as_tensor":
            names: Any = read_str(v.get("name") if isinstance(v, dict) else None)
        elif kind == "as_tensors":
            names = [read_str(x.get("name") if isinstance(x, dict) else None) for x in read_list(v)]
        elif kind in ("as_sym_int", "as_sym_float", "as_sym_bool"):
            inner_kind, inner = read_union(v, "symbolic output")
            names = read_str(inner) if inner_kind == "as_name" else None
        elif kind in ("as_none", "as_int", "as_float", "as_bool"):
            names = None
        else:
            raise Refused(f"a node returns a {kind[3:]}, which is not run")
        for name in names if isinstance(names, list) else [names]:
            if name is not None:
                if name in self.defined:
                    raise CheckpointError(f"the program defines {name[:60]!r} twice")
                self.defined.add(name)
        return names

    def step(self, node: Any) -> Step:
        if not isinstance(node, dict):
            raise CheckpointError("malformed graph node")
        target = read_str(node.get("target"))
        op, single = resolve_operator(target)
        aten = target.removeprefix("torch.ops.aten.") if target.startswith("torch.ops.") else None
        self.target = aten or target
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for named in read_list(node.get("inputs")):
            value = self.argument(named["arg"])
            if named.get("kind") == _KEYWORD:
                kwargs[read_str(named["name"])] = value
            else:
                args.append(value)
        outputs = tuple(self.output(o) for o in read_list(node.get("outputs")))
        return Step(target, op, tuple(args), kwargs, outputs, single and len(outputs) == 1,
                    aten)


def resolve(value: Any, env: dict[str, Any]) -> Any:
    if isinstance(value, Ref):
        return env[value.name]
    if isinstance(value, list):
        return [resolve(v, env) for v in value]
    return value


def bind(names: Any, value: Any, env: dict[str, Any]) -> None:
    if isinstance(names, str):
        env[names] = value
    elif isinstance(names, list):
        for name, item in zip(names, value, strict=True):
            env[name] = item


class ExportedModule(nn.Module):
    """An exported program's graph run op by op on its weights (registered as this module's
    parameters and buffers, so ``torch.func.functional_call`` and ``.to()`` see them).

    ``forward(x)`` takes the program's one tensor input; a dimension the program fixed (a
    batch size exported without ``torch.export.Dim``) that the records do not match is a
    :class:`ConfigError`, not a shape error deep in the graph. The input is copied first, so
    an in-place operator cannot change the caller's records. Each call's outputs are sized
    against the program's memory budget before they are allocated, and each value is
    dropped once the last step that reads it has run (:mod:`.exported_budget`).
    """

    def __init__(self, steps: list[Step], weights: dict[str, tuple[str, Any]], input_name: str,
                 input_shape: tuple[int | None, ...], output_name: str) -> None:
        super().__init__()
        self._steps = steps
        self._input_name, self._input_shape = input_name, input_shape
        self._output_name = output_name
        self.peak_bytes = 0  # the most the last call held, beyond weights (for tests)
        self._weights: dict[str, str] = {}  # graph name -> attribute name
        seen: dict[int, str] = {}
        for i, (graph_name, (kind, tensor)) in enumerate(weights.items()):
            attribute = seen.get(id(tensor), f"{kind}{i}")
            if id(tensor) not in seen:
                seen[id(tensor)] = attribute
                if isinstance(tensor, nn.Parameter):
                    self.register_parameter(attribute, tensor)
                else:
                    self.register_buffer(attribute, tensor, persistent=kind == "buffer")
            self._weights[graph_name] = attribute
        storages = {t.untyped_storage().data_ptr(): (t.untyped_storage().nbytes(),
                                                     t.element_size())
                    for _, t in weights.values()}
        self._weight_bytes = sum(size for size, _ in storages.values())
        self._weight_elements = sum(size // item for size, item in storages.values())
        #: records' (shape, dtype) -> (first step the walk could not size, FLOP before it)
        self._walks: dict[tuple[Any, ...], tuple[int, int]] = {}
        last: dict[str, int] = {}
        for i, step in enumerate(steps):
            if step.aten == "detach_.default" and step.reads() & set(weights):
                raise Refused("the program calls aten.detach_.default on a weight, which "
                              "would change the model in place")
            for name in [*step.reads(), *step.writes()]:
                last[name] = i
        #: after step i, the values no later step reads (the output is kept)
        self._dead: list[list[str]] = [[] for _ in steps]
        for name, i in last.items():
            if name != output_name:
                self._dead[i].append(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fixed = self._input_shape
        if x.dim() != len(fixed) or any(
                f is not None and f != n for f, n in zip(fixed, x.shape, strict=True)):
            wanted = ", ".join("*" if f is None else str(f) for f in fixed)
            raise ConfigError(f"the exported program takes inputs of shape ({wanted}), the "
                              f"records come as {tuple(x.shape)}: export it with a dynamic "
                              "batch dimension (torch.export.Dim) and the records' shape")
        compute = ComputeBudget.of(self._weight_elements, tuple(x.shape))
        key = (tuple(x.shape), x.dtype)
        if key not in self._walks:
            self._walks[key] = self._walk(x, compute)
        sized, spent = self._walks[key]
        env: dict[str, Any] = {name: getattr(self, attr) for name, attr in self._weights.items()}
        free = {physical(t)[0].untyped_storage().data_ptr() for t in env.values()}
        ledger = Ledger(MemoryBudget.of(self._weight_bytes, x), torch.is_grad_enabled(), free)
        ledger.check(x.numel() * x.element_size() * physical(x)[1], "the input")
        env[self._input_name] = x.clone()
        ledger.hold(self._input_name, env[self._input_name])
        for i, step in enumerate(self._steps):
            args = resolve(list(step.args), env)
            kwargs = {k: resolve(v, env) for k, v in step.kwargs.items()}
            if step.aten is not None:
                args = check_arguments(step.aten, args, kwargs)
                ledger.check(output_bytes(step.op, step.aten, args, kwargs),
                             f"node {i} (aten.{step.aten})")
            if i >= sized:  # past what the walk could size: counted as it runs
                spent += max(flops(step.aten, args, _sized(step, args, kwargs))
                             if step.aten and _returns_tensor(step) else 0, CALL)
                if spent > compute.limit:
                    raise compute.refusal(_where(i, step))
            result = step.op(*args, **kwargs)
            if step.single:
                bind(step.outputs[0], result, env)
            elif step.outputs:  # none for an op that returns nothing (_assert_scalar)
                for names, value in zip(step.outputs, result, strict=True):
                    bind(names, value, env)
            del result
            for name in step.writes():
                ledger.hold(name, env[name])
            for name in self._dead[i]:
                env.pop(name, None)
                ledger.release(name)
        self.peak_bytes = ledger.peak
        return env[self._output_name]

    def flop_count(self, x: torch.Tensor) -> tuple[int, ComputeBudget, bool]:
        """The FLOP of one call on records of ``x``'s shape as the walk counts them (up to
        the first step it cannot size), the budget they are held to, and whether the walk
        sized every step."""
        compute = ComputeBudget.of(self._weight_elements, tuple(x.shape))
        sized, spent = self._walk(x, compute)
        return spent, compute, sized == len(self._steps)

    def _walk(self, x: torch.Tensor, compute: ComputeBudget) -> tuple[int, int]:
        """The program's arithmetic on records of ``x``'s shape, counted on ``meta`` tensors
        before anything runs (:mod:`.exported_compute`); a program over its budget is
        refused. Returns the first step the walk could not size (data-dependent, or one the
        run itself refuses, like a call whose outputs alone exceed the memory budget) and the
        FLOP of the steps before it."""
        env: dict[str, Any] = {name: meta_call(torch.ops.aten.alias.default,
                                               [getattr(self, attr)], {})
                               for name, attr in self._weights.items()}
        env[self._input_name] = torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
        memory = MemoryBudget.of(self._weight_bytes, x).limit
        spent = 0
        for i, step in enumerate(self._steps):
            args = resolve(list(step.args), env)
            kwargs = {k: resolve(v, env) for k, v in step.kwargs.items()}
            try:
                if step.aten is None:
                    result = step.op(*args, **kwargs)
                else:
                    args = check_arguments(step.aten, args, kwargs)
                    result = _sized(step, args, kwargs)
            except (CheckpointError, RuntimeError, NotImplementedError, ValueError,
                    TypeError, IndexError, ArithmeticError):
                return i, spent
            if step.aten is not None and result_bytes(step.aten, args, result) > memory:
                return i, spent  # the memory budget refuses it, with its own numbers
            spent += max(flops(step.aten, args, result) if step.aten else 0, CALL)
            if spent > compute.limit:
                raise compute.refusal(_where(i, step))
            if step.single:
                bind(step.outputs[0], result, env)
            elif step.outputs:
                for names, value in zip(step.outputs, result, strict=True):
                    bind(names, value, env)
        return len(self._steps), spent


def _where(i: int, step: Step) -> str:
    return f"node {i} ({'aten.' + step.aten if step.aten else step.target})"


def _returns_tensor(step: Step) -> bool:
    return any("Tensor" in str(r.type) for r in step.op._schema.returns)


def _sized(step: Step, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``step``'s outputs as ``meta`` tensors (a data-dependent one at its largest)."""
    if step.aten in NO_META:
        x = args[0]
        return torch.empty((NO_META[step.aten] * x.numel(), max(x.dim(), 1)),
                           dtype=torch.long, device="meta")
    return meta_call(step.op, args, kwargs)


def input_shape(meta: Any) -> tuple[int | None, ...]:
    """The user input's dimensions: fixed ones as ints, symbolic ones (never parsed) None."""
    shape = []
    for size in read_list(meta.get("sizes") if isinstance(meta, dict) else None):
        kind, value = read_union(size, "input size")
        shape.append(read_int(value) if kind == "as_int" else None)
    return tuple(shape)
