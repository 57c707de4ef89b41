"""Compile the package's C kernels once per machine and load them with :mod:`ctypes`.

The kernels (``gn_relu_pool.c``, ``cosine_rows.c``) are plain C with no Python or torch
headers, so a build takes well under a second with the system C compiler (``$CC``, else
``cc``), optimised for the processor it runs on (``-O3 -march=native``, retried without
``-march=native`` where the compiler refuses it). The shared library is cached in
``$FEDLAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/fedlap-privacy``, else
``~/.cache/fedlap-privacy``, under a name that hashes the sources, the flags, the compiler
and the processor's feature flags, so that an edited source, another compiler or a home
directory shared with another machine never loads a stale or foreign build. The cache
directory is created private (mode 0700), and one that another user owns or others may write
to is not used: a library from it would run with the caller's rights. Builds are written
under a temporary name and renamed into place, so processes that start together (Flower
nodes) never load a partly written file.

``FEDLAP_KERNELS`` chooses: ``auto`` (the default) uses the kernels and, where they cannot
be built (no compiler, say), warns once and falls back to torch's own kernels, which compute
the same function; ``off`` always uses torch's kernels; ``require`` raises
:class:`~fedlap_privacy.errors.ConfigError` instead of falling back (CI uses it, so that a
broken build cannot pass unnoticed).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from fedlap_privacy.errors import ConfigError

__all__ = [
    "CACHE_ENV",
    "KERNELS_ENV",
    "MODES",
    "KernelLibrary",
    "kernel_mode",
    "load_kernels",
]

KERNELS_ENV = "FEDLAP_KERNELS"
CACHE_ENV = "FEDLAP_CACHE_DIR"
MODES = ("auto", "off", "require")
SOURCES = tuple(Path(__file__).with_name(name) for name in ("gn_relu_pool.c", "cosine_rows.c"))
_BASE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp-simd")
_NATIVE_FLAG = "-march=native"
_COMPILE_TIMEOUT_S = 120
# the sources once per scalar type: FN(name) is the exported name for that type
_INCLUDES = "".join(f'#include "{source.name}"\n' for source in SOURCES)
_WRAPPER = f"""#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#define scalar_t float
#define FN(name) name##_f32
{_INCLUDES}#undef scalar_t
#undef FN
#define scalar_t double
#define FN(name) name##_f64
{_INCLUDES}"""

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
#: argument types of each exported function (the same for both scalar types)
SIGNATURES: dict[str, list[type]] = {
    # z, gamma, beta, eps, C, H, W, p0, p1, out, mean, rstd
    "gnrp_forward": [_P, _P, _P, _D, _I, _I, _I, _I, _I, _P, _P, _P],
    # z, gp, gamma, beta, mean, rstd, C, H, W, p0, p1, gz, sgx, sgy
    "gnrp_backward": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _P, _P, _P],
    # z, gp, gamma, beta, mean, rstd, u, ug, ub, C, H, W, p0, p1, dz, dgp, dgam
    "gnrp_double_backward": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _P, _P,
                             _P],
    # a, b, start, norm_a, weight, eps, mse, r0, r1, grad
    "cosine_rows_grad": [_P, _P, _P, _P, _P, _D, _D, _I, _I, _P],
}
SUFFIXES = ("_f32", "_f64")


@dataclass(frozen=True)
class KernelLibrary:
    """The loaded kernels: ``function(name, suffix)`` returns a typed ctypes function."""

    library: ctypes.CDLL
    path: Path

    def function(self, name: str, suffix: str) -> ctypes._CFuncPtr:
        return getattr(self.library, name + suffix)


def kernel_mode() -> str:
    """``FEDLAP_KERNELS`` (``auto`` when unset), checked."""
    mode = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ConfigError(f"{KERNELS_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the architecture and the processor's features."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{flags.strip()}"


def _cache_dir() -> Path:
    """A private directory for builds: the configured cache, else a fresh temporary one."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        root = Path(configured)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(base) / "fedlap-privacy"
    path = root / "kernels"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
        owner_ok = not hasattr(os, "getuid") or st.st_uid == os.getuid()
        if owner_ok and not st.st_mode & 0o022:
            return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="fedlap-kernels-"))


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Build the library at ``target`` (atomically); None on success, else the reason."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    cmd = [compiler, *flags, "-I", str(SOURCES[0].parent), "-x", "c", "-", "-o", str(tmp), "-lm"]
    try:
        done = subprocess.run(cmd, input=_WRAPPER, capture_output=True, text=True,
                              timeout=_COMPILE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{compiler}: {exc}"
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{compiler} exited {done.returncode}: {last}"
    os.replace(tmp, target)
    return None


def _build() -> KernelLibrary:
    """Load the cached build for this source/compiler/processor, building it if needed."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler found ({compiler!r}; set CC)")
    source = b"\0".join(path.read_bytes() for path in SOURCES)
    directory = _cache_dir()
    reasons = []
    for flags in ((*_BASE_FLAGS, _NATIVE_FLAG), _BASE_FLAGS):
        key = hashlib.sha256(b"\0".join(
            [source, _WRAPPER.encode(), " ".join(flags).encode(), compiler.encode(),
             _cpu_signature().encode()])).hexdigest()[:20]
        target = directory / f"kernels-{key}.so"
        reason = None if target.exists() else _compile(compiler, flags, target)
        if reason is not None:
            reasons.append(reason)
            continue
        try:
            library = ctypes.CDLL(str(target))
        except OSError:  # a damaged cache entry: build it again, once
            target.unlink(missing_ok=True)
            reason = _compile(compiler, flags, target)
            if reason is not None:
                reasons.append(reason)
                continue
            library = ctypes.CDLL(str(target))
        for name, argtypes in SIGNATURES.items():
            for suffix in SUFFIXES:
                fn = getattr(library, name + suffix)
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
        return KernelLibrary(library, target)
    raise OSError("; ".join(reasons))


@functools.cache
def _load() -> KernelLibrary | str:
    try:
        return _build()
    except (OSError, AttributeError) as exc:  # no compiler, failed build, missing symbol
        return str(exc) or type(exc).__name__


def load_kernels() -> KernelLibrary | None:
    """The kernels, or None where ``FEDLAP_KERNELS=off`` or (``auto``) they cannot be built.

    Built and loaded once per process. ``auto`` warns once when it falls back; ``require``
    raises :class:`~fedlap_privacy.errors.ConfigError` with the reason instead.
    """
    mode = kernel_mode()
    if mode == "off":
        return None
    loaded = _load()
    if isinstance(loaded, KernelLibrary):
        return loaded
    if mode == "require":
        raise ConfigError(f"{KERNELS_ENV}=require, but the C kernels could not be built: "
                          f"{loaded}")
    _warn_fallback(loaded)
    return None


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"fedlap-privacy runs torch's kernels instead of its fused C kernels "
                  f"(slower, same results): {reason}", RuntimeWarning, stacklevel=3)
