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


def _gomp_spin_count(code: str, **env: str) -> str:
    """GNU OpenMP's spin count in a fresh process running ``code``, as libgomp reports it when
    it loads (OMP_DISPLAY_ENV=verbose)."""
    import os
    import re
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_DISPLAY_ENV")}
    out = subprocess.run([sys.executable, "-c", code], env=base | env | {
        "OMP_DISPLAY_ENV": "verbose"}, capture_output=True, text=True, check=True)
    return re.search(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr).group(1)


def test_openmp_threads_wait_passively_unless_the_user_chose():
    """Spinning OpenMP threads made a 2-round train 34x slower beside one busy torch process:
    importing the package (every entry point does, before torch) makes them sleep at once."""
    assert _gomp_spin_count("import torch") == "300000"  # torch alone: libgomp spins
    assert _gomp_spin_count("import fedlap_privacy.cli.main, torch") == "0"
    assert _gomp_spin_count("import fedlap_privacy, torch", OMP_WAIT_POLICY="ACTIVE") != "0"
    assert _gomp_spin_count("import fedlap_privacy, torch", GOMP_SPINCOUNT="5000") == "5000"


def test_runtime_defaults_respect_the_users_settings():
    from fedlap_privacy.runtime_env import apply_runtime_defaults

    env = {"THP_MEM_ALLOC_ENABLE": "0"}
    assert apply_runtime_defaults(env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"THP_MEM_ALLOC_ENABLE": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    assert apply_runtime_defaults({"GOMP_SPINCOUNT": "10"}) == {"THP_MEM_ALLOC_ENABLE": "1"}
