"""MkDocs hook: give mkdocstrings the package as Python imports it.

``pyproject.toml`` maps the subpackages ``fedlap_privacy.accountant``, ``.audit``, ``.fl``
and ``.cli`` from top-level folders, which griffe (mkdocstrings' loader) does not follow:
it finds ``fedlap_privacy/`` and looks for the subpackages inside it. Before a build this
hook lays out ``build/api-src/fedlap_privacy/`` as links to the real files and folders,
and ``mkdocs.yml`` points the Python handler there. Nothing is copied, imported or run.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
TREE = ROOT / "build" / "api-src" / "fedlap_privacy"
#: subpackage -> its folder, as [tool.setuptools.package-dir] in pyproject.toml maps them
SUBPACKAGES = {"accountant": "accountant", "audit": "audit", "fl": "fl", "cli": "cli"}


def link_package_tree() -> Path:
    """(Re)build the linked tree; returns the folder to put on griffe's search path."""
    if TREE.exists():
        shutil.rmtree(TREE)
    TREE.mkdir(parents=True)
    for entry in sorted((ROOT / "fedlap_privacy").iterdir()):
        if entry.name != "__pycache__":
            (TREE / entry.name).symlink_to(entry)
    for name, folder in SUBPACKAGES.items():
        (TREE / name).symlink_to(ROOT / folder, target_is_directory=True)
    return TREE.parent


def on_startup(**kwargs: Any) -> None:
    """Before mkdocstrings reads its search paths (it drops those that do not exist yet)."""
    link_package_tree()
