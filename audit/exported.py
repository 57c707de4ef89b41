"""Read an exported program (``torch.export.save``, a ``.pt2`` archive) without unpickling or
running anything from the file (docs/audit.md#auditing-a-model-trained-elsewhere).

``torch.export.load`` must not be given someone else's file: it unpickles weights and tensor
constants flagged ``use_pickle`` with ``weights_only=False`` and opaque constants with
``pickle.loads``, falls back to ``weights_only=False`` for the sample inputs, parses the
symbolic shapes with ``sympy.sympify`` (``eval``), compiles the program's ``guards_code`` and
generates Python source from node names and attribute paths. Each of them runs code written
into the file, as the auditor.

:func:`load_exported_program` reads the archive itself, and only plain data:

* ``models/model.json`` (the graph) and the weights' and constants' payload configs, as JSON;
* each weight and tensor constant as raw bytes of the dtype, shape and strides its JSON entry
  gives. An entry flagged ``use_pickle``, a custom or opaque object constant, or a legacy
  pickled weights file is refused (one line) before any payload byte is read. The sample
  inputs, the guard code and the symbolic shape expressions are never read.

:class:`ExportedModule` then runs the graph node by node: each node calls an ``aten`` operator
looked up by name (``torch.ops.aten.<op>.<overload>``; operators with a file argument,
``aten::from_file`` and ``aten::save``, are refused) or integer arithmetic on sizes. Higher-
order, custom and Python-level targets are refused, nothing from the file is evaluated or
compiled, and node names are only dictionary keys. The program's outputs other than its one
user output (buffer mutations, e.g. BatchNorm statistics in training mode) are dropped.
"""

from __future__ import annotations

import json
import math
import operator
import re
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedlap_privacy.errors import CheckpointError, ConfigError, FedlapError

__all__ = ["ExportedModule", "load_exported_program"]

_MAX_JSON_BYTES = 256 << 20
_STRIDED = 7  # torch._export.serde.schema.Layout.Strided
_KEYWORD = 2  # torch._export.serde.schema.ArgumentKind.KEYWORD
_ATEN = re.compile(r"torch\.ops\.aten\.((?!__)[A-Za-z_]\w*)\.((?!__)[A-Za-z_]\w*)")
_PATH_NAME = re.compile(r"[A-Za-z0-9_]+")
#: the integer arithmetic on sizes a program may do (torch.export's _SYM_OPS, by name)
_SYMBOLIC: dict[str, Callable[..., Any]] = {
    **{f"_operator.{name}": getattr(operator, name) for name in (
        "eq", "ne", "le", "ge", "lt", "gt", "neg", "pos", "mul", "add", "sub", "floordiv",
        "mod", "pow", "truediv", "and_", "or_", "lshift", "rshift")},
    "math.trunc": math.trunc,
    **{f"torch.{name}": getattr(torch, name) for name in (
        "sym_not", "sym_int", "sym_float", "sym_ite", "sym_max", "sym_min", "sym_sqrt")},
}


class _Refused(CheckpointError):
    """A part of the archive that would run code, or that this reader does not handle."""


@dataclass(frozen=True)
class _Ref:
    """A value of the graph, by name: an input, a weight or a node's output."""

    name: str


@dataclass(frozen=True)
class _Step:
    """One node: ``op(*args, **kwargs)``, with the result bound to the names in ``outputs``
    (a name, a list of names or None per output; ``single``: the op returns one value)."""

    target: str
    op: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[Any, ...]
    single: bool


