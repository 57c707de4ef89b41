"""The built wheel works without the source tree (runs by default: not marked ``slow``).

Builds a wheel from a copy of the project's sources (offline, with the installed setuptools:
``pip wheel --no-deps --no-build-isolation --no-index``), checks that it ships every package
named in pyproject.toml with all of its modules and the PEP 561 ``py.typed`` marker, installs
it with ``--no-deps`` into a fresh virtual environment whose only other path is this
interpreter's site-packages (added by a .pth file, so the editable install's finder stays
inactive), and runs ``python -m fedlap_privacy plan`` and the ``fedlap-privacy`` console script
there from an empty working directory. About 10 s.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from helpers import repo_root

from fedlap_privacy.accountant import FedLAPSchedule, plan_sigma

ROOT = repo_root()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES: list[str] = PYPROJECT["tool"]["setuptools"]["packages"]
PACKAGE_DIR: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
TIMEOUT = 120


def _run(args: list[str | Path], cwd: Path, extra_env: dict[str, str] | None = None,
         **kw: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    env.update(COLUMNS="200", NO_COLOR="1", PYTHONNOUSERSITE="1", PIP_NO_INPUT="1")
    env.update(extra_env or {})
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=TIMEOUT, check=False, **kw,
    )
    assert proc.returncode == 0, f"{args}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _folder(package: str) -> str:
    """Where setuptools finds ``package``: its own package-dir entry, else its parent's
    folder plus its last name (as setuptools resolves nested packages)."""
    if package in PACKAGE_DIR:
        return PACKAGE_DIR[package]
    parent, _, name = package.rpartition(".")
    return f"{_folder(parent)}/{name}" if parent else package


def _source_dir(package: str) -> Path:
    return ROOT / _folder(package)


def _build_wheel(tmp: Path, extra_env: dict[str, str] | None = None) -> Path:
    """A wheel built from a copy of pyproject.toml, setup.py, README.md and the package
    folders (so the build writes nothing into the checkout; the kernels are compiled anew)."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    for folder in {_folder(p) for p in PACKAGES}:
        shutil.copytree(
            ROOT / folder, src / folder, dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"),
        )
    dist = tmp / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "-w", dist, src],
        cwd=tmp, extra_env=extra_env,
    )
    (built,) = dist.glob("fedlap_privacy-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_a_machine_without_a_c_compiler_installs(tmp_path: Path) -> None:
    """setup.py builds the kernels where it can; without a compiler the wheel is built all
    the same, without them (the package then runs torch's kernels)."""
    built = _build_wheel(tmp_path, {"CC": str(tmp_path / "no-such-cc")})
    names = zipfile.ZipFile(built).namelist()
    assert "fedlap_privacy/compute/kernels/block.py" in names
    assert not [n for n in names if n.endswith(".so")]


@pytest.fixture(scope="module")
def venv_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed (--no-deps); dependencies come from this
    interpreter's site-packages through a .pth file (which does not process the .pth files
    inside it, so an editable install of the checkout is not imported)."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=venv.parent)
    python = venv / "bin" / "python"
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "--disable-pip-version-check", wheel],
        cwd=venv.parent,
    )
    purelib = _run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=venv.parent,
    ).stdout.strip()
    (Path(purelib) / "_project_dependencies.pth").write_text(
        "\n".join(site.getsitepackages()) + "\n"
    )
    return python


