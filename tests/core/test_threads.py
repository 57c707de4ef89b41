"""The intra-op thread policy (fedlap_privacy.threads): explicit settings win, otherwise the
usable CPUs (affinity, cgroup quota) divided among the co-located workers."""

from __future__ import annotations

import pytest
import torch

from fedlap_privacy import threads
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.threads import (
    apply_thread_policy,
    cgroup_cpu_limit,
    explicit_threads,
    threads_for,
    usable_cpus,
)


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
