"""Environment defaults that torch reads once, when it loads: set before the first ``import torch``.

Two settings, each applied only where the user set nothing of their own:

``THP_MEM_ALLOC_ENABLE=1``
    torch's CPU allocator backs large tensors with transparent huge pages: fewer page faults on
    the large per-record gradient tensors (1.5-2x on the DP step, ``benchmarks/dp_step.py``).

``OMP_WAIT_POLICY=PASSIVE``
    torch's CPU build runs its intra-op threads on GNU OpenMP, whose idle worker threads spin
    for about 300,000 iterations (a few milliseconds) at the end of every parallel region
    before they sleep. A training step runs thousands of small parallel regions, so when
    another busy process shares the cores (a second job, another user's training, co-located
    Flower nodes) the spinning threads take the CPU time the working thread needs: a default
    two-round ``train`` beside one busy torch process was measured 6x to 34x slower than alone
    on a 2-core machine. Passive waiting sleeps at once; ``benchmarks/threads.py`` measures the
    whole run alone and beside a busy torch process, spinning and passive, in one go.

    Left alone when the user set ``OMP_WAIT_POLICY`` or GNU OpenMP's own ``GOMP_SPINCOUNT``.

Every entry point gets these through the package's ``__init__`` (the CLI, Flower's ClientApp
and ServerApp modules, the Python API), as long as ``fedlap_privacy`` is imported before
torch: a program that imports torch first keeps torch's defaults (set ``OMP_WAIT_POLICY``
yourself there). Child processes inherit the variables, as with any environment setting.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["RUNTIME_DEFAULTS", "apply_runtime_defaults"]

#: variable -> (value set by default, variables whose presence means the user chose)
RUNTIME_DEFAULTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "THP_MEM_ALLOC_ENABLE": ("1", ()),
    "OMP_WAIT_POLICY": ("PASSIVE", ("GOMP_SPINCOUNT",)),
}


def apply_runtime_defaults(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each of :data:`RUNTIME_DEFAULTS` the user did not set (nor a variable that stands
    for the same choice); returns what was set. Only effective before torch loads."""
    env = os.environ if env is None else env
    applied = {}
    for name, (value, same_choice) in RUNTIME_DEFAULTS.items():
        if name in env or any(other in env for other in same_choice):
            continue
        env[name] = value
        applied[name] = value
    return applied
