"""Which of the package's fast paths run: the one place that decides
(docs/performance.md#switching-the-fast-paths-off).

Every fast path computes what a reference implementation computes, up to floating-point
rounding, in less time or memory; switched off, the reference twin runs:

* ``kernels``: the fused C kernels (:mod:`fedlap_privacy.compute.kernels`): the ConvNet's GroupNorm
  -> ReLU -> 2x2 pooling block in the forward (:meth:`fedlap_privacy.models.ConvNet.fused_blocks`),
  backward and double backward (:mod:`fedlap_privacy.compute.kernels.block`). Off: torch's
  modules one by one.
* ``second_order``: the written-out matching gradient and first-order weight gradient of
  the ConvNet (:mod:`fedlap_privacy.compute.second_order`, with the augmentation's adjoint in closed
  form). Off: autograd differentiates its own backward graph (``create_graph=True``).
  It runs on the kernels, so it is off where they are.
* ``per_sample``: the ConvNet's per-record gradients through the fused blocks and a backward
  written out layer by layer (:mod:`fedlap_privacy.compute.per_sample`, ``"fused"``). Off: the
  Opacus-style hook path, else ``torch.func.vmap(grad)``. It runs on the kernels too.
* ``ghost_clipping``: a DP gradient's clipped sum from every record's gradient norm (ghost
  norms) and one weighted sum per layer (book-keeping), without forming the per-record
  gradients of the layers where the norm is cheaper (:mod:`fedlap_privacy.compute.ghost_clipping`).
  Off: every record's gradient through the ``per_sample`` path (or its twin), clipped and
  summed.
* ``winograd``: the ConvNet's 3x3 convolutions of at least 128 channels through Winograd's
  F(4x4, 3x3) (:mod:`fedlap_privacy.compute.kernels.winograd`): the forward and input gradients of
  the fused per-record pass, the ghost-clipping sum's weight gradient, the written-out
  matching step and the local and server steps. Off: torch's convolutions. It runs on the
  kernels too.
* ``allocator``: freed tensor memory kept in the process (:mod:`fedlap_privacy.compute.allocator`).
  Off: glibc's defaults. Applied once, at a command's start-up.
* ``follow_load``: torch's threads follow the machine's load
  (:mod:`fedlap_privacy.compute.threads`).
  Off: the thread count the policy fixed at start-up.
* ``huge_pages``: torch's CPU allocator backs large tensors with transparent huge pages
  (:mod:`fedlap_privacy.compute.runtime_env`). Off: torch's default. Read by torch when it loads,
  so only the environment switches it.

The environment is read once, on first use: ``FEDLAP_FAST_PATHS=off`` switches every path
off; ``FEDLAP_FAST_PATHS=-second-order,-per-sample`` (say) switches off the paths named;
``on`` (the default) leaves them on. The per-path variables keep working:
``FEDLAP_KERNELS=auto|off|require`` (``require``: kernels that cannot be loaded are an error
instead of a warning and torch's kernels), ``FEDLAP_ALLOCATOR=tuned|system`` and
``FEDLAP_FOLLOW_LOAD=0``. A path is on only where both its variable and
``FEDLAP_FAST_PATHS`` leave it on. Nothing else in the package reads these variables.

In a program, :func:`disabled` switches paths off for a block (all of them by default) and
:func:`using` sets any field of :class:`FastPaths`; both are process-wide (every thread
sees them) and nest. :func:`current` is what the paths ask.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from fedlap_privacy.errors import ConfigError

__all__ = [
    "ALLOCATOR_CHOICES",
    "ALLOCATOR_ENV",
    "FAST_PATHS_ENV",
    "FOLLOW_ENV",
    "KERNELS_ENV",
    "KERNEL_MODES",
    "PATHS",
    "FastPaths",
    "current",
    "disabled",
    "refresh",
    "using",
]

#: ``on`` (default), ``off``, or ``-name`` tokens (comma-separated) switching paths off
FAST_PATHS_ENV = "FEDLAP_FAST_PATHS"
#: ``auto`` (default), ``off`` or ``require``: the fused C kernels
KERNELS_ENV = "FEDLAP_KERNELS"
#: ``tuned`` (default) or ``system``: the C allocator setting
ALLOCATOR_ENV = "FEDLAP_ALLOCATOR"
#: ``0`` keeps the thread count fixed
FOLLOW_ENV = "FEDLAP_FOLLOW_LOAD"

KERNEL_MODES = ("auto", "off", "require")
ALLOCATOR_CHOICES = ("tuned", "system")


@dataclass(frozen=True)
class FastPaths:
    """Which fast paths are on (module docstring). ``require_kernels``: kernels that cannot be
    loaded raise :class:`~fedlap_privacy.errors.ConfigError` (where ``kernels`` is on)."""

    kernels: bool = True
    second_order: bool = True
    per_sample: bool = True
    ghost_clipping: bool = True
    winograd: bool = True
    allocator: bool = True
    follow_load: bool = True
    huge_pages: bool = True
    require_kernels: bool = False

    @classmethod
    def all_off(cls) -> FastPaths:
        """Every path off: the reference implementations."""
        return cls(**dict.fromkeys(PATHS, False))

    def without(self, *names: str) -> FastPaths:
        """This record with the paths ``names`` (all where none is given) off."""
        return dataclasses.replace(self, **dict.fromkeys(
            [_path_name(n) for n in names] if names else PATHS, False))

    def effective(self) -> FastPaths:
        """The paths that can run: ``second_order``, ``per_sample`` and ``winograd`` run on
        the kernels."""
        return dataclasses.replace(self, second_order=self.second_order and self.kernels,
                                   per_sample=self.per_sample and self.kernels,
                                   winograd=self.winograd and self.kernels)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FastPaths:
        """The record the variables in ``env`` ask for (module docstring); a value that is
        not one of theirs raises :class:`~fedlap_privacy.errors.ConfigError`."""
        paths = cls()
        for token in (t.strip().lower() for t in env.get(FAST_PATHS_ENV, "on").split(",")):
            if token in ("", "on"):
                continue
            if token == "off":
                paths = paths.without()
            elif token.startswith("-") and token[1:].replace("-", "_") in PATHS:
                paths = paths.without(token[1:])
            else:
                raise ConfigError(
                    f"{FAST_PATHS_ENV} must be 'on', 'off' or '-name' items (comma-separated) "
                    f"with a name among {', '.join(_env_names())}, got {token!r}")
        kernels = env.get(KERNELS_ENV, "auto").strip().lower() or "auto"
        if kernels not in KERNEL_MODES:
            raise ConfigError(f"{KERNELS_ENV} must be one of {', '.join(KERNEL_MODES)}, "
                              f"got {kernels!r}")
        allocator = env.get(ALLOCATOR_ENV, "tuned").strip().lower() or "tuned"
        if allocator not in ALLOCATOR_CHOICES:
            raise ConfigError(f"{ALLOCATOR_ENV} must be 'tuned' or 'system', got {allocator!r}")
        return dataclasses.replace(
            paths,
            kernels=paths.kernels and kernels != "off",
            require_kernels=kernels == "require",
            allocator=paths.allocator and allocator == "tuned",
            follow_load=paths.follow_load and env.get(FOLLOW_ENV, "1").strip() != "0",
        )


#: the switchable paths: the boolean fields of :class:`FastPaths` but ``require_kernels``
PATHS = tuple(f.name for f in dataclasses.fields(FastPaths) if f.name != "require_kernels")


def _env_names() -> list[str]:
    return [name.replace("_", "-") for name in PATHS]


def _path_name(name: str) -> str:
    field = name.strip().lower().replace("-", "_")
    if field not in PATHS:
        raise ConfigError(f"unknown fast path {name!r}; one of {', '.join(_env_names())}")
    return field


@functools.cache
def _from_environment() -> FastPaths:
    return FastPaths.from_env(os.environ)


_lock = threading.Lock()
_override: FastPaths | None = None


def current() -> FastPaths:
    """The fast paths in force: the innermost :func:`using` / :func:`disabled` block's, else
    the environment's (read once; :func:`refresh` reads it again)."""
    override = _override
    return override if override is not None else _from_environment()


def refresh() -> FastPaths:
    """Read the environment again (for a program that changed it) and return the result."""
    _from_environment.cache_clear()
    return current()


@contextmanager
def using(paths: FastPaths | None = None, **changes: bool) -> Iterator[FastPaths]:
    """Within the block, ``paths`` (default: the paths in force) with ``changes`` applied,
    e.g. ``using(second_order=False)`` or ``using(require_kernels=True)``. Process-wide."""
    global _override
    chosen = dataclasses.replace(current() if paths is None else paths, **changes)
    with _lock:
        previous, _override = _override, chosen
    try:
        yield chosen
    finally:
        with _lock:
            _override = previous


@contextmanager
def disabled(*names: str) -> Iterator[FastPaths]:
    """Within the block, the paths ``names`` (``"kernels"``, ``"second-order"``, ...) are
    off, every path where none is named: the reference implementations run."""
    with using(current().without(*names)) as paths:
        yield paths
