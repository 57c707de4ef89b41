"""Long scheduler time slices for a worker that shares its cores with other workers.

FedLAP-DP's clients of a round train side by side on Flower's Simulation Engine, five
one-thread processes on 2 cores (``--client-cpus 0.4``). Linux gives each runnable process
a slice of a few milliseconds (1.4 ms was measured here) before it switches to the next,
and each switch leaves the next process a second-level cache full of the previous one's
tiles: five real batches side by side, one thread each, took 10 to 15% longer than the
same work one after another would on the 2 cores. Since Linux 6.12 a process of the
normal policy may ask for a longer slice (``sched_setattr``'s ``sched_runtime``, up to
100 ms, no privilege needed; EEVDF, "An EEVDF CPU scheduler for Linux", Zijlstra, LWN
2023). Asked for 100 ms, the same five real batches side by side took 4,446 against 4,810
ms on average (six comparisons, five of them faster, 2026-11-27). The slice changes when a process
runs, never what it computes.

:func:`share_cores_in_long_slices` asks for it where the ``long_slices`` fast path is on
(:mod:`fedlap_privacy.fast_paths`) and the process runs fewer torch threads than the CPUs
it may use (it shares them: a Flower node among several on one machine, a Simulation
Engine actor). Elsewhere, on an older kernel or another system, nothing changes. The
process's nice value is kept.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

import torch

from fedlap_privacy import fast_paths
from fedlap_privacy.threads import usable_cpus

__all__ = ["LONG_SLICE_NS", "share_cores_in_long_slices"]

#: the slice asked for, in nanoseconds: the most Linux grants a process of the normal policy
LONG_SLICE_NS = 100_000_000
#: ``sched_setattr``'s system call number on the machines that have one here
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
#: ``struct sched_attr`` (its first version, 56 bytes): size, policy, flags, nice, priority,
#: runtime, deadline, period, utilisation clamps
_SCHED_ATTR = struct.Struct("IIQiIQQQII")
#: ``SCHED_FLAG_KEEP_POLICY``: the process keeps its policy (normal or batch)
_KEEP_POLICY = 0x08

_asked: bool | None = None


def share_cores_in_long_slices() -> bool:
    """Ask the kernel, once per process, for :data:`LONG_SLICE_NS` slices where this process
    shares its CPUs (module docstring). Returns whether the kernel took the request (a
    kernel older than 6.12 takes it and keeps its own slice)."""
    global _asked
    if _asked is None and fast_paths.current().long_slices and (
            torch.get_num_threads() < usable_cpus()):
        _asked = _request(LONG_SLICE_NS)
    return bool(_asked)


def _request(slice_ns: int) -> bool:
    """``sched_setattr`` with ``slice_ns`` as the slice, the process's policy and nice value
    kept; False where the system has no such call or refuses it."""
    number = _SCHED_SETATTR.get(platform.machine())
    if number is None or not hasattr(os, "getpriority"):
        return False
    attr = ctypes.create_string_buffer(_SCHED_ATTR.pack(
        _SCHED_ATTR.size, 0, _KEEP_POLICY, os.getpriority(os.PRIO_PROCESS, 0), 0, slice_ns,
        0, 0, 0, 0))
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(number, 0, attr, 0) == 0
