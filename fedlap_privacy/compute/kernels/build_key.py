"""What a build of the C kernels must match to be loaded: its sources, and the processor a
``-march=native`` build was made for. Standard library only: ``setup.py`` loads this file
by path at install time, before the package is importable."""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

SOURCES = ("kernels.c", "gn_relu_pool.c", "winograd.c")
#: the processor part of a build made without ``-march=native`` (it runs anywhere)
PORTABLE = "portable"


def sources_digest(folder: Path) -> str:
    """SHA-256 (first 16 hex digits) of the kernel sources in ``folder``."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((folder / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def processor() -> str:
    """SHA-256 (first 16 hex digits) of what ``-march=native`` depends on: the architecture
    and the processor's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    text = f"{platform.machine()}|{platform.processor()}|{flags.strip()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_key(folder: Path, native: bool) -> str:
    """The key a build from ``folder``'s sources records (``native``: for this processor)."""
    return f"{sources_digest(folder)}:{processor() if native else PORTABLE}"
