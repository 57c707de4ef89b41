"""The files of a run folder: what may be shared, what stays private, and how they are checked
and committed.

A run folder (``--out``) holds:

* ``ckpt.pt`` — the RELEASABLE model checkpoint: the weights and model shape, the public
  configuration (every setting but the seed and the data folder), the privacy statement,
  the ledger and the per-round metrics on public data. Nothing in it depends on private
  data beyond what the statement declares public; it may be shared with anyone the model
  may be shared with. Where the epsilon assumes the selection hidden (threat models
  ``hidden-selection`` and ``trusted-server``), the ledger and the metrics withhold who was
  selected in each round and anything that counts them (participants, realised accesses,
  clients and replies, upload sizes, seconds, server-step statistics): the privacy
  statement says ``"selection": "withheld"`` (:mod:`fedlap_privacy.fl.run.released_metrics`).
  Under ``server`` they are released (``"selection": "released"``): the server knows them,
  and the epsilon (the worst client's) is computed from them.
* ``private.pt`` — the run's PRIVATE state, never to be shared: the full configuration
  (seed included), the split seed, the validation scores, each client's member indices,
  content hashes of the data and of each client's partition, the fingerprint of the
  released ledger, the full ledger and metrics where the release withholds the selection,
  and the methods' node-local and server state (synthetic sets, control variates).
  ``--resume`` and ``audit`` read it beside ``ckpt.pt``.
* ``commit.json`` — which pair of the two is committed (:func:`commit_run_files`).
* ``run.lock`` — the lock a run holds while it writes (:mod:`fedlap_privacy.state.run_lock`).
* ``flower-nodes/node-K`` — with ``--engine flower`` (and ``flower-simulation`` on this
  machine), the state folder of the node holding partition K: its own ledger
  (:mod:`fedlap_privacy.fl.flower.node_ledger`), kept so that a resumed run's nodes keep their
  budgets. PRIVATE like ``private.pt`` (each node's record count and content hash).
* ``metrics.jsonl`` (one line per round: the metrics of ``ckpt.pt``), ``accuracy.png`` /
  ``epsilon.png`` (test accuracy and epsilon only), and
  ``round.pending`` while a round that touches private data is under way (private: it
  names the selected clients).

The two checkpoints are committed as a pair: both are written under names of their
generation (``.private.pt.gN``, ``.ckpt.pt.gN``) and flushed, then ``commit.json`` is
replaced atomically to name generation N, then both are renamed over ``ckpt.pt`` and
``private.pt``. Whoever reads a run reads through the pointer (:func:`committed_file`): a
file of the committed generation still under its staged name is the one to read. A crash
at any point leaves the old pair or the new one, never one file of each;
:func:`settle_run_files` (run under the run's lock) finishes the renames of a committed
pair and removes the staged files of a pair that was never committed. A run folder of an
earlier version (no ``commit.json``) is read as ``ckpt.pt`` and ``private.pt``. Every file of
the pair, under its staged name or its own, is checked with ``lstat`` before it is read or
renamed (:func:`fedlap_privacy.state.checkpoint.run_file_present`): a symbolic link (to another
run's files, say), a folder or anything but a regular file is one line, never followed.

Every file is written by :func:`fedlap_privacy.state.atomic.write_atomic` (unique temporary
names, no link is followed). :func:`check_new_run_dir` refuses an ``--out`` that is a file,
a symbolic link or a folder that already holds a run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fedlap_privacy.errors import CheckpointError, ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.run.run_records import RoundRecord
from fedlap_privacy.state.atomic import fsync_dir, write_text_atomic
from fedlap_privacy.state.checkpoint import (
    CHECKPOINT,
    COMMIT,
    PRIVATE,
    PRIVATE_FORMAT,
    committed_file,
    committed_generation,
    run_file_present,
    staged_name,
)
from fedlap_privacy.state.run_lock import RunLock, lock_run_folder
from fedlap_privacy.state.run_state import ModelRelease, PrivateRunState

__all__ = [
    "CHECKPOINT", "COMMIT", "METRICS", "PENDING", "PRIVATE", "PRIVATE_FORMAT", "RUN_FILES",
    "check_new_run_dir", "commit_run_files", "committed_file", "holds_run", "load_history",
    "load_private", "load_release", "load_run_config", "lock_run", "public_config",
    "settle_run_files",
]

METRICS = "metrics.jsonl"
PENDING = "round.pending"
RUN_FILES = (CHECKPOINT, PRIVATE, METRICS, PENDING, COMMIT)
#: the pair, in the order it is written and renamed into place
_PAIR = (PRIVATE, CHECKPOINT)
#: configuration keys kept out of the releasable checkpoint
_PRIVATE_KEYS = ("seed", "data_dir", "data")


def public_config(cfg: TrainConfig) -> dict[str, Any]:
    """The configuration as ``ckpt.pt`` publishes it: everything but the seed and data paths."""
    return {k: v for k, v in cfg.to_dict().items() if k not in _PRIVATE_KEYS}


def check_new_run_dir(out: Path) -> None:
    """Refuse an output path that is a file, a symbolic link, or a folder holding a run."""
    if out.is_symlink():
        raise ConfigError(f"--out {out} is a symbolic link: give a real folder")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    held = [name for name in RUN_FILES if (out / name).exists() or (out / name).is_symlink()]
    if held:
        raise ConfigError(f"{out} already holds a run ({held[0]}): continue it with --resume "
                          "or pick another --out")


def holds_run(out: Path) -> bool:
    """Whether ``out`` holds a committed run (a checkpoint to resume)."""
    return committed_file(out, CHECKPOINT).is_file()


def _roll_forward(staged: Path, target: Path) -> None:
    """Rename a committed file over its own name."""
    os.replace(staged, target)


def settle_run_files(out: Path) -> None:
    """Finish a committed pair's renames and remove the staged files of any other generation
    (a commit that never finished). Call it holding the run's lock."""
    generation = committed_generation(out)
    for name in _PAIR:
        keep = staged_name(name, generation) if generation else None
        for pattern in (f".{name}.g*", f"..{name}.g*"):  # staged files, their temporaries
            for path in out.glob(pattern):
                if path.name != keep:
                    if path.is_dir() and not path.is_symlink():  # never a run's own file
                        raise CheckpointError(f"{path} is a folder where a run keeps a "
                                              "staged checkpoint; move it away")
                    path.unlink(missing_ok=True)  # a link itself, never what it names
        if keep is not None and run_file_present(out / keep):  # lstat: no link followed
            _roll_forward(out / keep, out / name)
    fsync_dir(out)


