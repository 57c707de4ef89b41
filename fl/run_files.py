"""The files of a run folder: what may be shared, what stays private, and how they are checked.

A run folder (``--out``) holds:

* ``ckpt.pt`` — the RELEASABLE model checkpoint: the weights and model shape, the public
  configuration (every setting but the seed and the data folder), the privacy statement,
  the ledger and the per-round metrics on public data. Nothing in it depends on private
  data beyond what the statement declares public; it may be shared with anyone the model
  may be shared with.
* ``private.pt`` — the run's PRIVATE state, never to be shared: the full configuration
  (seed included), the split seed, the validation scores, each client's member indices,
  content hashes of the data and of each client's partition, the fingerprint of the
  ledger, and the methods' node-local and server state (synthetic sets, control
  variates). ``--resume`` and ``audit`` read it beside ``ckpt.pt``.
* ``metrics.jsonl`` (one line per round: the metrics of ``ckpt.pt``), ``accuracy.png`` /
  ``epsilon.png``, and
  ``round.pending`` while a round that touches private data is under way.

Every file is written by :func:`fedlap_privacy.atomic.write_atomic` (unique temporary
names, no link is followed). :func:`check_new_run_dir` refuses an ``--out`` that is a file,
a symbolic link or a folder that already holds a run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedlap_privacy.checkpoint import CHECKPOINT, PRIVATE, PRIVATE_FORMAT
from fedlap_privacy.errors import CheckpointError, ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.run_state import PrivateRunState

__all__ = [
    "CHECKPOINT", "METRICS", "PENDING", "PRIVATE", "PRIVATE_FORMAT", "RUN_FILES",
    "check_new_run_dir", "load_history", "load_private", "load_run_config", "public_config",
]

METRICS = "metrics.jsonl"
PENDING = "round.pending"
RUN_FILES = (CHECKPOINT, PRIVATE, METRICS, PENDING)
#: configuration keys kept out of the releasable checkpoint
_PRIVATE_KEYS = ("seed", "data_dir")


def public_config(cfg: TrainConfig) -> dict[str, Any]:
    """The configuration as ``ckpt.pt`` publishes it: everything but the seed and data path."""
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


def load_private(out: Path) -> PrivateRunState:
    """The private state of the run in ``out`` (see the module docstring)."""
    path = out / PRIVATE
    if not (out / CHECKPOINT).is_file():
        raise CheckpointError(f"nothing to resume: no {CHECKPOINT} in {out}")
    if not path.is_file():
        raise CheckpointError(f"{out} has no {PRIVATE}: the run's private state (member "
                              "indices, seed, ledger fingerprint) is missing")
    return PrivateRunState.load(path)


def load_run_config(out: Path) -> TrainConfig:
    """The full configuration of the run in ``out`` (from its private state)."""
    return TrainConfig.from_dict(load_private(out).config)


def load_history(out: Path) -> list[dict[str, Any]]:
    """The per-round records of the run in ``out`` (``metrics.jsonl``; empty before round 1)."""
    path = out / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
