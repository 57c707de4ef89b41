"""Keep freed CPU tensor memory in the process instead of returning it to the kernel.

glibc's ``malloc`` serves every block above ``M_MMAP_THRESHOLD`` (128 KiB, rising
dynamically to at most 32 MiB) with a fresh ``mmap`` and gives it back with ``munmap`` when
freed, and trims the heap top above ``M_TRIM_THRESHOLD``. A training step allocates and
frees activations and gradients of tens to hundreds of MiB, so every step maps new pages
and the kernel zero-fills each on first touch: on the 28x28 ConvNet, a plain
forward+backward of 64 records took 442 ms, 145 ms of them in the kernel (70,000 page
faults per step), against 259 ms and no fault with the allocator below
(``benchmarks/speed/fedlap_round.py`` measures a whole FedLAP-DP round). It is the problem for
which PyTorch's CPU performance guide recommends jemalloc or tcmalloc; this module gets the
same effect from glibc itself, at run time, through ``mallopt(3)``:

* ``M_MMAP_THRESHOLD = 1 GiB``: blocks below it come from the heap and are reused;
* ``M_TRIM_THRESHOLD = 2 GiB``: free memory at the heap top is kept up to that much.

The cost: the resident memory of the process stays near its peak instead of shrinking
between steps. Results are unchanged (only where memory comes from changes). Nothing is done
where it would not apply or was decided by the user: off glibc (macOS, Windows, musl), with
an allocator preloaded (``LD_PRELOAD``), with any ``MALLOC_*`` tunable or ``GLIBC_TUNABLES``
in the environment, or where the allocator fast path is off (``FEDLAP_ALLOCATOR=system``,
``FEDLAP_FAST_PATHS=off``: :mod:`fedlap_privacy.compute.fast_paths`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.fast_paths import ALLOCATOR_ENV, FastPaths

__all__ = ["ALLOCATOR_ENV", "AllocatorSetting", "AllocatorState", "tune_allocator"]

# mallopt(3) parameter numbers (glibc <malloc.h>)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = 1 << 31
# glibc versions that cap M_MMAP_THRESHOLD at HEAP_MAX_SIZE / 2 accept this one
_MMAP_THRESHOLD_CAPPED = 32 << 20


class AllocatorState(enum.Enum):
    TUNED = "tuned"  # mallopt applied by this module
    SYSTEM = "system"  # left alone: the user asked for it, or tuned it themselves
    UNSUPPORTED = "unsupported"  # not glibc, or mallopt refused


@dataclass(frozen=True)
class AllocatorSetting:
    """What :func:`tune_allocator` did, and why."""

    state: AllocatorState
    reason: str
    mmap_threshold: int | None = None
    trim_threshold: int | None = None


def _user_tuned(env: Mapping[str, str]) -> str | None:
    """Why the user has already chosen the allocator (a preload or glibc tunables), or None."""
    if "malloc" in env.get("LD_PRELOAD", ""):
        return "an allocator is preloaded (LD_PRELOAD)"
    tunables = sorted(k for k in env if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")
    if tunables:
        return f"allocator tunables set in the environment ({', '.join(tunables)})"
    return None


def tune_allocator(env: Mapping[str, str] | None = None) -> AllocatorSetting:
    """Apply the thresholds of the module docstring to glibc's malloc, once per process.

    Idempotent; never raises for an unsupported platform (returns ``UNSUPPORTED``). Whether
    the allocator fast path is on is :func:`fedlap_privacy.compute.fast_paths.current`'s answer, or,
    with ``env``, :meth:`~fedlap_privacy.compute.fast_paths.FastPaths.from_env` of it; a
    ``FEDLAP_ALLOCATOR`` other than ``tuned``/``system`` raises
    :class:`~fedlap_privacy.errors.ConfigError`.
    """
    paths = fast_paths.current() if env is None else FastPaths.from_env(env)
    env = os.environ if env is None else env
    reason = ("the allocator fast path is off (fedlap_privacy.compute.fast_paths)"
              if not paths.allocator else _user_tuned(env))
    if reason is not None:
        return AllocatorSetting(AllocatorState.SYSTEM, reason)
    libc_name, _ = platform.libc_ver()
    if platform.system() != "Linux" or libc_name != "glibc":
        return AllocatorSetting(AllocatorState.UNSUPPORTED, "not glibc")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return AllocatorSetting(AllocatorState.UNSUPPORTED, "mallopt not found")
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    mmap = next((v for v in (MMAP_THRESHOLD, _MMAP_THRESHOLD_CAPPED)
                 if mallopt(_M_MMAP_THRESHOLD, v) == 1), None)
    if mmap is None or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return AllocatorSetting(AllocatorState.UNSUPPORTED, "mallopt refused the thresholds")
    return AllocatorSetting(AllocatorState.TUNED, "glibc mallopt", mmap, TRIM_THRESHOLD)
