"""Builds the fused C kernels at install time (fedlap_privacy/compute/kernels/kernels.c),
optimised for the installing machine (``-march=native``, else without it). A machine
without a C compiler installs all the same: the package then runs torch's kernels, which
compute the same functions. Everything else about the package is in pyproject.toml."""

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

FOLDER = Path("fedlap_privacy/compute/kernels")
_spec = importlib.util.spec_from_file_location("build_key", FOLDER / "build_key.py")
build_key = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_key)


class KernelBuild(build_ext):
    """Tries ``-march=native``, then a portable build, then none (a warning)."""

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []  # a ctypes library, not a Python module: no PyInit_ symbol

    def build_extension(self, ext: Extension) -> None:
        failures = []
        for native in (True, False):
            key = build_key.build_key(FOLDER, native)
            ext.define_macros = [("FEDLAP_KERNELS_KEY", f'"{key}"')]
            ext.extra_compile_args = ["-O3", "-std=c11", "-fopenmp-simd",
                                      *(["-march=native"] if native else [])]
            try:
                super().build_extension(ext)
                return
            except Exception as exc:  # any compiler failure: try the next flags
                failures.append(str(exc))
        print("fedlap-privacy: the C kernels were not built (torch's kernels will run): "
              + "; ".join(failures), file=sys.stderr)


setup(
    ext_modules=[Extension("fedlap_privacy.compute.kernels._kernels",
                           [str(FOLDER / "kernels.c")], libraries=["m"])],
    cmdclass={"build_ext": KernelBuild},
)
