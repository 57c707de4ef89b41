"""How many intra-op threads torch should use: one policy for every entry point.

torch starts as many OpenMP threads as the machine has cores. When several processes share
the machine (Flower SuperNodes started on one host, parallel jobs, other users' work), the
threads oversubscribe the cores and spin on every small operation: a FedLAP-DP round with
one competing busy process was measured 12x slower with torch's default threads than with
one thread (``benchmarks/speed/threads.py`` measures the policy). The policy:

1. an explicit request wins: a ``--threads`` option (``requested``, at most the CPUs of the
   process's affinity mask: a higher count is refused in one line), else ``OMP_NUM_THREADS``
   or ``MKL_NUM_THREADS`` set by the user;
2. otherwise ``max(1, usable_cpus() // workers)``, where :func:`usable_cpus` is the number
   of CPUs this process may run on (``os.sched_getaffinity``), capped by a cgroup v2 CPU
   quota (``/sys/fs/cgroup/cpu.max``) when one is set, and ``workers`` is the number of
   co-located worker processes sharing them (default: ``FEDLAP_WORKERS``, else 1).

3. the count of 2. then FOLLOWS THE LOAD (:class:`LoadFollower`, on by default in every
   command; ``FEDLAP_FOLLOW_LOAD=0``, ``FEDLAP_FAST_PATHS=off`` or
   :func:`fedlap_privacy.compute.fast_paths.disabled` keep it fixed): before the first step
   and again before every round and client step, the CPU time other processes took on this
   process's CPUs since the last look (``/proc/stat`` less this process's own time) is
   subtracted from the usable CPUs, and torch runs that many threads (at least 1, at most
   the count of 2.).
   A Flower ServerApp, which waits while its nodes train, looks afresh once they replied
   (the next 0.1 s only): their training is not load on its own server step.
   GNU OpenMP's idle threads spin a few milliseconds before they sleep, so threads beyond
   the idle cores spin on every small operation: a default two-round ``train`` beside one
   busy torch process took 3.6-3.8x its time alone with two threads and 0.9x with one;
   waiting passively instead (``OMP_WAIT_POLICY=PASSIVE``) cured that but made the run alone
   1.5-1.75x slower (``benchmarks/speed/threads.py``). Runs that ask for bit-for-bit reproducible
   noise keep their thread count (a different count rounds differently).

Worker processes (e.g. one Flower SuperNode per client on one machine) call
``apply_thread_policy(workers=n)`` (or ``torch.set_num_threads(threads_for(n))``) before
their first torch operation, or inherit ``FEDLAP_WORKERS=n`` from the process that starts
them. The thread count changes speed only, never results beyond floating-point rounding.

Entry points call :func:`apply_cpu_policy`, which also keeps freed tensor memory in the
process (:mod:`fedlap_privacy.compute.allocator`) and loads the fused C kernels
(:mod:`fedlap_privacy.compute.kernels`) before any data is read, so that a bad ``FEDLAP_KERNELS``
is one line at start-up and the loading is not inside the first round. It reads the
fast-path switches from the environment (:func:`fedlap_privacy.compute.fast_paths.refresh`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.allocator import AllocatorSetting, tune_allocator
from fedlap_privacy.compute.fast_paths import FOLLOW_ENV
from fedlap_privacy.errors import ConfigError

__all__ = [
    "CGROUP_CPU_MAX",
    "FOLLOW_ENV",
    "WORKERS_ENV",
    "CpuPolicy",
    "LoadFollower",
    "affinity_cpus",
    "apply_cpu_policy",
    "apply_thread_policy",
    "cgroup_cpu_limit",
    "explicit_threads",
    "follow_load",
    "threads_for",
    "usable_cpus",
]

#: environment variable with the number of co-located worker processes
WORKERS_ENV = "FEDLAP_WORKERS"
#: /proc/stat's per-CPU fields that count busy time: user nice system (idle iowait) irq
#: softirq steal
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
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


def affinity_cpus() -> int:
    """CPUs this process may run on: its affinity mask (``os.sched_getaffinity``; the
    machine's count where there is none), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def usable_cpus(cgroup_path: Path = CGROUP_CPU_MAX) -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (>= 1)."""
    cpus = affinity_cpus()
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
    processes (``FEDLAP_WORKERS`` when None, else 1), at least 1. ``requested`` is bounded
    by :func:`affinity_cpus`: more threads than the process may run on only spin (and a
    count in the thousands exhausts the memory of their stacks), so a higher count is one
    line naming the limit.
    """
    env = os.environ if env is None else env
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"--threads must be >= 1, got {requested}")
        limit = affinity_cpus()
        if requested > limit:
            raise ConfigError(f"--threads {requested}: at most {limit}, the CPUs this process "
                              "may run on (its CPU affinity)")
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
class LoadSample:
    """One look at the machine: wall clock, busy seconds of the watched CPUs since boot, and
    this process's own CPU seconds (all its threads)."""

    wall: float
    busy: float
    own: float


def sample_load(cpus: frozenset[int], stat: Path = Path("/proc/stat")) -> LoadSample | None:
    """:class:`LoadSample` of ``cpus`` from ``/proc/stat``; None where it cannot be read."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    ticks, found = 0, 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            ticks += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
            found += 1
    if found == 0:
        return None
    times = os.times()
    return LoadSample(time.monotonic(), ticks / os.sysconf("SC_CLK_TCK"),
                      times.user + times.system)


def others_busy(before: LoadSample, after: LoadSample) -> float:
    """CPUs that other processes kept busy between two looks (busy time less our own)."""
    elapsed = after.wall - before.wall
    if elapsed <= 0:
        return 0.0
    return max(0.0, ((after.busy - before.busy) - (after.own - before.own)) / elapsed)


class LoadFollower:
    """torch's intra-op threads following the load (module docstring, rule 3): ``ceiling``
    threads at most, one per CPU that other processes left idle since the last look, at
    least one. Looks closer together than ``min_interval`` seconds are skipped (too short
    to measure)."""

    def __init__(self, ceiling: int, cpus: frozenset[int], min_interval: float = 0.05,
                 stat: Path = Path("/proc/stat")) -> None:
        self.ceiling, self.cpus, self.min_interval, self.stat = ceiling, cpus, min_interval, stat
        self.last = sample_load(cpus, stat)

    def threads_now(self) -> int | None:
        """The thread count for what other processes did since the last look (None: too
        soon, or the load cannot be read)."""
        now = sample_load(self.cpus, self.stat)
        if now is None or self.last is None or now.wall - self.last.wall < self.min_interval:
            self.last = self.last or now
            return None
        busy, self.last = others_busy(self.last, now), now
        return max(1, min(self.ceiling, math.floor(len(self.cpus) - busy + 0.5)))

    def look_afresh(self, seconds: float) -> int:
        """Forget the time since the last look, look again after ``seconds`` and set the
        threads by what other processes did in them (:meth:`update`)."""
        self.last = sample_load(self.cpus, self.stat)
        time.sleep(seconds)
        return self.update()

    def update(self) -> int:
        """Set torch's threads by :meth:`threads_now`; returns the count in force."""
        import torch

        threads = self.threads_now()
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return torch.get_num_threads()


_follower: LoadFollower | None = None
#: seconds a fresh look at the load spans (the first one, at start-up, and
#: ``follow_load(fresh=True)``)
STARTUP_LOOK = 0.1


def follow_load(fresh: bool = False) -> None:
    """Let the process's :class:`LoadFollower` (set by :func:`apply_cpu_policy`) adjust the
    threads; nothing where none was set (a library user's own thread settings stand) or
    the load-following fast path is off (:func:`fedlap_privacy.compute.fast_paths.current`).

    ``fresh``: look at the next :data:`STARTUP_LOOK` seconds only, for a process that waited
    while others computed for it (a Flower ServerApp while its nodes train: their time since
    the last look is others' load, but they are done)."""
    if _follower is not None and fast_paths.current().follow_load:
        if fresh:
            _follower.look_afresh(STARTUP_LOOK)
        else:
            _follower.update()


def _affinity() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset()


@dataclass(frozen=True)
class CpuPolicy:
    """What :func:`apply_cpu_policy` set: torch's intra-op threads, the C allocator, and
    whether the fused C kernels are in use."""

    threads: int
    allocator: AllocatorSetting
    fused_kernels: bool


def apply_cpu_policy(requested: int | None = None, workers: int | None = None,
                     follow: bool = True) -> CpuPolicy:
    """The process-wide CPU settings of every entry point (CLI commands, Flower nodes):
    :func:`apply_thread_policy`, then, unless the count was asked for (``requested``,
    ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``), the load-following fast path is off
    (:mod:`fedlap_privacy.compute.fast_paths`, read again from the environment here) or ``follow``
    is false (a Flower node: co-located nodes share the CPUs by ``FEDLAP_WORKERS``), a
    :class:`LoadFollower` that :func:`follow_load` consults (first while the kernels load,
    which takes a measurable moment), :func:`fedlap_privacy.compute.allocator.tune_allocator` and
    :func:`fedlap_privacy.compute.kernels.load_kernels`."""
    global _follower
    from fedlap_privacy.compute.kernels.library import load_kernels

    paths = fast_paths.refresh()
    threads = apply_thread_policy(requested, workers)
    follow = (follow and requested is None and explicit_threads() is None
              and paths.follow_load)
    cpus = _affinity()
    _follower = LoadFollower(threads, cpus) if follow and threads > 1 and cpus else None
    policy = CpuPolicy(threads, tune_allocator(), load_kernels() is not None)
    if _follower is not None and _follower.last is not None:
        # the first look spans at least STARTUP_LOOK seconds (loading the kernels was quick)
        time.sleep(max(0.0, STARTUP_LOOK - (time.monotonic() - _follower.last.wall)))
        _follower.update()
    return policy