class _Archive:
    """The entries of a ``.pt2`` zip, under its one top-level folder; nothing is unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = path.stat().st_size
        try:
            self.zip = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise CheckpointError(f"{path} is not a .pt2 archive ({exc})") from None
        names = self.zip.namelist()
        self.root = names[0].split("/", 1)[0] + "/" if names else ""
        self.names = {n[len(self.root):] for n in names if n.startswith(self.root)}

    def read(self, name: str, limit: int | None = None) -> bytes:
        try:
            info = self.zip.getinfo(self.root + name)
        except KeyError:
            raise CheckpointError(f"{self.path} has no entry {name}: not a torch.export "
                                  "archive") from None
        if info.file_size > min(limit or self.size, self.size):
            raise _Refused(f"refusing to read {self.path}: entry {name} unpacks to "
                           f"{info.file_size} bytes, more than the archive holds")
        return self.zip.read(info)

    def json(self, name: str) -> Any:
        try:
            return json.loads(self.read(name, _MAX_JSON_BYTES))
        except (ValueError, RecursionError) as exc:
            raise CheckpointError(f"{self.path}: {name} is not valid JSON ({exc})") from None


def _union(value: Any, what: str) -> tuple[str, Any]:
    """A serialized union (one key): its kind and its value."""
    if not isinstance(value, dict) or len(value) != 1:
        raise CheckpointError(f"malformed {what}: {str(value)[:80]}")
    ((kind, inner),) = value.items()
    return str(kind), inner


def _int(value: Any) -> int:
    if type(value) is not int:
        raise CheckpointError(f"expected an integer, got {str(value)[:40]}")
    return value


def _float(value: Any) -> float:
    if isinstance(value, str) and value in ("Infinity", "-Infinity", "NaN"):
        return float(value)
    if type(value) not in (int, float):
        raise CheckpointError(f"expected a number, got {str(value)[:40]}")
    return float(value)


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise CheckpointError(f"expected a boolean, got {str(value)[:40]}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise CheckpointError(f"expected a string, got {str(value)[:40]}")
    return value


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise CheckpointError(f"expected a list, got {str(value)[:40]}")
    return value


def _static(symint: Any, what: str) -> int:
    kind, value = _union(symint, what)
    if kind != "as_int":
        raise _Refused(f"a weight has a symbolic {what}: only fixed shapes are read")
    return _int(value)


def _dtype(code: Any) -> torch.dtype:
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    try:
        return _SERIALIZE_TO_TORCH_DTYPE[_int(code)]  # type: ignore[index]
    except KeyError:
        raise CheckpointError(f"unknown dtype code {code}") from None


def _validate_payloads(archive: _Archive, config: Any, folder: str, what: str) -> dict[str, Any]:
    """Every entry of a payload config, checked before any payload byte is read: no pickles,
    no objects, raw tensors only."""
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise CheckpointError(f"{archive.path}: malformed {what} config")
    for fqn, meta in entries.items():
        if not isinstance(meta, dict):
            raise CheckpointError(f"{archive.path}: malformed {what} entry {fqn!r}")
        path_name = _str(meta.get("path_name"))
        if meta.get("use_pickle") is not False or meta.get("tensor_meta") is None:
            raise _Refused(f"refusing to load {archive.path}: {what} {fqn!r} is stored pickled "
                           "(unpickling could run code); only raw tensor payloads are read")
        if what == "constant" and not path_name.startswith("tensor_"):
            raise _Refused(f"refusing to load {archive.path}: constant {fqn!r} is a pickled "
                           "object, not a tensor")
        if not _PATH_NAME.fullmatch(path_name) or folder + path_name not in archive.names:
            raise CheckpointError(f"{archive.path}: {what} {fqn!r} has no payload entry")
    return entries


def _raw_tensors(archive: _Archive, entries: dict[str, Any], folder: str) -> dict[str, Any]:
    """FQN -> tensor, each a view of its payload's raw bytes (the dtype, shape, strides and
    offset of its ``tensor_meta``; entries that share a payload share its storage)."""
    little = archive.read("byteorder", 16).strip() if "byteorder" in archive.names else b"little"
    if little.decode(errors="replace") != sys.byteorder:
        raise _Refused(f"refusing to load {archive.path}: its weights are {little!r}-endian")
    flats: dict[str, torch.Tensor] = {}
    out: dict[str, Any] = {}
    for fqn, meta in entries.items():
        tm = meta["tensor_meta"]
        dtype = _dtype(tm.get("dtype"))
        if tm.get("layout", _STRIDED) != _STRIDED:
            raise _Refused(f"refusing to load {archive.path}: {fqn!r} is not a dense tensor")
        sizes = [_static(s, "size") for s in _list(tm.get("sizes"))]
        strides = [_static(s, "stride") for s in _list(tm.get("strides"))]
        offset = _static(tm.get("storage_offset"), "storage offset")
        flat = flats.get(meta["path_name"])
        if flat is None:
            raw = archive.read(folder + meta["path_name"])
            itemsize = torch.empty((), dtype=dtype).element_size()
            if len(raw) % itemsize:
                raise CheckpointError(f"{archive.path}: payload of {fqn!r} is not whole "
                                      f"{dtype} elements")
            flat = (torch.frombuffer(bytearray(raw), dtype=dtype) if raw
                    else torch.empty(0, dtype=dtype))
            flats[meta["path_name"]] = flat
        if flat.dtype != dtype:
            raise CheckpointError(f"{archive.path}: payload of {fqn!r} is read as two dtypes")
        if len(sizes) != len(strides) or min([offset, *sizes, *strides], default=0) < 0:
            raise CheckpointError(f"{archive.path}: {fqn!r} has an impossible layout")
        span = 0 if 0 in sizes else offset + 1 + sum(
            (n - 1) * s for n, s in zip(sizes, strides, strict=True))
        if span > flat.numel():
            raise CheckpointError(f"{archive.path}: {fqn!r} needs {span} elements, its payload "
                                  f"holds {flat.numel()}")
        view = flat.as_strided(sizes, strides, offset)
        out[fqn] = (nn.Parameter(view, requires_grad=bool(tm.get("requires_grad")))
                    if meta.get("is_param") else view)
    return out


def _operator(target: str) -> tuple[Callable[..., Any], bool]:
    """The callable a node's target names (and whether it returns one value), or a refusal."""
    if target in _SYMBOLIC:
        return _SYMBOLIC[target], True
    found = _ATEN.fullmatch(target)
    if found is None:
        raise _Refused(f"the program calls {target[:80]!r}: only aten operators and integer "
                       "arithmetic are run (no higher-order, custom or Python functions)")
    try:
        op = getattr(getattr(torch.ops.aten, found[1]), found[2])
    except (AttributeError, RuntimeError):
        raise CheckpointError(f"the program calls {target!r}, which this torch does "
                              "not have") from None
    if not isinstance(op, torch._ops.OpOverload):
        raise _Refused(f"the program calls {target!r}, which is not an aten operator")
    if any("file" in a.name or "path" in a.name for a in op._schema.arguments):
        raise _Refused(f"the program calls {target!r}, which reads or writes files")
    return op, len(op._schema.returns) == 1


