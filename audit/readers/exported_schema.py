"""The plain-data values of a serialized ``torch.export`` program, each read as the type it
must have (a malformed or unexpected value is a :class:`CheckpointError`, a part that would run
code a :class:`Refused`); used by :mod:`.exported` and :mod:`.exported_graph`."""

from __future__ import annotations

from typing import Any

import torch

from fedlap_privacy.errors import CheckpointError

__all__ = ["DTYPES", "Refused", "read_bool", "read_dtype", "read_float", "read_int", "read_list",
           "read_str", "read_union", "static_int"]


class Refused(CheckpointError):
    """A part of the archive that would run code, or that this reader does not handle."""


def read_union(value: Any, what: str) -> tuple[str, Any]:
    """A serialized union (one key): its kind and its value."""
    if not isinstance(value, dict) or len(value) != 1:
        raise CheckpointError(f"malformed {what}: {str(value)[:80]}")
    ((kind, inner),) = value.items()
    return str(kind), inner


def read_int(value: Any) -> int:
    if type(value) is not int:
        raise CheckpointError(f"expected an integer, got {str(value)[:40]}")
    return value


def read_float(value: Any) -> float:
    if isinstance(value, str) and value in ("Infinity", "-Infinity", "NaN"):
        return float(value)
    if type(value) not in (int, float):
        raise CheckpointError(f"expected a number, got {str(value)[:40]}")
    return float(value)


def read_bool(value: Any) -> bool:
    if type(value) is not bool:
        raise CheckpointError(f"expected a boolean, got {str(value)[:40]}")
    return value


def read_str(value: Any) -> str:
    if not isinstance(value, str):
        raise CheckpointError(f"expected a string, got {str(value)[:40]}")
    return value


def read_list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise CheckpointError(f"expected a list, got {str(value)[:40]}")
    return value


def static_int(symint: Any, what: str) -> int:
    kind, value = read_union(symint, what)
    if kind != "as_int":
        raise Refused(f"a weight has a symbolic {what}: only fixed shapes are read")
    return read_int(value)


#: the dtypes a program's tensors may have: dense real numbers and booleans (no complex,
#: quantized or 8-bit float types)
DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                    torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64})


def read_dtype(code: Any) -> torch.dtype:
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    try:
        dtype = _SERIALIZE_TO_TORCH_DTYPE[read_int(code)]  # type: ignore[index]
    except KeyError:
        raise CheckpointError(f"unknown dtype code {code}") from None
    if dtype not in DTYPES:
        raise Refused(f"the program uses {dtype}: only dense real and boolean tensors are "
                      "read")
    return dtype
