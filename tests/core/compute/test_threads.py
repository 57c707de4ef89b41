"""The intra-op thread policy (fedlap_privacy.compute.threads): explicit settings win, otherwise the
usable CPUs (affinity, cgroup quota) divided among the co-located workers."""

from __future__ import annotations

import os

import pytest
import torch

from fedlap_privacy.compute import fast_paths, threads
from fedlap_privacy.compute.threads import (
    LoadFollower,
    apply_thread_policy,
    cgroup_cpu_limit,
    explicit_threads,
    threads_for,
    usable_cpus,
)
from fedlap_privacy.errors import ConfigError


@pytest.fixture
def eight_cpus(monkeypatch, tmp_path):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(8)))
    path = tmp_path / "cpu.max"
    path.write_text("max 100000\n")
    return path


def test_cgroup_quota_parsing(tmp_path):
    path = tmp_path / "cpu.max"
    assert cgroup_cpu_limit(tmp_path / "absent") is None
    path.write_text("max 100000\n")
    assert cgroup_cpu_limit(path) is None
    path.write_text("250000 100000\n")
    assert cgroup_cpu_limit(path) == 2.5
    path.write_text("garbage\n")
    assert cgroup_cpu_limit(path) is None


def test_usable_cpus_is_affinity_capped_by_quota(eight_cpus):
    assert usable_cpus(eight_cpus) == 8
    eight_cpus.write_text("300000 100000\n")
    assert usable_cpus(eight_cpus) == 3
    eight_cpus.write_text("50000 100000\n")  # half a CPU still gets one thread
    assert usable_cpus(eight_cpus) == 1


def test_cpus_divided_among_workers(eight_cpus):
    env: dict[str, str] = {}
    assert threads_for(1, env=env, cgroup_path=eight_cpus) == 8
    assert threads_for(3, env=env, cgroup_path=eight_cpus) == 2
    assert threads_for(16, env=env, cgroup_path=eight_cpus) == 1
    assert threads_for(env={"FEDLAP_WORKERS": "4"}, cgroup_path=eight_cpus) == 2
    assert threads_for(env={"FEDLAP_WORKERS": "junk"}, cgroup_path=eight_cpus) == 8
    with pytest.raises(ConfigError):
        threads_for(0, env=env, cgroup_path=eight_cpus)


def test_explicit_settings_win(eight_cpus):
    assert explicit_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert explicit_threads({"MKL_NUM_THREADS": "5"}) == 5
    assert explicit_threads({"OMP_NUM_THREADS": "0", "MKL_NUM_THREADS": "x"}) is None
    env = {"OMP_NUM_THREADS": "3", "FEDLAP_WORKERS": "8"}
    assert threads_for(4, env=env, cgroup_path=eight_cpus) == 3
    assert threads_for(4, requested=6, env=env, cgroup_path=eight_cpus) == 6
    with pytest.raises(ConfigError):
        threads_for(requested=0, env=env)


def test_apply_sets_torch_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda path=None: None)
    try:
        assert apply_thread_policy(workers=2) == 1 and torch.get_num_threads() == 1
        assert apply_thread_policy(requested=2) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_runtime_defaults_respect_the_users_settings():
    from fedlap_privacy.compute.runtime_env import apply_runtime_defaults

    env = {"THP_MEM_ALLOC_ENABLE": "0"}
    assert apply_runtime_defaults(env) == {}
    assert env == {"THP_MEM_ALLOC_ENABLE": "0"}
    assert apply_runtime_defaults({}) == {"THP_MEM_ALLOC_ENABLE": "1"}


def _stat(path, busy_ticks: list[int]) -> None:
    """A /proc/stat with one line per CPU: busy ticks in user, nothing idle counted."""
    path.write_text("cpu  0 0 0 0 0 0 0 0\n" + "".join(
        f"cpu{i} {t} 0 0 999 0 0 0 0 0 0\n" for i, t in enumerate(busy_ticks)))


