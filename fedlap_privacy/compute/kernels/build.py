"""Compile the package's C kernels once per machine and load them with :mod:`ctypes`.

The kernels (``gn_relu_pool.c``, ``winograd.c``) are plain C with no Python or torch
headers, so a build takes about two seconds with the system C compiler (``$CC``, else
``cc``), optimised for the processor it runs on (``-O3 -march=native``, retried without
``-march=native`` where the compiler refuses it). The shared library is cached in
``$FEDLAP_CACHE_DIR/kernels``, else ``$XDG_CACHE_HOME/fedlap-privacy/kernels``, else
``~/.cache/fedlap-privacy/kernels``, under a name that hashes the sources, the flags, the
compiler and the processor's feature flags, so that an edited source, another compiler or a
home directory shared with another machine never loads a stale or foreign build.

A library loaded with ctypes runs with the caller's rights, so another user must not be able
to choose it (issue 33):

* the cache is used only where no component of its path can be changed by another user
  (:mod:`~fedlap_privacy.compute.kernels.private_dir`: owned by the caller or root, not writable by
  others but for a sticky ancestor such as /tmp, no link but root's), and then only through
  the descriptor of the directory that was checked; an unsafe one is refused with one
  warning naming the component, and the kernels are built in a fresh private directory under
  the temporary directory instead (checked the same way; removed once loaded);
* each build runs in a fresh private directory (mode 0700) inside the cache, on copies of
  the very source bytes the cache key hashes, written there and compiled by their path from
  there: a quoted ``#include`` is looked up beside the file that includes it first, so no
  ``winograd.c`` of the working folder (or any other folder) is ever compiled in; the library's
  SHA-256 is recorded in a manifest (``kernels-<key>.sha256``, as ``sha256sum`` writes it),
  and both are renamed into place atomically, so processes that start together (Flower
  nodes) never load a partly written file;
* a cached library is read through a descriptor and its bytes checked against the
  manifest's SHA-256 (a mismatch is warned and rebuilt, never loaded); the verified bytes are
  loaded from a copy in a fresh private directory named through its descriptor, so nothing
  can be swapped in between the check and ``dlopen``.

Whether the kernels run is asked of :mod:`fedlap_privacy.compute.fast_paths` (``FEDLAP_KERNELS``,
``FEDLAP_FAST_PATHS``, :func:`fedlap_privacy.compute.fast_paths.disabled`): ``auto`` (the default)
uses the kernels and, where they cannot be built (no compiler, say), warns once and falls
back to torch's own kernels, which compute the same function; ``off`` always uses torch's
kernels; ``require`` raises :class:`~fedlap_privacy.errors.ConfigError` instead of falling
back (CI uses it, so that a broken build cannot pass unnoticed).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.fast_paths import KERNEL_MODES, KERNELS_ENV
from fedlap_privacy.compute.kernels.private_dir import (
    UnsafePath,
    make_private_subdir,
    open_private_dir,
    remove_private_subdir,
)
from fedlap_privacy.errors import ConfigError

__all__ = [
    "CACHE_ENV",
    "KERNELS_ENV",
    "MODES",
    "KernelLibrary",
    "kernel_mode",
    "load_kernels",
]

CACHE_ENV = "FEDLAP_CACHE_DIR"
MODES = KERNEL_MODES
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("gn_relu_pool.c", "winograd.c"))
_BASE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp-simd")
_NATIVE_FLAG = "-march=native"
_COMPILE_TIMEOUT_S = 120
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | _NOFOLLOW  # a FIFO does not hang
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
_LIBRARY_LIMIT = 64 << 20
_MANIFEST_LIMIT = 256
#: a manifest: the library's SHA-256 and name, as ``sha256sum`` writes them
_MANIFEST_LINE = re.compile(r"([0-9a-f]{64})  (kernels-[0-9a-f]{20}-[0-9a-f]{16}\.so)\n")
#: the translation unit the compiler is given, beside copies of the sources
_WRAPPER_NAME = "kernels.c"
#: how a build is made, part of the cache key: builds of an earlier recipe are never loaded
#: (those compiled from standard input may hold a source of the working folder)
_RECIPE = b"sources copied into a private folder, compiled by path"
# the sources once per scalar type: FN(name) is the exported name for that type
_INCLUDES = "".join(f'#include "{source.name}"\n' for source in SOURCES)
_WRAPPER = f"""#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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
    # x, N, C, H, W, zeros, lo, hi, out
    "wino_input": [_P, _I, _I, _I, _I, _P, _I, _I, _P],
    # m, bias, N, C, H, W, lo, hi, y
    "wino_output": [_P, _P, _I, _I, _I, _I, _I, _I, _P],
    # g, N, C, H, W, lo, hi, out
    "wino_grad_output": [_P, _I, _I, _I, _I, _I, _I, _P],
    # d, N, C, H, W, lo, hi, dx
    "wino_grad_input": [_P, _I, _I, _I, _I, _I, _I, _P],
    # w, C_out, C_in, lo, hi, out, outT
    "wino_weight": [_P, _I, _I, _I, _I, _P, _P],
    # m, R, C_out, C_in, lo, hi, dw
    "wino_weight_grad": [_P, _I, _I, _I, _I, _I, _P],
}
SUFFIXES = ("_f32", "_f64")


