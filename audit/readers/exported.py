"""Read an exported program (``torch.export.save``, a ``.pt2`` archive) without unpickling or
running anything from the file (docs/audit.md#auditing-a-model-trained-elsewhere).

``torch.export.load`` must not be given someone else's file: it unpickles weights and tensor
constants flagged ``use_pickle`` with ``weights_only=False`` and opaque constants with
``pickle.loads``, falls back to ``weights_only=False`` for the sample inputs, parses the
symbolic shapes with ``sympy.sympify`` (``eval``), compiles the program's ``guards_code`` and
generates Python source from node names and attribute paths. Each of them runs code written
into the file, as the auditor.

:func:`load_exported_program` reads the archive itself, and only plain data:

* ``models/model.json`` (the graph) and the weights' and constants' payload configs, as JSON
  of at most 16 MiB each (``_MAX_JSON_BYTES``), in an archive whose entries unpack to no more
  than its own size (``torch.export.save`` stores them uncompressed: no zip bomb);
* each weight and tensor constant as raw bytes of the dtype, shape and strides its JSON entry
  gives, within its payload and holding no more elements than the payload stores (a stride of
  0 cannot make one stored value a 40,000 x 40,000 weight). An entry flagged ``use_pickle``,
  a custom or opaque object constant, or a legacy pickled weights file is refused (one line)
  before any payload byte is read. The sample inputs, the guard code and the symbolic shape
  expressions are never read.

:class:`ExportedModule` (:mod:`.exported_graph`) then runs the graph node by node, each node
a dense ``aten`` operator of a positive list (:mod:`.exported_ops`) or integer arithmetic on
sizes; anything else is refused and nothing from the file is evaluated or compiled. Each
call's outputs are sized before they are allocated, against a memory budget derived from the
weights and the batch (:mod:`.exported_budget`), and the program's arithmetic per record is
counted before its first operator runs, against a compute budget derived from the weights
and the records' shape (:mod:`.exported_compute`). The program's outputs other than
its one user output (buffer mutations, e.g. BatchNorm statistics in training mode) are
dropped.
"""

from __future__ import annotations

import json
import math
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedlap_privacy.audit.readers.exported_graph import ExportedModule, GraphReader, input_shape
from fedlap_privacy.audit.readers.exported_schema import (
    Refused,
    read_dtype,
    read_list,
    read_str,
    read_union,
    static_int,
)
from fedlap_privacy.errors import CheckpointError, FedlapError

__all__ = ["ExportedModule", "load_exported_program"]

#: the graph and payload configs: a genuine export is 2-3 KB a node (the ResNet-18-style
#: network of benchmarks/speed/pt2_flop_margins.py: 70 nodes, 195 KB), so 16 MiB holds graphs
#: some 80 times its size; parsing the most memory-hungry 16 MiB of JSON (a list of empty
#: lists) takes about 400 MB, 256 MiB took 6.4 GB
_MAX_JSON_BYTES = 16 << 20
_STRIDED = 7  # torch._export.serde.schema.Layout.Strided
_PATH_NAME = re.compile(r"[A-Za-z0-9_]+")


