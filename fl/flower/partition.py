"""The records a SuperNode holds, pinned by a content hash (docs/threat-model.md).

Contract: :func:`load_partition` returns the node's partition from its node config and
never from a value the server chose, except in simulation:

* ``data-file`` (the real deployment): an ``.npz`` with ``x`` (float32 ``(N, C, H, W)``,
  normalised as the run's dataset) and ``y`` (integer labels in ``[0, 10)``), the node's own
  records. Its content hash is SHA-256 of ``x`` and ``y``
  (:func:`fedlap_privacy.data.content_hash`).
* otherwise (SIMULATION ONLY: one machine, ``train --engine flower`` and tests): partition
  ``partition-id`` of the run's dataset split with the run's split and split seed (the
  server sends its secret one in the instruction), as the simulator computes it; its hash is
  the simulator's partition fingerprint. Here the split follows the instruction's split
  seed, which a real node must never let the server choose.

``partition-id`` names the client index the node answers for in both cases.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlap_privacy.data import NORMALISATION, NUM_CLASSES, Dataset, content_hash, load_dataset
from fedlap_privacy.errors import ConfigError, DataError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.simulation import client_parts

__all__ = ["SIMULATED", "NodeData", "load_partition"]

#: ``source`` of a partition recomputed from the run's split (simulation only)
SIMULATED = "simulated-split"
DATA_FILE = "data-file"


@dataclass(frozen=True, eq=False)
class NodeData:
    """The node's records (they never leave it) and their public description."""

    index: int  # the client index (partition-id) the node answers for
    x: Tensor
    y: Tensor
    content_hash: str
    source: str  # SIMULATED or DATA_FILE
    shape: Dataset  # channels, image size and classes for the model (no test records)

    @property
    def size(self) -> int:
        """N_k: public metadata (the node's ledger accounts its sampling rate with it)."""
        return int(self.y.shape[0])


def partition_id(node_config: dict[str, Any], clients: int) -> int:
    """The node's client index; refuses a node config that does not fit a run of ``clients``."""
    if "partition-id" not in node_config:
        raise ConfigError("this SuperNode has no partition-id: start it with --node-config "
                          "'partition-id=K num-partitions=N'")
    k = int(node_config["partition-id"])
    n = int(node_config.get("num-partitions", clients))
    if n != clients or not 0 <= k < n:
        raise ConfigError(f"SuperNode holds partition {k} of {n}, the run has {clients} clients")
    return k


def _from_file(cfg: TrainConfig, k: int, path: Path, device: torch.device) -> NodeData:
    try:
        with np.load(path, allow_pickle=False) as f:
            x, y = np.asarray(f["x"]), np.asarray(f["y"])
    except (OSError, KeyError, ValueError) as exc:
        raise DataError(f"data-file {path}: not an .npz with arrays x and y ({exc})") from None
    if x.dtype != np.float32 or x.ndim != 4 or x.shape[2] != x.shape[3]:
        raise DataError(f"data-file {path}: x must be float32 (N, C, H, W) square images")
    if y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"data-file {path}: y must hold one integer label per image")
    if len(y) == 0 or y.min() < 0 or y.max() >= NUM_CLASSES:
        raise DataError(f"data-file {path}: labels must lie in [0, {NUM_CLASSES})")
    y = y.astype(np.int64)
    mean, std = NORMALISATION[cfg.dataset]
    shape = Dataset(cfg.dataset, x[:0], y[:0], x[:0], y[:0], NUM_CLASSES, mean, std)
    return NodeData(k, torch.from_numpy(x).to(device), torch.from_numpy(y).to(device),
                    content_hash(x, y), DATA_FILE, shape)


def load_partition(
    cfg: TrainConfig, node_config: dict[str, Any], device: torch.device
) -> NodeData:
    """The node's partition (module docstring)."""
    k = partition_id(node_config, cfg.clients)
    data_file = str(node_config.get("data-file", ""))
    if data_file:
        return _from_file(cfg, k, Path(data_file).expanduser(), device)
    data_dir = str(node_config.get("data-dir", "")) or cfg.data_dir
    data = load_dataset(cfg.dataset, data_dir)
    part = client_parts(cfg, data)[k]
    x, y = data.x_train[part], data.y_train[part]
    return NodeData(k, torch.from_numpy(x).to(device), torch.from_numpy(y).to(device),
                    content_hash(part, x, y), SIMULATED, data)
