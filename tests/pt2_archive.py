"""Editing a ``torch.export.save`` archive the way an attacker would (the .pt2 attack tests
of tests/audit/test_audit_pt2_safety.py and test_audit_pt2_bombs.py)."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

Entries = dict[str, bytes]


def rewrite(src: Path, dst: Path, edit: Callable[[Entries], None]) -> Path:
    """Copy a .pt2 archive with ``edit`` applied to its entries (names below its root)."""
    with zipfile.ZipFile(src) as archive:
        root = archive.namelist()[0].split("/")[0] + "/"
        entries = {n[len(root):]: archive.read(n) for n in archive.namelist()}
    edit(entries)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as archive:
        for name, data in entries.items():
            archive.writestr(root + name, data)
    return dst


def edit_json(entries: Entries, name: str, change: Callable[[Any], None]) -> None:
    value = json.loads(entries[name])
    change(value)
    entries[name] = json.dumps(value).encode()