class _Archive:
    """The entries of a ``.pt2`` zip, under its one top-level folder; nothing is unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = path.stat().st_size
        try:
            self.zip = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise CheckpointError(f"{path} is not a .pt2 archive ({exc})") from None
        unpacked = sum(info.file_size for info in self.zip.infolist())
        if unpacked > self.size:
            raise Refused(f"refusing to read {path}: its entries unpack to {unpacked} bytes, "
                          f"more than the {self.size} of the archive (torch.export.save "
                          "stores them uncompressed)")
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
            raise Refused(f"refusing to read {self.path}: entry {name} unpacks to "
                          f"{info.file_size} bytes, more than "
                          + (f"the {limit >> 20} MiB this reader parses" if limit and
                             limit < info.file_size <= self.size else "the archive holds"))
        return self.zip.read(info)

    def json(self, name: str) -> Any:
        try:
            return json.loads(self.read(name, _MAX_JSON_BYTES))
        except (ValueError, RecursionError) as exc:
            raise CheckpointError(f"{self.path}: {name} is not valid JSON ({exc})") from None


def _validate_payloads(archive: _Archive, config: Any, folder: str, what: str) -> dict[str, Any]:
    """Every entry of a payload config, checked before any payload byte is read: no pickles,
    no objects, raw tensors only."""
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise CheckpointError(f"{archive.path}: malformed {what} config")
    for fqn, meta in entries.items():
        if not isinstance(meta, dict):
            raise CheckpointError(f"{archive.path}: malformed {what} entry {fqn!r}")
        path_name = read_str(meta.get("path_name"))
        if meta.get("use_pickle") is not False or meta.get("tensor_meta") is None:
            raise Refused(f"refusing to load {archive.path}: {what} {fqn!r} is stored pickled "
                           "(unpickling could run code); only raw tensor payloads are read")
        if what == "constant" and not path_name.startswith("tensor_"):
            raise Refused(f"refusing to load {archive.path}: constant {fqn!r} is a pickled "
                           "object, not a tensor")
        if not _PATH_NAME.fullmatch(path_name) or folder + path_name not in archive.names:
            raise CheckpointError(f"{archive.path}: {what} {fqn!r} has no payload entry")
    return entries


def _raw_tensors(archive: _Archive, entries: dict[str, Any], folder: str) -> dict[str, Any]:
    """FQN -> tensor, each a view of its payload's raw bytes (the dtype, shape, strides and
    offset of its ``tensor_meta``; entries that share a payload share its storage)."""
    little = archive.read("byteorder", 16).strip() if "byteorder" in archive.names else b"little"
    if little.decode(errors="replace") != sys.byteorder:
        raise Refused(f"refusing to load {archive.path}: its weights are {little!r}-endian")
    flats: dict[str, torch.Tensor] = {}
    out: dict[str, Any] = {}
    for fqn, meta in entries.items():
        tm = meta["tensor_meta"]
        dtype = read_dtype(tm.get("dtype"))
        if tm.get("layout", _STRIDED) != _STRIDED:
            raise Refused(f"refusing to load {archive.path}: {fqn!r} is not a dense tensor")
        sizes = [static_int(s, "size") for s in read_list(tm.get("sizes"))]
        strides = [static_int(s, "stride") for s in read_list(tm.get("strides"))]
        offset = static_int(tm.get("storage_offset"), "storage offset")
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
        if math.prod(sizes) > flat.numel():  # a stride of 0 repeating a few stored values
            raise Refused(f"refusing to load {archive.path}: {fqn!r} declares "
                          f"{math.prod(sizes)} elements over a payload of {flat.numel()}")
        view = flat.as_strided(sizes, strides, offset)
        out[fqn] = (nn.Parameter(view, requires_grad=bool(tm.get("requires_grad")))
                    if meta.get("is_param") else view)
    return out


def _program(archive: _Archive) -> ExportedModule:
    for legacy in ("data/weights/model.pt", "data/constants/model.pt"):
        if legacy in archive.names:
            raise Refused(f"refusing to load {archive.path}: its {legacy} is pickled (the "
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
    inputs, specs = read_list(graph["inputs"]), read_list(signature["input_specs"])
    if len(inputs) != len(specs):
        raise CheckpointError(f"{archive.path}: graph inputs and signature disagree")
    for spec in specs:
        kind, body = read_union(spec, "input spec")
        if kind == "user_input":
            arg_kind, arg = read_union(body["arg"], "user input")
            if arg_kind != "as_tensor":
                raise Refused(f"{archive.path}: the program takes a {arg_kind[3:]} input; "
                               "the audit gives one tensor")
            user_inputs.append(read_str(arg["name"]))
            continue
        sources = {"parameter": ("parameter_name", weights),
                   "buffer": ("buffer_name", {**constants, **weights}),
                   "tensor_constant": ("tensor_constant_name", constants)}
        if kind not in sources:
            raise Refused(f"refusing to load {archive.path}: it takes a {kind} input (custom "
                           "objects and effect tokens are not read)")
        key, table = sources[kind]
        fqn = read_str(body[key])
        if fqn not in table:
            raise CheckpointError(f"{archive.path}: {kind} {fqn!r} has no stored value")
        bound[read_str(body["arg"]["name"])] = (kind, table[fqn])
    if len(user_inputs) != 1:
        raise Refused(f"{archive.path}: the program takes {len(user_inputs)} inputs; the "
                       "audit gives one (the records)")

    reader = GraphReader({*bound, *user_inputs})
    steps = [reader.step(node) for node in read_list(graph["nodes"])]
    outputs, out_specs = read_list(graph["outputs"]), read_list(signature["output_specs"])
    if len(outputs) != len(out_specs):
        raise CheckpointError(f"{archive.path}: graph outputs and signature disagree")
    user = [out for out, spec in zip(outputs, out_specs, strict=True)
            if read_union(spec, "output spec")[0] == "user_output"]
    if len(user) != 1 or read_union(user[0], "output")[0] != "as_tensor":
        raise Refused(f"{archive.path}: the program returns {len(user)} values; the audit "
                       "needs one tensor of logits")
    output = reader.tensor(user[0]["as_tensor"]).name
    shape = input_shape(graph.get("tensor_values", {}).get(user_inputs[0]))
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
