"""The user's dataset with the included gradient canaries as records of it.

:class:`CanaryRecords` holds the user's ``n`` records first, in their order, then one record
per included canary: a copy of the user's first record whose input (the first element of a
tuple or list record, the ``input_key`` entry of a dict record, or the record itself when it
is a tensor) holds, in every entry, its canary's mark
(:func:`~.canary_block.canary_mark`); the other fields (labels, masks) are the first
record's. Any loader and sampler then draws the canaries exactly as it draws records, and the
wrapped model (:class:`~.canary_block.CanaryBlockModel`) routes each drawn one to its
coordinate of the canary block. Build the sampler from this dataset (its length counts the
canaries): a sampler over the first ``n`` indices never draws one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fedlap_privacy.audit.canaries.canary_block import MARK_DTYPES, canary_mark
from fedlap_privacy.errors import ConfigError

__all__ = ["CanaryRecords"]

_NUMPY_MARK_DTYPES = (np.float32, np.float64)


def _markable(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype in MARK_DTYPES and value.numel() > 0
    return isinstance(value, np.ndarray) and value.dtype.type in _NUMPY_MARK_DTYPES \
        and value.size > 0


def _marked(value: Any, j: int) -> Any:
    mark = canary_mark(j)
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, mark)
    return np.full_like(value, mark)


class CanaryRecords(torch.utils.data.Dataset):
    """``dataset`` followed by one canary record per coordinate of ``coordinates`` (module
    docstring). ``input_key``: for dict records, the key of the input the model receives
    first (default: the record's only float32 / float64 tensor)."""

    def __init__(self, dataset: Any, coordinates: Sequence[int],
                 input_key: str | None = None) -> None:
        try:
            n = len(dataset)
        except TypeError:
            raise ConfigError("wrap_dataset needs a map-style dataset (with len and "
                              "indexing), got an iterable one") from None
        if n < 1:
            raise ConfigError("wrap_dataset needs a dataset with at least one record")
        self.dataset = dataset
        self.coordinates = np.asarray(coordinates, dtype=np.int64)
        self._n = n
        self._length = n + len(self.coordinates)
        self._template = dataset[0]
        self._key = self._input_key(self._template, input_key)

    @staticmethod
    def _input_key(record: Any, input_key: str | None) -> Any:
        """Where the input sits in a record: None (the record), an index or a dict key."""
        what = ("canary records copy your first record with its input marked; the input "
                "must be a float32 or float64 tensor or array")
        if isinstance(record, dict):
            if input_key is None:
                keys = [k for k, v in record.items() if _markable(v)]
                if len(keys) != 1:
                    raise ConfigError(f"dict records need wrap_dataset(..., input_key=...): "
                                      f"{len(keys)} float tensors in the first record ({what})")
                return keys[0]
            if input_key not in record or not _markable(record[input_key]):
                raise ConfigError(f"input_key {input_key!r} is not a float tensor of the "
                                  f"first record ({what})")
            return input_key
        if input_key is not None:
            raise ConfigError("input_key is for dict records only")
        if isinstance(record, tuple | list) and record and _markable(record[0]):
            return 0
        if _markable(record):
            return None
        raise ConfigError(f"records of type {type(record).__name__} are not supported: a "
                          f"tensor, a tuple / list whose first element is the input, or a "
                          f"dict ({what})")

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        if 0 <= index < self._n:
            return self.dataset[index]
        index = int(index)
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"record {index} of {self._length}")
        if index < self._n:
            return self.dataset[index]
        j = int(self.coordinates[index - self._n])
        record = self._template
        if self._key is None:
            return _marked(record, j)
        if isinstance(record, dict):
            return {**record, self._key: _marked(record[self._key], j)}
        items = [_marked(record[0], j), *record[1:]]
        return type(record)(items) if isinstance(record, list) else tuple(items)