class _GraphReader:
    """Turns the serialized graph into :class:`_Step` records, checking that every value a
    node reads was defined before it."""

    def __init__(self, defined: set[str]) -> None:
        self.defined = defined

    def ref(self, name: Any) -> _Ref:
        name = _str(name)
        if name not in self.defined:
            raise CheckpointError(f"the program reads {name[:60]!r} before it is defined")
        return _Ref(name)

    def tensor(self, value: Any) -> _Ref:
        if not isinstance(value, dict):
            raise CheckpointError(f"malformed tensor argument {str(value)[:60]}")
        return self.ref(value.get("name"))

    def optional(self, value: Any) -> _Ref | None:
        kind, inner = _union(value, "optional tensor")
        return self.tensor(inner) if kind == "as_tensor" else None

    def symbolic(self, value: Any, cast: Callable[[Any], Any]) -> Any:
        kind, inner = _union(value, "symbolic argument")
        return self.ref(inner) if kind == "as_name" else cast(inner)

    def argument(self, value: Any) -> Any:
        """A node input: a literal, or :class:`_Ref` (in lists where the schema has lists)."""
        kind, v = _union(value, "argument")
        scalars: dict[str, Callable[[Any], Any]] = {
            "as_int": _int, "as_float": _float, "as_bool": _bool, "as_string": _str}
        if kind == "as_none":
            return None
        if kind in scalars:
            return scalars[kind](v)
        if kind[:-1] in scalars:  # as_ints, as_floats, as_bools, as_strings
            return [scalars[kind[:-1]](x) for x in _list(v)]
        if kind in ("as_int_lists", "as_float_lists"):
            cast = _int if kind == "as_int_lists" else _float
            return [[cast(x) for x in _list(row)] for row in _list(v)]
        if kind == "as_tensor":
            return self.tensor(v)
        if kind == "as_tensors":
            return [self.tensor(x) for x in _list(v)]
        if kind == "as_optional_tensor":
            return self.optional(v)
        if kind == "as_optional_tensors":
            return [self.optional(x) for x in _list(v)]
        symbolic = {"as_sym_int": _int, "as_sym_float": _float, "as_sym_bool": _bool}
        if kind in symbolic:
            return self.symbolic(v, symbolic[kind])
        if kind[:-1] in symbolic:
            return [self.symbolic(x, symbolic[kind[:-1]]) for x in _list(v)]
        return self.enum(kind, v)

    def enum(self, kind: str, v: Any) -> Any:
        from torch._export.serde.serialize import (
            _SERIALIZE_TO_TORCH_LAYOUT,
            _SERIALIZE_TO_TORCH_MEMORY_FORMAT,
        )

        try:
            if kind == "as_scalar_type":
                return _dtype(v)
            if kind == "as_layout":
                return _SERIALIZE_TO_TORCH_LAYOUT[_int(v)]  # type: ignore[index]
            if kind == "as_memory_format":
                return _SERIALIZE_TO_TORCH_MEMORY_FORMAT[_int(v)]  # type: ignore[index]
            if kind == "as_device":
                index = v.get("index")
                return torch.device(_str(v.get("type")),
                                    None if index is None else _int(index))
            if kind == "as_complex":
                return complex(_float(v.get("real")), _float(v.get("imag")))
        except (KeyError, RuntimeError, AttributeError):
            raise CheckpointError(f"malformed {kind} argument {str(v)[:60]}") from None
        raise _Refused(f"the program passes a {kind[3:]} argument, which is not run "
                       "(only tensors, numbers, strings, dtypes and devices)")

    def output(self, value: Any) -> Any:
        """A node output: the name(s) its value is bound to, None for an unused one."""
        kind, v = _union(value, "output")
        if kind == "as_tensor":
            names: Any = _str(v.get("name") if isinstance(v, dict) else None)
        elif kind == "as_tensors":
            names = [_str(x.get("name") if isinstance(x, dict) else None) for x in _list(v)]
        elif kind in ("as_sym_int", "as_sym_float", "as_sym_bool"):
            inner_kind, inner = _union(v, "symbolic output")
            names = _str(inner) if inner_kind == "as_name" else None
        elif kind in ("as_none", "as_int", "as_float", "as_bool"):
            names = None
        else:
            raise _Refused(f"a node returns a {kind[3:]}, which is not run")
        for name in names if isinstance(names, list) else [names]:
            if name is not None:
                self.defined.add(name)
        return names

    def step(self, node: Any) -> _Step:
        if not isinstance(node, dict):
            raise CheckpointError("malformed graph node")
        target = _str(node.get("target"))
        op, single = _operator(target)
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for named in _list(node.get("inputs")):
            value = self.argument(named["arg"])
            if named.get("kind") == _KEYWORD:
                kwargs[_str(named["name"])] = value
            else:
                args.append(value)
        outputs = tuple(self.output(o) for o in _list(node.get("outputs")))
        return _Step(target, op, tuple(args), kwargs, outputs, single and len(outputs) == 1)


