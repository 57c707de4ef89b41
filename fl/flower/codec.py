"""Method states and model weights as Flower records, exactly (float32 bits kept).

Contract: :func:`decode_state` (:func:`encode_state` (s)) equals ``s`` for every method state
(nested dicts with string keys, lists, tensors and plain JSON values); tensors keep their
dtype and bits. Anything else is refused with :class:`TypeError` when encoding, and a
malformed record with :class:`CodecError` when decoding (a reply or instruction that does not
decode is refused, never half-read).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from torch import Tensor

from fedlap_privacy.errors import FedlapError

__all__ = ["CodecError", "decode_state", "encode_state", "pack", "pack_into", "unpack"]


class CodecError(FedlapError):
    """A record does not decode into a method state (one line)."""


#: the tensor dtypes a state may carry (what the methods send: weights, images, labels,
#: counts, masks); anything else is refused when decoding
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool)}
#: the one array of a state: every tensor's bytes, one after the other
BLOB = "blob"


def encode_state(state: Any) -> tuple[ArrayRecord, str]:
    """A method state (nested dicts/lists of tensors and plain values) as an ArrayRecord + JSON.

    Every tensor's bytes go, one after the other, into ONE byte array of the record (a
    message is one object per array on Flower's wire: one array instead of one per tensor
    saves a request per tensor and node); the JSON tree holds the plain values and, where a
    tensor was, ``{"__tensor__": [offset, dtype, shape]}``. Dtype and bits are kept; floats
    survive JSON exactly.
    """
    parts: list[bytes] = []
    offset = 0

    def walk(obj: Any) -> Any:
        nonlocal offset
        if isinstance(obj, Tensor):
            name = str(obj.dtype).removeprefix("torch.")
            if name not in DTYPES:
                raise TypeError(f"cannot send a {name} tensor in a method state")
            t = obj.detach().cpu().contiguous()
            raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            entry = {"__tensor__": [offset, name, list(t.shape)]}
            parts.append(raw)
            offset += len(raw)
            return entry
        if isinstance(obj, dict):
            if not all(isinstance(k, str) for k in obj):
                raise TypeError("method state dicts must have string keys")
            return {"__dict__": {k: walk(v) for k, v in obj.items()}}
        if isinstance(obj, list | tuple):
            return [walk(v) for v in obj]
        if obj is None or isinstance(obj, bool | int | float | str):
            return obj
        raise TypeError(f"cannot send a {type(obj).__name__} in a method state")

    tree = walk(state)
    blob = np.frombuffer(b"".join(parts), dtype=np.uint8)
    return ArrayRecord({BLOB: Array(blob)}), json.dumps(tree)


def _tensor(blob: Tensor, entry: Any) -> Tensor:
    """The tensor an ``{"__tensor__": [offset, dtype, shape]}`` entry names in ``blob``."""
    offset, name, shape = entry
    if name not in DTYPES or not isinstance(offset, int) or isinstance(offset, bool) \
            or not isinstance(shape, list) or len(shape) > 8 or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"bad tensor entry {str(entry)[:80]}")
    dtype = DTYPES[name]
    size = torch.empty((), dtype=dtype).element_size() * math.prod(shape)
    if not 0 <= offset <= offset + size <= blob.numel():
        raise ValueError(f"tensor entry {str(entry)[:80]} outside the state's {blob.numel()} bytes")
    return blob[offset:offset + size].clone().view(dtype).view(shape)


def decode_state(arrays: ArrayRecord, tree: str, device: torch.device | str = "cpu") -> Any:
    """Inverse of :func:`encode_state`; tensors land on ``device``. A record whose entries
    name bytes outside its one array, an unknown dtype or a malformed tree is refused."""

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict) and "__tensor__" in obj:
            return _tensor(blob, obj["__tensor__"]).to(device)
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj["__dict__"].items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    try:
        if set(arrays) != {BLOB}:
            raise ValueError(f"expected one array {BLOB!r}, got {sorted(arrays)[:4]}")
        raw = arrays[BLOB].numpy()
        if raw.dtype != np.uint8 or raw.ndim != 1:
            raise ValueError(f"the state's array is {raw.dtype} of {raw.ndim} dimensions")
        blob = torch.from_numpy(np.array(raw))
        return walk(json.loads(tree))
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CodecError(f"malformed method state ({type(exc).__name__}: {exc})") from None


def pack(prefix: str, state: Any) -> RecordDict:
    """``state`` as the records ``PREFIX-arrays`` and ``PREFIX-tree`` of a message."""
    arrays, tree = encode_state(state)
    return RecordDict({f"{prefix}-arrays": arrays, f"{prefix}-tree": ConfigRecord({"json": tree})})


def pack_into(records: RecordDict, prefix: str, state: Any) -> None:
    """Add :func:`pack`'s two records of ``state`` to ``records``."""
    for key, record in pack(prefix, state).items():
        records[key] = record


def unpack(records: RecordDict, prefix: str, device: torch.device | str = "cpu") -> Any:
    """Inverse of :func:`pack`; a missing record is a :class:`CodecError`."""
    try:
        tree = records.config_records[f"{prefix}-tree"]["json"]
        arrays = records.array_records[f"{prefix}-arrays"]
    except KeyError:
        raise CodecError(f"the message has no {prefix} state") from None
    return decode_state(arrays, str(tree), device)