def commit_run_files(out: Path, release: ModelRelease, private: PrivateRunState) -> None:
    """Commit ``release`` (``ckpt.pt``) and ``private`` (``private.pt``) as one pair (module
    docstring). Call it holding the run's lock."""
    settle_run_files(out)
    generation = committed_generation(out) + 1
    private.save(out / staged_name(PRIVATE, generation))
    release.save(out / staged_name(CHECKPOINT, generation))
    fsync_dir(out)
    write_text_atomic(out / COMMIT, json.dumps({"generation": generation}) + "\n")
    fsync_dir(out)
    settle_run_files(out)


def lock_run(out: Path, *, new: bool, inherit: str | None = None) -> RunLock:
    """The lock of the run folder ``out`` (:func:`fedlap_privacy.state.run_lock.lock_run_folder`,
    ``inherit`` too): for a ``new`` run the folder is created; to continue one, a folder that
    holds no run is refused first (no lock file is left in it)."""
    if not new and not holds_run(out):
        raise CheckpointError(f"nothing to resume: no {CHECKPOINT} in {out}")
    return lock_run_folder(out, create=new, inherit=inherit)


def load_private(out: Path) -> PrivateRunState:
    """The committed private state of the run in ``out`` (see the module docstring)."""
    path = committed_file(out, PRIVATE)
    if not holds_run(out):
        raise CheckpointError(f"nothing to resume: no {CHECKPOINT} in {out}")
    if not path.is_file():
        raise CheckpointError(f"{out} has no {PRIVATE}: the run's private state (member "
                              "indices, seed, ledger fingerprint) is missing")
    return PrivateRunState.load(path)


def load_release(out: Path) -> ModelRelease:
    """The committed releasable checkpoint of the run in ``out``."""
    return ModelRelease.load(committed_file(out, CHECKPOINT))


def load_run_config(out: Path) -> TrainConfig:
    """The full configuration of the run in ``out`` (from its private state)."""
    return TrainConfig.from_recorded(load_private(out).config)


def load_history(out: Path) -> list[RoundRecord]:
    """The per-round records of the run in ``out`` (``metrics.jsonl``; empty before round 1);
    a line that is not a round's metrics is one :class:`CheckpointError` naming it."""
    path = out / METRICS
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            data = json.loads(line)
        except ValueError:
            raise CheckpointError(f"{where} is not JSON") from None
        records.append(RoundRecord.from_json(data, where))
    return records
