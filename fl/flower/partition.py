"""The records a SuperNode holds, pinned by a content hash (docs/threat-model.md).

Contract: :func:`load_partition` returns the node's partition from its node config and
never from a value the server chose, except in simulation:

* ``data-file`` (the real deployment): ONE ``.npz`` of the node's own records, in the formats
  of ``train --data`` (docs/own-data.md), read by
  :func:`fedlap_privacy.data.user_data.load_records` under its checks and limits (a forged or
  oversized archive, or a path that is not a regular file, is one line) and never unpickled: ``x``
  images ``(N, C, H, W)`` or feature rows ``(N, D)`` (numbers of any dtype, used as float32,
  normalised as the run's model expects), ``y`` integer labels, optionally a 0-d
  ``num_classes``. Whether they fit the server's model (shape, classes) is checked by
  :func:`.node_model.check_records`. Its content hash is SHA-256 of ``x`` (as float32) and
  ``y`` (:func:`fedlap_privacy.data.datasets.content_hash`).
* otherwise (SIMULATION ONLY: one machine, ``train --engine flower`` and tests): partition
  ``partition-id`` of the run's dataset (a built-in one, or the run's ``data``: a user's
  records on the same machine, :mod:`fedlap_privacy.data.user_data`) split with the run's split
  and split seed (the server sends its secret one in the instruction), as the simulator
  computes it; its hash is the simulator's partition fingerprint. Here the split follows the
  instruction's split seed, which a real node must never let the server choose.

``partition-id`` names the client index the node answers for in both cases.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlap_privacy.data.datasets import Dataset, content_hash, load_dataset
from fedlap_privacy.data.user_data import load_records
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.simulation import client_parts
from fedlap_privacy.fl.run.user_runs import prepare_data

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
    input_shape: tuple[int, ...]  # one record's shape
    declared_classes: int | None  # the classes its file (or the run's dataset) declares

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


def _from_file(k: int, path: Path, device: torch.device) -> NodeData:
    records = load_records(path)  # each refusal is one line naming the file
    x, y = records.x, records.y
    return NodeData(k, torch.from_numpy(x).to(device), torch.from_numpy(y).to(device),
                    content_hash(x, y), DATA_FILE, records.input_shape,
                    records.declared_classes)


def load_partition(
    cfg: TrainConfig, node_config: dict[str, Any], device: torch.device
) -> NodeData:
    """The node's partition (module docstring)."""
    k = partition_id(node_config, cfg.clients)
    data_file = str(node_config.get("data-file", ""))
    if data_file:
        return _from_file(k, Path(data_file).expanduser(), device)
    data, parts = _simulated_split(cfg, str(node_config.get("data-dir", "")) or cfg.data_dir)
    part = parts[k]
    x, y = data.x_train[part], data.y_train[part]
    return NodeData(k, torch.from_numpy(x).to(device), torch.from_numpy(y).to(device),
                    content_hash(part, x, y), SIMULATED, data.input_shape, data.num_classes)


#: the last simulated split this process computed: (its key, the dataset, the parts). A
#: long-lived ClientApp process (a Simulation Engine's Ray actor) answers every round of a
#: run, and of thousands of virtual nodes, from one load of the data.
_LAST_SPLIT: list[tuple[str, Dataset, list[np.ndarray]]] = []


def _simulated_split(cfg: TrainConfig, data_dir: str | None
                     ) -> tuple[Dataset, list[np.ndarray]]:
    """The run's dataset and its split over the clients, as the simulator computes them;
    the same configuration (but ``rounds``) and data folder give the same answer, kept."""
    recorded = {k: v for k, v in cfg.to_dict().items() if k != "rounds"}
    key = json.dumps([recorded, data_dir], sort_keys=True, default=str)
    if _LAST_SPLIT and _LAST_SPLIT[0][0] == key:
        return _LAST_SPLIT[0][1], _LAST_SPLIT[0][2]
    if cfg.data is not None:  # simulation: the user's records on this (the same) machine
        cfg, data = prepare_data(cfg, _split_seed(cfg))
    else:
        data = load_dataset(cfg.dataset, data_dir)
    parts = client_parts(cfg, data)
    _LAST_SPLIT[:] = [(key, data, parts)]
    return data, parts


def _split_seed(cfg: TrainConfig) -> int:
    if cfg.split_seed is None:
        raise ConfigError("the instruction has no split seed, which a node without a "
                          "data-file needs to recompute its part of the run's data")
    return cfg.split_seed
