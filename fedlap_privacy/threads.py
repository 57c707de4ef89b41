"""How many intra-op threads torch should use: one policy for every entry point.

torch starts as many OpenMP threads as the machine has cores. When several processes share
the machine (Flower SuperNodes started on one host, parallel jobs, other users' work), the
threads oversubscribe the cores and spin on every small operation: a FedLAP-DP round with
one competing busy process was measured 12x slower with torch's default threads than with
one thread (``benchmarks/threads.py`` measures the policy). The policy:

1. an explicit request wins: a ``--threads`` option (``requested``), else ``OMP_NUM_THREADS``
   or ``MKL_NUM_THREADS`` set by the user;
2. otherwise ``max(1, usable_cpus() // workers)``, where :func:`usable_cpus` is the number
   of CPUs this process may run on (``os.sched_getaffinity``), capped by a cgroup v2 CPU
   quota (``/sys/fs/cgroup/cpu.max``) when one is set, and ``workers`` is the number of
   co-located worker processes sharing them (default: ``FEDLAP_WORKERS``, else 1).

Worker processes (e.g. one Flower SuperNode per client on one machine) call
``apply_thread_policy(workers=n)`` (or ``torch.set_num_threads(threads_for(n))``) before
their first torch operation, or inherit ``FEDLAP_WORKERS=n`` from the process that starts
them. The thread count changes speed only, never results beyond floating-point rounding.

Entry points call :func:`apply_cpu_policy`, which also keeps freed tensor memory in the
process (:mod:`fedlap_privacy.allocator`) and builds or loads the fused C kernels
(:mod:`fedlap_privacy.kernels`) before any data is read, so that a bad ``FEDLAP_KERNELS``
is one line at start-up and the one-time build is not inside the first round.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fedlap_privacy.allocator import AllocatorSetting, tune_allocator
from fedlap_privacy.errors import ConfigError

__all__ = [
    "CGROUP_CPU_MAX",
    "WORKERS_ENV",
    "CpuPolicy",
    "apply_cpu_policy",
    "apply_thread_policy",
    "cgroup_cpu_limit",
    "explicit_threads",
    "threads_for",
    "usable_cpus",
]

#: environment variable with the number of co-located worker processes
WORKERS_ENV = "FEDLAP_WORKERS"
#: the cgroup v2 CPU quota file: ``"max 100000"`` (no quota) or ``"<quota> <period>"``
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _positive_int(text: str | None) -> int | None:
    try:
        value = int(str(text).strip())
    except ValueError:
        return None
    return value if value >= 1 else None


def cgroup_cpu_limit(path: Path = CGROUP_CPU_MAX) -> float | None:
    """CPUs granted by a cgroup v2 quota (``quota / period``), or None without a quota."""
    try:
        fields = path.read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = float(fields[0]), float(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def usable_cpus(cgroup_path: Path = CGROUP_CPU_MAX) -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (>= 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_path)
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return max(1, cpus)


def explicit_threads(env: Mapping[str, str] | None = None) -> int | None:
    """The thread count a user set through ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``."""
    env = os.environ if env is None else env
    for name in _THREAD_VARS:
        value = _positive_int(env.get(name))
        if value is not None:
            return value
    return None


def threads_for(
    workers: int | None = None,
    *,
    requested: int | None = None,
    env: Mapping[str, str] | None = None,
    cgroup_path: Path = CGROUP_CPU_MAX,
) -> int:
    """The policy of the module docstring: intra-op threads for one of ``workers`` processes.

    ``requested`` (a ``--threads`` option) wins, then ``OMP_NUM_THREADS`` /
    ``MKL_NUM_THREADS``; otherwise the usable CPUs divided among the ``workers`` co-located
    processes (``FEDLAP_WORKERS`` when None, else 1), at least 1.
    """
    env = os.environ if env is None else env
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"--threads must be >= 1, got {requested}")
        return requested
    explicit = explicit_threads(env)
    if explicit is not None:
        return explicit
    if workers is None:
        workers = _positive_int(env.get(WORKERS_ENV)) or 1
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    return max(1, usable_cpus(cgroup_path) // workers)


def apply_thread_policy(requested: int | None = None, workers: int | None = None) -> int:
    """Set torch's intra-op threads by :func:`threads_for`; returns the number set."""
    import torch

    threads = threads_for(workers, requested=requested)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


@dataclass(frozen=True)
class CpuPolicy:
    """What :func:`apply_cpu_policy` set: torch's intra-op threads, the C allocator, and
    whether the fused C kernels are in use."""

    threads: int
    allocator: AllocatorSetting
    fused_kernels: bool


def apply_cpu_policy(requested: int | None = None, workers: int | None = None) -> CpuPolicy:
    """The process-wide CPU settings of every entry point (CLI commands, Flower nodes):
    :func:`apply_thread_policy`, :func:`fedlap_privacy.allocator.tune_allocator` and
    :func:`fedlap_privacy.kernels.load_kernels`."""
    from fedlap_privacy.kernels.build import load_kernels

    return CpuPolicy(apply_thread_policy(requested, workers), tune_allocator(),
                     load_kernels() is not None)
