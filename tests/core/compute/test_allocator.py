"""The C-allocator setting (fedlap_privacy.compute.allocator): freed tensor memory is reused instead
of being unmapped and page-faulted again, unless the user chose the allocator."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from fedlap_privacy.compute.allocator import AllocatorState, tune_allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Minor page faults of the fourth forward+backward of the 28x28 ConvNet on 64 records (the
# first three warm up): every fault is a page the allocator had unmapped and maps anew. The
# ConvNet runs its modules (FEDLAP_KERNELS=off): the workload whose faults were measured.
_FAULTS = """
import resource, torch, torch.nn.functional as F
from fedlap_privacy.compute.allocator import tune_allocator
from fedlap_privacy.models import ModelConfig, build_model
setting = tune_allocator()
model = build_model(ModelConfig(1, 28, 10))
x, y = torch.randn(64, 1, 28, 28), torch.zeros(64, dtype=torch.int64)
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    F.cross_entropy(model(x), y).backward()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(setting.state.value, faults)
"""


def _second_allocation_faults(allocator: str) -> tuple[str, int]:
    # huge pages off: the package turns them on (fedlap_privacy.compute.runtime_env), and each huge
    # page is one fault where 512 small ones would show the allocator's work
    env = {"FEDLAP_ALLOCATOR": allocator, "FEDLAP_KERNELS": "off", "OMP_NUM_THREADS": "1",
           "THP_MEM_ALLOC_ENABLE": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_tuned_allocator_reuses_freed_memory():
    state, tuned = _second_allocation_faults("tuned")
    assert state == "tuned"
    system_state, system = _second_allocation_faults("system")
    assert system_state == "system"
    # measured: about 70,000 faults (280 MB of fresh pages) a step with glibc's defaults;
    # tuned none, or one 32 MiB block (8,000) when the heap is fragmented
    assert system > 40_000
    assert tuned < system / 4


def test_user_choices_are_left_alone():
    assert tune_allocator({"FEDLAP_ALLOCATOR": "system"}).state is AllocatorState.SYSTEM
    for env in ({"MALLOC_ARENA_MAX": "2"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"},
                {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}):
        setting = tune_allocator(env)
        assert setting.state is AllocatorState.SYSTEM and setting.reason
    with pytest.raises(ValueError, match="FEDLAP_ALLOCATOR"):
        tune_allocator({"FEDLAP_ALLOCATOR": "jemalloc"})


def test_bad_allocator_choice_is_one_line(monkeypatch):
    from typer.testing import CliRunner

    from fedlap_privacy.cli.main import app

    result = CliRunner().invoke(app, ["train", "--rounds", "1"],
                                env={"FEDLAP_ALLOCATOR": "fast"})
    assert result.exit_code == 2
    assert "FEDLAP_ALLOCATOR" in result.output and "Traceback" not in result.output
