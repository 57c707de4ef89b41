"""Large transient CPU tensors in their own anonymous memory mapping, returned to the kernel
when they are freed.

:mod:`fedlap_privacy.compute.allocator` tells glibc to keep freed blocks below 1 GiB in the process
(a training step reuses them without page faults). For a block of hundreds of MiB that is
made once a round, a client's records gathered for its step, keeping it costs more than it
saves: the freed block is not always reusable (a later, smaller request may split it, and
the next client's gather may be larger), so the resident memory grew by a client's records
each time, and a run on 1 GiB of features ended above 2 GB (docs/own-data.md#limits). A
tensor from :func:`mapped_empty` owns its pages: freeing it unmaps them.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["MAPPED_BYTES", "mapped_empty"]

#: tensors at least this large come from their own mapping (smaller ones from the heap)
MAPPED_BYTES = 64 << 20


def mapped_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape``; from its own mapping when it takes at least
    :data:`MAPPED_BYTES`, else :func:`torch.empty`."""
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes < MAPPED_BYTES:
        return torch.empty(shape, dtype=dtype)
    # the tensor holds a reference to the mapping (torch.frombuffer): unmapped with it
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(shape)