def _resolve(value: Any, env: dict[str, Any]) -> Any:
    if isinstance(value, _Ref):
        return env[value.name]
    if isinstance(value, list):
        return [_resolve(v, env) for v in value]
    return value


def _bind(names: Any, value: Any, env: dict[str, Any]) -> None:
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
    an in-place operator cannot change the caller's records.
    """

    def __init__(self, steps: list[_Step], weights: dict[str, tuple[str, Any]], input_name: str,
                 input_shape: tuple[int | None, ...], output_name: str) -> None:
        super().__init__()
        self._steps = steps
        self._input_name, self._input_shape = input_name, input_shape
        self._output_name = output_name
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fixed = self._input_shape
        if x.dim() != len(fixed) or any(
                f is not None and f != n for f, n in zip(fixed, x.shape, strict=True)):
            wanted = ", ".join("*" if f is None else str(f) for f in fixed)
            raise ConfigError(f"the exported program takes inputs of shape ({wanted}), the "
                              f"records come as {tuple(x.shape)}: export it with a dynamic "
                              "batch dimension (torch.export.Dim) and the records' shape")
        env: dict[str, Any] = {name: getattr(self, attr) for name, attr in self._weights.items()}
        env[self._input_name] = x.clone()
        for step in self._steps:
            result = step.op(*_resolve(list(step.args), env), **{
                k: _resolve(v, env) for k, v in step.kwargs.items()})
            if step.single:
                _bind(step.outputs[0], result, env)
            elif step.outputs:  # none for an op that returns nothing (_assert_scalar)
                for names, value in zip(step.outputs, result, strict=True):
                    _bind(names, value, env)
        return env[self._output_name]


def _input_shape(meta: Any) -> tuple[int | None, ...]:
    """The user input's dimensions: fixed ones as ints, symbolic ones (never parsed) None."""
    shape = []
    for size in _list(meta.get("sizes") if isinstance(meta, dict) else None):
        kind, value = _union(size, "input size")
        shape.append(_int(value) if kind == "as_int" else None)
    return tuple(shape)


