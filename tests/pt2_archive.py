"""Editing a ``torch.export.save`` archive the way an attacker would (the .pt2 attack tests
of tests/audit/readers/test_audit_pt2_safety.py and test_audit_pt2_bombs.py)."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

Entries = dict[str, bytes]


def export_for_audit(model: Any, folder: Path) -> tuple[Path, list[str]]:
    """``model`` (1 x 8 x 8 images in, evaluation mode) exported with a dynamic batch to
    ``folder/genuine.pt2``, and the CLI arguments of 24 member / non-member records."""
    import numpy as np
    import torch

    program = torch.export.export(model, (torch.randn(2, 1, 8, 8),),
                                  dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
    torch.export.save(program, folder / "genuine.pt2")
    rng = np.random.default_rng(0)
    for name in ("in", "out"):
        np.savez(folder / f"{name}.npz", x=rng.random((24, 1, 8, 8), dtype=np.float32),
                 y=rng.integers(0, 10, 24))
    return folder / "genuine.pt2", ["--members", str(folder / "in.npz"),
                                    "--nonmembers", str(folder / "out.npz")]


def rewrite(src: Path, dst: Path, edit: Callable[[Entries], None],
            compression: int = zipfile.ZIP_STORED) -> Path:
    """Copy a .pt2 archive with ``edit`` applied to its entries (names below its root)."""
    with zipfile.ZipFile(src) as archive:
        root = archive.namelist()[0].split("/")[0] + "/"
        entries = {n[len(root):]: archive.read(n) for n in archive.namelist()}
    edit(entries)
    with zipfile.ZipFile(dst, "w", compression) as archive:
        for name, data in entries.items():
            archive.writestr(root + name, data)
    return dst


def edit_json(entries: Entries, name: str, change: Callable[[Any], None]) -> None:
    value = json.loads(entries[name])
    change(value)
    entries[name] = json.dumps(value).encode()


def arg(name: str, value: dict[str, Any], keyword: bool = False) -> dict[str, Any]:
    """A node input as ``torch.export`` serializes it."""
    return {"name": name, "arg": value, "kind": 2 if keyword else 1}


def node(target: str, inputs: list[dict[str, Any]], out: str | None) -> dict[str, Any]:
    """A node calling ``torch.ops.aten.<target>`` with one tensor output ``out`` (or none)."""
    return {"target": f"torch.ops.aten.{target}", "inputs": inputs, "name": out or "n",
            "outputs": [{"as_tensor": {"name": out}}] if out else [], "metadata": {},
            "is_hop_single_tensor_return": None}


def graph(change: Callable[[list[dict[str, Any]]], None]) -> Callable[[Entries], None]:
    """An edit of the graph's node list."""
    return lambda entries: edit_json(entries, "models/model.json", lambda program: change(
        program["graph_module"]["graph"]["nodes"]))
