"""Load the package's C kernels, built at install time, with :mod:`ctypes`.

``setup.py`` compiles ``kernels.c`` (``gn_relu_pool.c`` and ``winograd.c`` once per scalar
type) into ``_kernels`` beside this file, optimised for the installing machine
(``-O3 -march=native``, else without ``-march=native``); a machine without a C compiler
installs without it. The library lives in the installed package and is trusted as its
Python files are. It records a key (:mod:`.build_key`): the SHA-256 of the sources it was
built from and, for a ``-march=native`` build, of the processor's features. A library whose
key does not match the sources beside it (an edited source in a checkout: reinstall) or
this processor (an installation shared by machines of different processors) is not loaded.

Whether the kernels run is asked of :mod:`fedlap_privacy.compute.fast_paths` (``FEDLAP_KERNELS``,
``FEDLAP_FAST_PATHS``, :func:`fedlap_privacy.compute.fast_paths.disabled`): ``auto`` (the default)
uses the kernels and, where there are none to load, warns once and falls back to torch's
own kernels, which compute the same function; ``off`` always uses torch's kernels;
``require`` raises :class:`~fedlap_privacy.errors.ConfigError` instead of falling back (CI
uses it, so that a broken build cannot pass unnoticed).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import warnings
from dataclasses import dataclass
from pathlib import Path

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.fast_paths import KERNELS_ENV
from fedlap_privacy.compute.kernels.build_key import PORTABLE, processor, sources_digest
from fedlap_privacy.errors import ConfigError

__all__ = ["KERNELS_ENV", "KernelLibrary", "kernel_mode", "load_kernels"]

FOLDER = Path(__file__).parent
#: how to rebuild the library of a checkout
_REBUILD = "reinstall the package (pip install -e .) to rebuild them"

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
    """The loaded kernels: ``function(name, suffix)`` returns a typed ctypes function."""

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


def library_path() -> Path | None:
    """The installed library (``_kernels`` with this Python's extension suffix), if any."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (path := FOLDER / f"_kernels{suffix}").is_file():
            return path
    return None


def _open() -> KernelLibrary:
    """The installed library, its key checked (module docstring), its functions typed.
    Raises OSError with the reason it cannot be used."""
    path = library_path()
    if path is None:
        raise OSError("they were not built when the package was installed (no C compiler?); "
                      + _REBUILD)
    library = ctypes.CDLL(str(path))
    key_of = library.fedlap_kernels_key
    key_of.restype = ctypes.c_char_p
    sources, _, cpu = key_of().decode().partition(":")
    if sources != sources_digest(FOLDER):
        raise OSError(f"{path.name} was built from other sources than those beside it; "
                      + _REBUILD)
    if cpu not in (PORTABLE, processor()):
        raise OSError(f"{path.name} was built for another processor; " + _REBUILD)
    for name, argtypes in SIGNATURES.items():
        for suffix in SUFFIXES:
            fn = getattr(library, name + suffix)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
    return KernelLibrary(library, path)


@functools.cache
def _load() -> KernelLibrary | str:
    try:
        return _open()
    except (OSError, AttributeError) as exc:  # no library, a stale one, a missing symbol
        return str(exc) or type(exc).__name__


def load_kernels() -> KernelLibrary | None:
    """The kernels, or None where they are switched off (:func:`kernel_mode`) or (``auto``)
    they cannot be loaded.

    Loaded once per process. ``auto`` warns once when it falls back; ``require`` raises
    :class:`~fedlap_privacy.errors.ConfigError` with the reason instead.
    """
    mode = kernel_mode()
    if mode == "off":
        return None
    loaded = _load()
    if isinstance(loaded, KernelLibrary):
        return loaded
    if mode == "require":
        raise ConfigError(f"{KERNELS_ENV}=require, but the C kernels cannot be loaded: "
                          f"{loaded}")
    _warn_fallback(loaded)
    return None


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"fedlap-privacy runs torch's kernels instead of its fused C kernels "
                  f"(slower, same results): {reason}", RuntimeWarning, stacklevel=3)
