"""Safe checkpoints: atomic writes, and loads that never execute code.

A checkpoint is a dict of plain data -- dicts, lists, tuples, str, int, float, bool, None
and torch tensors (e.g. a ``state_dict``) -- stamped with ``"format": FORMAT``. Saving goes
through a temp file in the target directory (flush + fsync + ``os.replace``), so a crash
never leaves a half-written checkpoint under the real name. Loading uses
``torch.load(..., weights_only=True)``, which refuses pickles that would run code or build
arbitrary objects; every failure is a one-line :class:`CheckpointError`.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import stat
import zipfile
from pathlib import Path
from typing import Any

import torch

from fedlap_privacy.errors import CheckpointError
from fedlap_privacy.state.atomic import write_atomic

#: the releasable checkpoint (version 2: weights, public configuration, privacy statement;
#: version 1 also held the seed and member indices and cannot be verified)
FORMAT = "fedlap-privacy/2"
#: the format of a run's private state (a release checkpoint cannot be mistaken for it)
PRIVATE_FORMAT = "fedlap-privacy-private/1"
#: a run folder's releasable checkpoint and its private state beside it
CHECKPOINT = "ckpt.pt"
PRIVATE = "private.pt"
#: names the committed generation of a run folder's pair (``fl.run.run_files``)
COMMIT = "commit.json"


def save_checkpoint(path: str | Path, payload: dict[str, Any], fmt: str = FORMAT) -> None:
    """Write ``payload`` plus ``"format": fmt`` to ``path`` atomically.

    Parent directories are created. The caller's dict is not modified. A payload that
    :func:`load_checkpoint` could not read back (e.g. holding numpy arrays or custom
    objects) is rejected with :class:`CheckpointError` before anything is written.
    """
    if not isinstance(payload, dict):
        raise TypeError(f"checkpoint payload must be a dict, got {type(payload).__name__}")
    path = Path(path)
    buffer = io.BytesIO()
    try:
        torch.save({**payload, "format": fmt}, buffer)
    except Exception as exc:  # unpicklable objects: lambdas, open files, ...
        first = (str(exc).strip().splitlines() or [""])[0][:120]
        raise CheckpointError(
            f"cannot save {path}: the payload cannot be serialised ({type(exc).__name__}: {first})"
        ) from None
    try:  # the same check load_checkpoint applies, so what is saved can be loaded
        torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = found[1] if found else "unsupported objects"
        raise CheckpointError(
            f"cannot save {path}: the payload is not plain data (it holds {what})"
        ) from None
    try:
        write_atomic(path, buffer.getvalue())
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc}") from exc


def load_checkpoint(path: str | Path, fmt: str = FORMAT) -> dict[str, Any]:
    """Read a checkpoint of format ``fmt`` written by :func:`save_checkpoint`, without
    executing any code."""
    path = Path(path)
    payload = load_checkpoint_data(path)
    if not isinstance(payload, dict) or payload.get("format") != fmt:
        found_format = payload.get("format") if isinstance(payload, dict) else None
        extra = f" (format {found_format!r}, expected {fmt!r})" if found_format else ""
        raise CheckpointError(f"{path} is not a fedlap-privacy checkpoint{extra}")
    return payload


def load_checkpoint_data(path: str | Path) -> Any:
    """Any torch file of plain data (e.g. a state dict saved by other code), loaded with
    ``weights_only=True``: a file that would run code is refused (one line)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no such checkpoint: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if not zipfile.is_zipfile(path):  # not a torch archive: noise, not an attack
            raise CheckpointError(
                f"{path} is not a readable torch checkpoint (corrupt, truncated or another format)"
            ) from None
        message = str(exc)
        found = re.search(r"GLOBAL ([\w.]+)", message)
        detail = re.search(r"WeightsUnpickler error:\s*(.+)", message)
        reason = (
            f"global {found[1]}"
            if found
            else detail[1].strip()[:120]
            if detail
            else "unsupported pickle content"
        )
        raise CheckpointError(
            f"refusing to load {path}: it contains code or objects that "
            f"are not plain data ({reason})"
        ) from None
    except Exception as exc:  # RuntimeError, EOFError, OSError, ... from a damaged file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
        raise CheckpointError(
            f"{path} is not a readable torch checkpoint (corrupt, "
            f"truncated or another format: {first})"
        ) from None
    return payload


# ---------------------------------------------------------------- the run folder's pair
# ckpt.pt and private.pt are committed as a pair (fedlap_privacy.fl.run.run_files writes them):
# both staged under their generation's names, then commit.json names the generation, then
# both are renamed into place. Every reader reads through the pointer.

def staged_name(name: str, generation: int) -> str:
    """The name ``name`` of generation ``generation`` has until it is renamed into place."""
    return f".{name}.g{generation}"


def committed_generation(out: Path) -> int:
    """The generation ``commit.json`` names (0: none, a run of an earlier version or no run)."""
    path = out / COMMIT
    if not (path.exists() or path.is_symlink()):
        return 0
    try:
        if path.is_symlink() or not path.is_file():
            raise ValueError("not a plain file")
        with path.open("rb") as f:
            generation = json.loads(f.read(4096))["generation"]
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 1:
            raise ValueError("not a generation")
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path} is unreadable: which checkpoints the run committed is "
                              "unknown") from None
    return generation


def run_file_present(path: Path) -> bool:
    """Whether the run-folder entry ``path`` (a file of the pair, staged or committed) is
    there, by ``lstat``: a regular file is, a missing one is not; anything else (a symbolic
    link, which would make the run read another run's file, a folder, a FIFO) is one
    :class:`CheckpointError` line, since a run writes regular files only."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    if stat.S_ISREG(info.st_mode):
        return True
    kind = ("a symbolic link" if stat.S_ISLNK(info.st_mode) else
            "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file")
    raise CheckpointError(f"{path} is {kind}: a run's checkpoints are regular files it wrote "
                          "itself; move it away")


def committed_file(out: Path, name: str) -> Path:
    """Where the committed ``ckpt.pt`` / ``private.pt`` of the run in ``out`` is: its staged
    name while the pair's renames are unfinished, else its own name. Either is checked by
    :func:`run_file_present` (no link is followed, no folder taken for a file)."""
    generation = committed_generation(out)
    staged = out / staged_name(name, generation)
    if generation and run_file_present(staged):
        return staged
    run_file_present(out / name)
    return out / name
