"""Long scheduler slices for a worker sharing its cores (fedlap_privacy.time_slices): asked
for only where the process runs fewer torch threads than its CPUs and the path is on, with
the process's nice value kept; what the kernel then reports (``sched_getattr``) is the slice
asked for. Each check runs in a fresh process, so that the test process keeps its own; a
child inherits its parent's slice (a worker that ran a ClientApp test has asked), so each
first goes back to the kernel's own (a request of 0)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from fedlap_privacy.threads import usable_cpus

_SCRIPT = """
import ctypes, os, struct, sys
import torch
from fedlap_privacy import fast_paths, time_slices
calls = {"x86_64": (314, 315), "aarch64": (274, 275)}[os.uname().machine]
libc = ctypes.CDLL(None)
own = struct.pack("IIQiIQQQII", 56, 0, 8, os.getpriority(os.PRIO_PROCESS, 0), 0, 0, 0, 0, 0, 0)
assert libc.syscall(calls[0], 0, ctypes.create_string_buffer(own), 0) == 0
torch.set_num_threads(int(sys.argv[1]))
os.nice(3)
with fast_paths.using(long_slices=sys.argv[2] == "on"):
    asked = time_slices.share_cores_in_long_slices()
buf = ctypes.create_string_buffer(56)
libc.syscall(calls[1], 0, buf, 56, 0)
attr = struct.unpack("IIQiIQQQII", buf.raw)
print(asked, attr[3], attr[5])
"""


def _run(threads: int, switch: str) -> tuple[str, int, int]:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(threads), switch],
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], int(out[1]), int(out[2])


def _kernel_at_least(major: int, minor: int) -> bool:
    parts = platform.release().split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= (major, minor)
    except (ValueError, IndexError):
        return False


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64")
                    or not _kernel_at_least(6, 12) or usable_cpus() < 2,
                    reason="custom slices of the normal policy need Linux 6.12 and 2 CPUs")
def test_a_worker_sharing_its_cores_runs_in_long_slices_and_keeps_its_nice_value():
    from fedlap_privacy.time_slices import LONG_SLICE_NS

    asked, nice, runtime = _run(1, "on")
    assert (asked, nice, runtime) == ("True", 3, LONG_SLICE_NS)
    alone = _run(usable_cpus(), "on")  # every CPU its own threads': nothing asked
    off = _run(1, "off")
    for result in (alone, off):
        assert result[0] == "False" and result[1] == 3 and result[2] != LONG_SLICE_NS