def test_threads_follow_the_cpus_other_processes_leave_idle(tmp_path, monkeypatch):
    """One busy process on a 2-CPU machine: one thread (the other would spin on the busy
    core); the machine idle again: back to two."""
    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    clock = iter([100.0, 101.0, 102.0, 103.0])
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    own = os.times()
    monkeypatch.setattr(threads.os, "times", lambda: own)  # this process took no CPU time
    _stat(stat, [0, 0])
    follower = LoadFollower(2, frozenset({0, 1}), stat=stat)
    _stat(stat, [hz, 0])  # another process kept CPU 0 busy for the whole second
    assert follower.threads_now() == 1
    _stat(stat, [hz + hz // 10, hz // 10])  # then 0.2 CPU of others' work: both are ours
    assert follower.threads_now() == 2
    _stat(stat, [3 * hz, 2 * hz])  # both busy: still one thread, never none
    assert follower.threads_now() == 1


def test_own_cpu_time_is_not_counted_as_others_load():
    before = threads.LoadSample(wall=0.0, busy=10.0, own=1.0)
    after = threads.LoadSample(wall=1.0, busy=12.0, own=3.0)  # our two threads, busy
    assert threads.others_busy(before, after) == 0.0
    assert threads.others_busy(before, threads.LoadSample(1.0, 12.0, 2.0)) == 1.0


def test_load_following_is_off_where_the_count_was_chosen(monkeypatch):
    monkeypatch.setattr(threads, "tune_allocator", lambda: None)
    monkeypatch.setattr("fedlap_privacy.compute.kernels.library.load_kernels", lambda: None)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "usable_cpus", lambda *a: 2)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", threads.FOLLOW_ENV, threads.WORKERS_ENV):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    try:
        threads.apply_cpu_policy()
        assert threads._follower is not None
        threads.apply_cpu_policy(requested=2)
        assert threads._follower is None
        threads.apply_cpu_policy(follow=False)
        assert threads._follower is None
        monkeypatch.setenv(threads.FOLLOW_ENV, "0")
        threads.apply_cpu_policy()
        assert threads._follower is None
    finally:
        threads._follower = None
        torch.set_num_threads(before)


def test_threads_are_bounded_by_the_cpus_the_process_may_use(monkeypatch):
    """``--threads 300`` on 2 CPUs started 602 threads silently (100000: a MemoryError
    traceback): a count above the affinity mask is refused, naming the limit."""
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    assert threads_for(requested=2, env={}) == 2
    for asked in (3, 300, 100_000):
        with pytest.raises(ConfigError, match=f"--threads {asked}: at most 2, the CPUs"):
            threads_for(requested=asked, env={})


@pytest.mark.parametrize("command", ["train", "audit", "compare"])
def test_too_many_threads_is_one_line_before_anything_runs(command, tmp_path):
    from typer.testing import CliRunner

    from fedlap_privacy.cli.main import app

    before = torch.get_num_threads()
    limit = len(os.sched_getaffinity(0))
    args = {"train": ["--out", str(tmp_path / "run")],
            "audit": ["--model", str(tmp_path / "ckpt.pt")],
            "compare": ["--eps", "3", "--out", str(tmp_path / "cmp")]}[command]
    result = CliRunner().invoke(app, [command, *args, "--threads", "100000", "--dry-run"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip() == (f"error: --threads 100000: at most {limit}, the CPUs "
                                     "this process may run on (its CPU affinity)")
    assert torch.get_num_threads() == before and not any(tmp_path.iterdir())


def test_a_fresh_look_forgets_the_load_of_the_wait(tmp_path, monkeypatch):
    """A Flower ServerApp waits while its nodes keep both cores busy; once they are done, its
    own step looks at the next moment only (two threads), not at the wait (one)."""
    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    clock = iter([100.0, 400.0, 400.0, 400.1])
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(threads.time, "sleep", lambda s: _stat(stat, [300 * hz, 300 * hz]))
    own = os.times()
    monkeypatch.setattr(threads.os, "times", lambda: own)
    _stat(stat, [0, 0])
    follower = LoadFollower(2, frozenset({0, 1}), stat=stat)
    _stat(stat, [300 * hz, 300 * hz])  # the nodes: both cores busy for 300 s
    monkeypatch.setattr(threads, "_follower", follower)
    before = torch.get_num_threads()
    try:
        with fast_paths.using(follow_load=True):
            torch.set_num_threads(2)
            threads.follow_load()  # the wait counted: both cores looked busy
            assert torch.get_num_threads() == 1
            threads.follow_load(fresh=True)  # idle during the fresh look
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


_ENVIRON_AFTER = """
import json, os, sys
before = dict(os.environ)
for name in sys.argv[1:]:
    __import__(name)
print(json.dumps([before, dict(os.environ)]))
"""


@pytest.mark.parametrize("module", ["fedlap_privacy.accountant", "fedlap_privacy",
                                    "fedlap_privacy.cli.main"])
def test_importing_the_package_leaves_the_environment_alone(module):
    """An Opacus program that imports the accountant (or the package, or its command's
    module) keeps its environment as it was: only an entry point that starts sets torch's
    defaults (the command's ``main`` callback below)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    done = subprocess.run([sys.executable, "-c", _ENVIRON_AFTER, module], env=env,
                          capture_output=True, text=True, check=True)
    before, after = json.loads(done.stdout)
    assert after == before and "THP_MEM_ALLOC_ENABLE" not in after


def test_the_command_sets_the_defaults_before_torch_loads():
    import json
    import subprocess
    import sys

    code = ("import json, os, sys\nfrom fedlap_privacy.cli.main import main\nmain()\n"
            "print(json.dumps([os.environ.get('THP_MEM_ALLOC_ENABLE'), 'torch' in sys.modules]))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("THP_MEM_ALLOC_ENABLE", "FEDLAP_FAST_PATHS")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True)
    assert json.loads(done.stdout) == ["1", False]