def test_wheel_contains_every_package_module_and_py_typed(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "fedlap_privacy/py.typed" in names
    assert "fedlap_privacy/__main__.py" in names
    # the kernels, compiled at the build, and the sources their key is checked against
    assert any(re.fullmatch(r"fedlap_privacy/compute/kernels/_kernels\..*\.so", n) for n in names)
    assert "fedlap_privacy/compute/kernels/gn_relu_pool.c" in names
    for package in PACKAGES:
        installed = package.replace(".", "/")
        source = _source_dir(package)
        modules = {p.name for p in source.glob("*.py")}
        assert "__init__.py" in modules, f"{source} is not a package"
        assert {f"{installed}/{m}" for m in modules} <= names, package
        # a sub-folder that is a package but missing from pyproject.toml would be dropped
        for sub in source.iterdir():
            if (sub / "__init__.py").exists():
                assert f"{package}.{sub.name}" in PACKAGES, f"{sub} missing from pyproject.toml"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "fedlap-privacy = fedlap_privacy.cli.main:app" in scripts


def test_installed_wheel_runs_the_cli(venv_python: Path, tmp_path: Path) -> None:
    code = "import json, sys, fedlap_privacy as f; print(json.dumps([f.__file__, sys.path]))"
    module, path = json.loads(_run([venv_python, "-c", code], cwd=tmp_path).stdout)
    assert module.startswith(str(venv_python.parents[1]))  # the wheel, not the checkout
    sources = {ROOT, *(_source_dir(p) for p in PACKAGES)}
    assert not sources & {Path(p).resolve() for p in path if p}
    # python -m fedlap_privacy: the plan as JSON
    proc = _run(
        [venv_python, "-m", "fedlap_privacy", "plan", "--eps", "10", "--delta", "1e-5", "--json"],
        cwd=tmp_path,
    )
    out = json.loads(proc.stdout)
    reference = FedLAPSchedule(batch_size=256, client_size=10000, local_steps=200)
    assert out["sigma"] == pytest.approx(plan_sigma(reference, out["rounds"], 10.0, 1e-5))
    assert out["epsilon"] <= 10.0 and out["delta"] == 1e-5
    # the console script: the human-readable table
    script = venv_python.parent / "fedlap-privacy"
    table = _run([script, "plan", "--eps", "10", "--delta", "1e-5"], cwd=tmp_path).stdout
    assert "sigma (planned)" in table
    assert f"{out['sigma']:.4f}" in table
    # the fused kernels the wheel's build compiled, loaded from the installed package
    code = ("import torch; from fedlap_privacy.compute.kernels import load_kernels, gn_relu_pool, "
            "reference_block as r; z = torch.randn(2, 3, 4, 4); w, b = torch.ones(3), "
            "torch.zeros(3); print(load_kernels().path.parent, "
            "float((gn_relu_pool(z, w, b, 1e-5) - r(z, w, b, 1e-5)).abs().max()))")
    env = {"FEDLAP_KERNELS": "require"}
    where, err = _run([venv_python, "-c", code], cwd=tmp_path, extra_env=env).stdout.split()
    assert Path(where) == Path(module).parent / "compute" / "kernels" and float(err) < 1e-5


def _declared_distributions() -> set[str]:
    """The distributions pyproject.toml names: the dependencies and every extra."""
    extras = PYPROJECT["project"]["optional-dependencies"].values()
    specs = [*PYPROJECT["project"]["dependencies"], *(s for extra in extras for s in extra)]
    return {re.split(r"[\[<>=!~ ;]", s, maxsplit=1)[0].lower().replace("_", "-") for s in specs}


def test_every_third_party_import_is_a_declared_dependency() -> None:
    """A module the package imports only because another dependency happens to pull it in
    breaks a plain ``pip install`` when that dependency changes (typer 0.29 stopped
    installing click, which ``cli/train.py`` imported)."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    declared = _declared_distributions()
    undeclared = set()
    for package in PACKAGES:
        for source in _source_dir(package).glob("*.py"):
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.Import):
                    roots = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    roots = [node.module.split(".")[0]]
                else:
                    continue
                for root in roots:
                    if root in sys.stdlib_module_names or root == "fedlap_privacy":
                        continue
                    dists = {d.lower().replace("_", "-") for d in owners.get(root, [root])}
                    if not dists & declared:
                        undeclared.add(f"{source.relative_to(ROOT)}: {root}")
    assert not undeclared, sorted(undeclared)
