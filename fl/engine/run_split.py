"""The run's split of the training records: the validation hold-out and each client's part
(docs/algorithms.md#splits), drawn from the split seed, the same in every driver and on
every node."""

from __future__ import annotations

import numpy as np

from fedlap_privacy.data.client_splits import holdout_indices, split_clients, subsample_parts
from fedlap_privacy.data.datasets import Dataset
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig

__all__ = ["client_parts", "validation_indices"]


def _split_seed(cfg: TrainConfig, split_seed: int | None, natural: bool = False) -> int:
    """``cfg.split_seed`` when set, else the run's (secret) ``split_seed``; a split that
    draws nothing (the non-IID split or a user's ``natural`` partition, nothing held out or
    cut) needs neither."""
    seed = cfg.split_seed if cfg.split_seed is not None else split_seed
    if seed is not None:
        return seed
    if ((natural or cfg.split == "noniid") and not cfg.validation_records
            and cfg.client_records is None):
        return 0  # unused: this split is a function of the labels alone
    raise ConfigError("the split of this run is drawn from its split seed, which is secret: "
                      "pass the run's split seed (private.pt) or set split_seed")


def validation_indices(cfg: TrainConfig, data: Dataset, split_seed: int | None = None
                       ) -> np.ndarray:
    """The training records held out as the run's validation split (``validation_records``
    of them, drawn from the split seed: ``cfg.split_seed`` or the run's secret
    ``split_seed``; none when 0). No client holds them."""
    if cfg.validation_records == 0:
        return np.empty(0, dtype=np.int64)
    return holdout_indices(len(data.y_train), cfg.validation_records,
                           _split_seed(cfg, split_seed))


def client_parts(cfg: TrainConfig, data: Dataset, split_seed: int | None = None
                 ) -> list[np.ndarray]:
    """The run's split of the training records over its clients (docs/algorithms.md#splits):
    the records left after the validation split, each client cut to ``client_records`` when
    set; all drawn from the split seed (``cfg.split_seed``, else the run's secret
    ``split_seed``), never from the seed of the initial weights; the same in every driver,
    on every node. A user's natural partition (:mod:`~fedlap_privacy.fl.run.user_runs`) is kept:
    only the hold-out and the cuts are drawn."""
    seed = _split_seed(cfg, split_seed, natural=data.partition is not None)
    keep = np.setdiff1d(np.arange(len(data.y_train)), validation_indices(cfg, data, seed))
    if data.partition is not None:
        kept = np.zeros(len(data.y_train), dtype=bool)
        kept[keep] = True  # one mask, not a search per client: thousands of clients scale
        parts = [p[kept[p]] for p in data.partition]
    else:
        parts = [keep[p] for p in split_clients(
            data.y_train[keep], cfg.clients, cfg.split, cfg.dirichlet_alpha, seed,
            data.num_classes,
        )]
    _refuse_empty_clients(cfg, parts)
    return _cut(cfg, parts, seed)


def _refuse_empty_clients(cfg: TrainConfig, parts: list[np.ndarray]) -> None:
    """One line for a client left without records (a natural partition's empty client, or
    one emptied by the validation hold-out), in every driver before any step."""
    empty = next((k for k, p in enumerate(parts) if p.size == 0), None)
    if empty is None:
        return
    if cfg.validation_records:
        raise ConfigError(f"client {empty} holds no records once the {cfg.validation_records}"
                          " validation records are held out: hold out fewer")
    count = sum(p.size == 0 for p in parts)
    raise ConfigError(f"client {empty} holds no records ({count} of {len(parts)} clients are "
                      "empty): every client needs at least one")


def _cut(cfg: TrainConfig, parts: list[np.ndarray], seed: int) -> list[np.ndarray]:
    """Each part cut to ``client_records`` when set (drawn from the split seed ``seed``)."""
    if cfg.client_records is None:
        return parts
    return subsample_parts(parts, cfg.client_records, seed)
