"""Method states and model weights as Flower records, exactly (float32 bits kept).

Contract: :func:`decode_state` (:func:`encode_state` (s)) equals ``s`` for every method state
(nested dicts with string keys, lists, tensors and plain JSON values); tensors keep their
dtype and bits. Anything else is refused with :class:`TypeError` when encoding, and a
malformed record with :class:`CodecError` when decoding (a reply or instruction that does not
decode is refused, never half-read).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from torch import Tensor

from fedlap_privacy.errors import FedlapError

__all__ = ["CodecError", "decode_state", "encode_state", "pack", "unpack", "weights_record"]


class CodecError(FedlapError):
    """A record does not decode into a method state (one line)."""


def encode_state(state: Any) -> tuple[ArrayRecord, str]:
    """A method state (nested dicts/lists of tensors and plain values) as an ArrayRecord + JSON.

    Tensors go to the record (numpy arrays: dtype and bits kept); the JSON tree holds the
    plain values and ``{"__tensor__": key}`` where a tensor was. Floats survive JSON exactly.
    """
    arrays: dict[str, Array] = {}

    def walk(obj: Any) -> Any:
        if isinstance(obj, Tensor):
            key = f"t{len(arrays)}"
            arrays[key] = Array(obj.detach().cpu().contiguous().numpy())
            return {"__tensor__": key}
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
    return ArrayRecord(arrays), json.dumps(tree)


def decode_state(arrays: ArrayRecord, tree: str, device: torch.device | str = "cpu") -> Any:
    """Inverse of :func:`encode_state`; tensors land on ``device``."""

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict) and "__tensor__" in obj:
            return torch.from_numpy(np.array(arrays[obj["__tensor__"]].numpy())).to(device)
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj["__dict__"].items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    try:
        return walk(json.loads(tree))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CodecError(f"malformed method state ({type(exc).__name__}: {exc})") from None


def pack(prefix: str, state: Any) -> RecordDict:
    """``state`` as the records ``PREFIX-arrays`` and ``PREFIX-tree`` of a message."""
    arrays, tree = encode_state(state)
    return RecordDict({f"{prefix}-arrays": arrays, f"{prefix}-tree": ConfigRecord({"json": tree})})


def unpack(records: RecordDict, prefix: str, device: torch.device | str = "cpu") -> Any:
    """Inverse of :func:`pack`; a missing record is a :class:`CodecError`."""
    try:
        tree = records.config_records[f"{prefix}-tree"]["json"]
        arrays = records.array_records[f"{prefix}-arrays"]
    except KeyError:
        raise CodecError(f"the message has no {prefix} state") from None
    return decode_state(arrays, str(tree), device)


def weights_record(state_dict: dict[str, Tensor]) -> ArrayRecord:
    """A model's ``state_dict`` as an ArrayRecord (CPU numpy arrays, bits kept)."""
    return ArrayRecord(
        {k: Array(v.detach().cpu().contiguous().numpy()) for k, v in state_dict.items()}
    )