@dataclass(frozen=True)
class KernelLibrary:
    """The loaded kernels: ``function(name, suffix)`` returns a typed ctypes function.
    ``path`` is the verified library in the cache (or, where the cache was refused, where
    it was built in a temporary directory, since removed)."""

    library: ctypes.CDLL
    path: Path

    def function(self, name: str, suffix: str) -> ctypes._CFuncPtr:
        return getattr(self.library, name + suffix)


def kernel_mode() -> str:
    """``auto``, ``off`` or ``require``: what :func:`fedlap_privacy.compute.fast_paths.current`
    says of the kernels."""
    paths = fast_paths.current()
    if not paths.kernels:
        return "off"
    return "require" if paths.require_kernels else "auto"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the architecture and the processor's features."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{flags.strip()}"


def _cache_root() -> str:
    """``$FEDLAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/fedlap-privacy``, else
    ``~/.cache/fedlap-privacy``."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return os.path.join(base, "fedlap-privacy")


@dataclass(frozen=True)
class _Folder:
    """A checked private directory: its descriptor (what every file operation goes through)
    and the path the compiler and the loader are given."""

    fd: int
    path: Path


def _open_cache() -> _Folder | None:
    """The cache's ``kernels/`` directory where every component of its path is safe
    (:func:`~fedlap_privacy.compute.kernels.private_dir.open_private_dir`), else None, warned."""
    root = _cache_root()
    try:
        fd, path = open_private_dir(os.path.join(root, "kernels"), create=True)
    except OSError as exc:
        warnings.warn(f"fedlap-privacy does not cache its C kernels in {root}: {exc}; it "
                      f"builds them in a private temporary directory for this process",
                      RuntimeWarning, stacklevel=2)
        return None
    return _Folder(fd, Path(path))


def _library_name(key: str, digest: str) -> str:
    return f"kernels-{key}-{digest[:16]}.so"


def _manifest_name(key: str) -> str:
    return f"kernels-{key}.sha256"


def _read_private_file(folder: int, name: str, limit: int) -> bytes:
    """The bytes of the regular file ``name`` in ``folder``, opened without following a link
    and checked on its descriptor: owned by the caller or root, writable by no one else."""
    fd = os.open(name, _READ_FLAGS, dir_fd=folder)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.geteuid(), 0):
            raise UnsafePath(f"{name} is not a regular file of this user")
        if st.st_mode & 0o022 or st.st_size > limit:
            raise UnsafePath(f"{name} is writable by other users or too large")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UnsafePath(f"{name} is too large")
    return data


def _write_private_file(folder: int, name: str, data: bytes, mode: int = 0o600) -> None:
    """Create ``name`` in ``folder`` (it must not exist, nor be a link), private."""
    fd = os.open(name, _CREATE_FLAGS, mode, dir_fd=folder)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _cached(cache: _Folder, key: str) -> tuple[bytes, str] | None:
    """The cached library for ``key`` (its bytes and name), verified against the SHA-256
    its manifest recorded at the build; None where there is none, or (warned) where they
    differ."""
    try:
        manifest = _read_private_file(cache.fd, _manifest_name(key), _MANIFEST_LIMIT)
    except FileNotFoundError:
        return None
    except OSError as exc:
        _warn_mismatch(cache.path / _manifest_name(key), str(exc))
        return None
    line = _MANIFEST_LINE.fullmatch(manifest.decode("ascii", errors="replace"))
    if line is None or line[2] != _library_name(key, line[1]):
        _warn_mismatch(cache.path / _manifest_name(key), "not a manifest of this build")
        return None
    digest, name = line[1], line[2]
    try:
        data = _read_private_file(cache.fd, name, _LIBRARY_LIMIT)
    except OSError as exc:
        _warn_mismatch(cache.path / name, str(exc))
        return None
    if hashlib.sha256(data).hexdigest() != digest:
        _warn_mismatch(cache.path / name, f"it does not match the SHA-256 recorded at its "
                                          f"build in {_manifest_name(key)}")
        return None
    return data, name


def _warn_mismatch(path: Path, reason: str) -> None:
    warnings.warn(f"fedlap-privacy does not load the cached C kernels {path}: {reason}; "
                  f"building them again", RuntimeWarning, stacklevel=2)


def _compile(compiler: str, flags: tuple[str, ...], sources: dict[str, bytes],
             cache: _Folder, key: str) -> tuple[bytes, str]:
    """Build the library in a fresh private directory (mode 0700) inside the cache, record
    its SHA-256 in a manifest and rename both into place (atomically, through the cache's
    descriptor): the library's bytes and its name. Raises OSError with the reason.

    The compiler reads only what this process wrote into that directory: ``sources`` (the
    very bytes the cache key hashes) and the wrapper, compiled by its path there and run
    from there, with no ``-I``. GCC and Clang look for a quoted ``#include`` in the folder
    of the file that includes it before anywhere else (for standard input: the working
    folder), and for ``<...>`` only in the system's folders, so no file of the working
    folder, the package folder or anyone else's folder can be compiled in."""
    sub_fd, sub = make_private_subdir(cache.fd, ".build-")
    try:
        folder = cache.path / sub
        for name, data in {**sources, _WRAPPER_NAME: _WRAPPER.encode()}.items():
            _write_private_file(sub_fd, name, data)
        cmd = [compiler, *flags, str(folder / _WRAPPER_NAME), "-o", str(folder / "lib.so"),
               "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=folder,
                                  stdin=subprocess.DEVNULL, timeout=_COMPILE_TIMEOUT_S,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise OSError(f"{compiler}: {exc}") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise OSError(f"{compiler} exited {done.returncode}: {last}")
        data = _read_private_file(sub_fd, "lib.so", _LIBRARY_LIMIT)
        digest = hashlib.sha256(data).hexdigest()
        name = _library_name(key, digest)
        os.replace("lib.so", name, src_dir_fd=sub_fd, dst_dir_fd=cache.fd)
        _write_private_file(sub_fd, "manifest", f"{digest}  {name}\n".encode())
        os.replace("manifest", _manifest_name(key), src_dir_fd=sub_fd, dst_dir_fd=cache.fd)
        return data, name
    finally:
        os.close(sub_fd)
        remove_private_subdir(cache.fd, sub)


def _load_bytes(cache: _Folder, data: bytes) -> ctypes.CDLL:
    """Load the verified bytes ``data`` from a file of a fresh private directory, named
    through that directory's descriptor (``/proc/self/fd/N/...`` where there is one):
    nobody else can swap the file before the loader opens it, nor move the directory
    away. The name is new each time, so the dynamic loader never answers with a library it
    loaded before under that name."""
    sub_fd, sub = make_private_subdir(cache.fd, ".load-")
    file = f"{sub.lstrip('.')}.so"
    try:
        _write_private_file(sub_fd, file, data, 0o700)
        through_fd = f"/proc/self/fd/{sub_fd}"
        folder = through_fd if os.path.isdir(through_fd) else str(cache.path / sub)
        return ctypes.CDLL(f"{folder}/{file}")
    finally:
        os.close(sub_fd)
        remove_private_subdir(cache.fd, sub)


def _typed(library: ctypes.CDLL) -> ctypes.CDLL:
    for name, argtypes in SIGNATURES.items():
        for suffix in SUFFIXES:
            fn = getattr(library, name + suffix)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
    return library


def _build_in(cache: _Folder, compiler: str, persistent: bool) -> KernelLibrary:
    """Load the verified cached build for this source/compiler/processor (where
    ``persistent``), else build it; each flag set in turn."""
    sources = {path.name: path.read_bytes() for path in SOURCES}  # read once: what is
    # hashed is what is compiled
    source = b"\0".join(sources.values())
    reasons = []
    for flags in ((*_BASE_FLAGS, _NATIVE_FLAG), _BASE_FLAGS):
        key = hashlib.sha256(b"\0".join(
            [_RECIPE, source, _WRAPPER.encode(), " ".join(flags).encode(), compiler.encode(),
             _cpu_signature().encode()])).hexdigest()[:20]
        cached = _cached(cache, key) if persistent else None
        if cached is not None:
            data, name = cached
            try:
                return KernelLibrary(_typed(_load_bytes(cache, data)), cache.path / name)
            except (OSError, AttributeError):
                pass  # verified, yet not loadable here: built again below
        try:
            data, name = _compile(compiler, flags, sources, cache, key)
            return KernelLibrary(_typed(_load_bytes(cache, data)), cache.path / name)
        except (OSError, AttributeError) as exc:
            reasons.append(str(exc) or type(exc).__name__)
    raise OSError("; ".join(reasons))


def _build() -> KernelLibrary:
    """The kernels, from the cache where it is safe, else built in a private temporary
    directory (removed once the library is loaded)."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler found ({compiler!r}; set CC)")
    cache = _open_cache()
    if cache is not None:
        try:
            return _build_in(cache, compiler, persistent=True)
        finally:
            os.close(cache.fd)
    base_fd, base = open_private_dir(tempfile.gettempdir(), create=False,
                                      parent_only=True)
    try:
        sub_fd, sub = make_private_subdir(base_fd, "fedlap-kernels-")
        try:
            return _build_in(_Folder(sub_fd, Path(base) / sub), compiler, persistent=False)
        finally:
            os.close(sub_fd)
            remove_private_subdir(base_fd, sub)
    finally:
        os.close(base_fd)


@functools.cache
def _load() -> KernelLibrary | str:
    try:
        return _build()
    except (OSError, AttributeError) as exc:  # no compiler, failed build, missing symbol
        return str(exc) or type(exc).__name__


def load_kernels() -> KernelLibrary | None:
    """The kernels, or None where they are switched off (:func:`kernel_mode`) or (``auto``)
    they cannot be built.

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