def _program(archive: _Archive) -> ExportedModule:
    for legacy in ("data/weights/model.pt", "data/constants/model.pt"):
        if legacy in archive.names:
            raise _Refused(f"refusing to load {archive.path}: its {legacy} is pickled (the "
                           "legacy format); re-save it with torch.export.save")
    if archive.read("archive_format", 16).strip() != b"pt2":
        raise CheckpointError(f"{archive.path} is not a torch.export archive")
    weights_cfg = _validate_payloads(archive, archive.json(
        "data/weights/model_weights_config.json"), "data/weights/", "weight")
    constants_cfg = _validate_payloads(archive, archive.json(
        "data/constants/model_constants_config.json"), "data/constants/", "constant")
    program = archive.json("models/model.json")
    graph_module = program["graph_module"]
    graph, signature = graph_module["graph"], graph_module["signature"]
    weights = _raw_tensors(archive, weights_cfg, "data/weights/")
    constants = _raw_tensors(archive, constants_cfg, "data/constants/")

    bound: dict[str, tuple[str, Any]] = {}
    user_inputs: list[str] = []
    inputs, specs = _list(graph["inputs"]), _list(signature["input_specs"])
    if len(inputs) != len(specs):
        raise CheckpointError(f"{archive.path}: graph inputs and signature disagree")
    for spec in specs:
        kind, body = _union(spec, "input spec")
        if kind == "user_input":
            arg_kind, arg = _union(body["arg"], "user input")
            if arg_kind != "as_tensor":
                raise _Refused(f"{archive.path}: the program takes a {arg_kind[3:]} input; "
                               "the audit gives one tensor")
            user_inputs.append(_str(arg["name"]))
            continue
        sources = {"parameter": ("parameter_name", weights),
                   "buffer": ("buffer_name", {**constants, **weights}),
                   "tensor_constant": ("tensor_constant_name", constants)}
        if kind not in sources:
            raise _Refused(f"refusing to load {archive.path}: it takes a {kind} input (custom "
                           "objects and effect tokens are not read)")
        key, table = sources[kind]
        fqn = _str(body[key])
        if fqn not in table:
            raise CheckpointError(f"{archive.path}: {kind} {fqn!r} has no stored value")
        bound[_str(body["arg"]["name"])] = (kind, table[fqn])
    if len(user_inputs) != 1:
        raise _Refused(f"{archive.path}: the program takes {len(user_inputs)} inputs; the "
                       "audit gives one (the records)")

    reader = _GraphReader({*bound, *user_inputs})
    steps = [reader.step(node) for node in _list(graph["nodes"])]
    outputs, out_specs = _list(graph["outputs"]), _list(signature["output_specs"])
    if len(outputs) != len(out_specs):
        raise CheckpointError(f"{archive.path}: graph outputs and signature disagree")
    user = [out for out, spec in zip(outputs, out_specs, strict=True)
            if _union(spec, "output spec")[0] == "user_output"]
    if len(user) != 1 or _union(user[0], "output")[0] != "as_tensor":
        raise _Refused(f"{archive.path}: the program returns {len(user)} values; the audit "
                       "needs one tensor of logits")
    output = reader.tensor(user[0]["as_tensor"]).name
    shape = _input_shape(graph.get("tensor_values", {}).get(user_inputs[0]))
    return ExportedModule(steps, bound, user_inputs[0], shape, output)


def load_exported_program(path: str | Path) -> ExportedModule:
    """The program in a ``torch.export.save`` archive as a module, read without unpickling
    or evaluating anything from the file (module doc); what cannot be read that way is
    refused with a :class:`CheckpointError` naming the part."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no such model file: {path}")
    archive = _Archive(path)
    try:
        return _program(archive)
    except FedlapError:
        raise
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, RuntimeError,
            zipfile.BadZipFile, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
        raise CheckpointError(f"{path} is not a readable exported program ({first})") from None
    finally:
        archive.zip.close()
