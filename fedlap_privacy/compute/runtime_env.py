"""Environment defaults that torch reads once, when it loads: set before the first ``import torch``.

``THP_MEM_ALLOC_ENABLE=1`` (unless the user set it): torch's CPU allocator backs large
tensors with transparent huge pages, so the large per-record gradient tensors cost fewer page
faults (1.5-2x on the DP step, ``benchmarks/speed/dp_step.py``). It is the ``huge_pages`` fast path
(:mod:`fedlap_privacy.compute.fast_paths`): ``FEDLAP_FAST_PATHS=off`` (or ``-huge-pages``) leaves
torch's default.

Importing the package changes no environment (an Opacus program that imports the
accountant keeps its own): the package's entry points set it as they start, before torch
loads: the ``fedlap-privacy`` command (its ``main`` callback, before any sub-command
imports torch) and the local deployment's environment for Flower's processes
(:class:`fedlap_privacy.fl.flower.deployment.LocalDeployment`); the processes they start
(Flower's SuperLink, SuperNodes and their app processes, the Simulation Engine's Ray
workers) inherit it. A program of the user's (the Python API, a SuperNode run with Flower's own
commands) keeps torch's default unless it sets ``THP_MEM_ALLOC_ENABLE=1`` itself.

OpenMP's wait policy is deliberately left to torch: passive waiting (``OMP_WAIT_POLICY=
PASSIVE``) keeps idle threads from spinning on a busy machine, but made a default two-round
``train`` 1.5-1.75x slower alone on 2 cores (``benchmarks/speed/threads.py``); the thread count
follows the load instead (:class:`fedlap_privacy.compute.threads.LoadFollower`).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from fedlap_privacy.compute.fast_paths import FastPaths
from fedlap_privacy.errors import ConfigError

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
