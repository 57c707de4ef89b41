"""Environment defaults that torch reads once, when it loads: set before the first ``import torch``.

``THP_MEM_ALLOC_ENABLE=1`` (unless the user set it): torch's CPU allocator backs large
tensors with transparent huge pages, so the large per-record gradient tensors cost fewer page
faults (1.5-2x on the DP step, ``benchmarks/dp_step.py``). It is the ``huge_pages`` fast path
(:mod:`fedlap_privacy.fast_paths`): ``FEDLAP_FAST_PATHS=off`` (or ``-huge-pages``) leaves
torch's default.

Every entry point gets it through the package's ``__init__`` (the CLI, Flower's ClientApp and
ServerApp modules, the Python API), as long as ``fedlap_privacy`` is imported before torch
allocates: a program that uses torch first keeps torch's default. Child processes inherit the
variable, as with any environment setting.

OpenMP's wait policy is deliberately left to torch: passive waiting (``OMP_WAIT_POLICY=
PASSIVE``) keeps idle threads from spinning on a busy machine, but made a default two-round
``train`` 1.5-1.75x slower alone on 2 cores (``benchmarks/threads.py``); the thread count
follows the load instead (:class:`fedlap_privacy.threads.LoadFollower`).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fast_paths import FastPaths

__all__ = ["RUNTIME_DEFAULTS", "apply_runtime_defaults"]

#: variable -> the value set where the user set none
RUNTIME_DEFAULTS: dict[str, str] = {"THP_MEM_ALLOC_ENABLE": "1"}


def apply_runtime_defaults(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each of :data:`RUNTIME_DEFAULTS` the user did not set, where the huge-pages fast
    path is on; returns what was set. Only effective before torch allocates. A fast-path
    variable with a bad value is left to the command's start-up to report (one line)."""
    env = os.environ if env is None else env
    applied: dict[str, str] = {}
    try:
        if not FastPaths.from_env(env).huge_pages:
            return applied
    except ConfigError:
        pass
    for name, value in RUNTIME_DEFAULTS.items():
        if name not in env:
            env[name] = value
            applied[name] = value
    return applied
