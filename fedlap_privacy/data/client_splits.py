"""The splits of a training set over the clients (docs/algorithms.md#splits).

The paper's non-IID split (5 clients x 2 classes, class order ``[5, 6, 1, 2, 0, 8, 9, 3, 4,
7]``, each client holding all records of its classes), IID, Dirichlet(alpha) label skew, and
two cross-device splits for thousands of clients with a few records each: McMahan et al.
2017's label shards and a Dirichlet(alpha) label mix per client (Hsu et al. 2019); and the
validation hold-out and per-client subsampling carved from the training records.
"""

from __future__ import annotations

import math

import numpy as np

from fedlap_privacy.data.datasets import NUM_CLASSES, PAPER_CLASS_ORDER, SPLITS
from fedlap_privacy.errors import ConfigError

_DIRICHLET_TRIES = 100


def holdout_indices(num_records: int, records: int, seed: int) -> np.ndarray:
    """A uniformly random, sorted set of ``records`` of ``num_records`` training indices,
    drawn from ``seed``: a validation split carved from the training data."""
    if not 1 <= records < num_records:
        raise ConfigError(f"a validation split of {records} records needs 1 <= records < "
                          f"{num_records} (the training records)")
    rng = np.random.default_rng([seed, num_records, records])
    return np.sort(rng.choice(num_records, records, replace=False)).astype(np.int64)


def subsample_parts(parts: list[np.ndarray], records: int, seed: int) -> list[np.ndarray]:
    """Each part cut to at most ``records`` indices, a uniformly random subset (sorted) drawn
    from ``seed``: smaller clients with the split's class mix (e.g. FashionMNIST's non-IID
    split at 1,600 instead of 12,000 records per client)."""
    if records < 1:
        raise ConfigError(f"records per client must be >= 1, got {records}")
    rng = np.random.default_rng([seed, records])
    return [p if p.size <= records else np.sort(rng.choice(p, records, replace=False))
            for p in parts]


def split_clients(
    labels: np.ndarray,
    num_clients: int,
    kind: str = "noniid",
    alpha: float = 0.5,
    seed: int = 0,
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """Partition the training set among clients (docs/algorithms.md#splits); sorted int64
    index arrays.

    * ``noniid`` -- the paper's split: the class order ``[5,6,1,2,0,8,9,3,4,7]`` (range
      order unless there are 10 classes) cut into ``num_clients`` contiguous groups with
      ``np.array_split``; each client holds all records of its classes.
    * ``iid`` -- a random permutation cut into ``num_clients`` nearly equal parts.
    * ``dirichlet`` -- per class, shares ~ Dirichlet(alpha * ones); resampled (a bounded
      number of times) until every client has at least one record.
    * ``shards`` -- McMahan et al. 2017 (Communication-efficient learning of deep networks
      from decentralized data, section 3): the records sorted by label (in a random order
      within a label), cut into ``2 * num_clients`` shards, two random shards per client.
    * ``label-dirichlet`` -- Hsu et al. 2019 (Measuring the effects of non-identical data
      distribution): every client gets N / num_clients records (up to one) whose labels
      follow its own mix q_k ~ Dirichlet(alpha * ones) over the classes, drawn without
      replacement (a class that runs out leaves the mix). Every client is non-empty by
      construction, so it scales to thousands of clients of a few records each.

    Deterministic given ``seed``; the parts are disjoint and cover every record.
    """
    y = np.asarray(labels)
    if y.ndim != 1 or y.size == 0 or y.dtype.kind not in "iu":
        raise ConfigError("labels must be a non-empty 1-D array of integers")
    if (
        isinstance(num_clients, bool)
        or not isinstance(num_clients, int | np.integer)
        or num_clients < 1
    ):
        raise ConfigError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    if kind not in SPLITS:
        raise ConfigError(f"unknown split kind {kind!r}; choose one of {', '.join(SPLITS)}")
    classes = int(y.max()) + 1 if num_classes is None else int(num_classes)
    if y.min() < 0 or y.max() >= classes:
        raise ConfigError(
            f"labels must lie in 0..{classes - 1}, found {int(y.min())}..{int(y.max())}"
        )
    if kind != "noniid" and num_clients > len(y):
        raise ConfigError(f"num_clients {num_clients} exceeds the {len(y)} training records")
    if kind == "shards" and 2 * num_clients > len(y):
        raise ConfigError(f"the shards split cuts {2 * num_clients} shards (2 per client) "
                          f"from {len(y)} training records: at most {len(y) // 2} clients")
    rng = np.random.default_rng(seed)

    if kind == "noniid":
        if num_clients > classes:
            raise ConfigError(
                f"the noniid split needs num_clients <= {classes} classes, got {num_clients}"
            )
        order = np.asarray(PAPER_CLASS_ORDER if classes == NUM_CLASSES else range(classes))
        parts = []
        for group in np.array_split(order, num_clients):
            part = np.flatnonzero(np.isin(y, group)).astype(np.int64)
            if part.size == 0:
                raise ConfigError(f"noniid split: classes {group.tolist()} have no records")
            parts.append(part)
        return parts

    if kind == "iid":
        return [
            np.sort(p).astype(np.int64)
            for p in np.array_split(rng.permutation(len(y)), num_clients)
        ]

    if kind == "shards":
        return _shards(y, num_clients, rng)

    try:
        concentration = float(alpha)
    except (TypeError, ValueError):
        concentration = math.nan
    if not (math.isfinite(concentration) and concentration > 0):
        raise ConfigError(f"dirichlet alpha must be a positive number, got {alpha!r}")
    if kind == "label-dirichlet":
        return _label_dirichlet(y, num_clients, concentration, classes, rng)
    by_class = [np.flatnonzero(y == c) for c in range(classes)]
    for _ in range(_DIRICHLET_TRIES):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            if idx.size == 0:
                continue
            shares = rng.dirichlet(np.full(num_clients, concentration))
            cuts = (np.cumsum(shares)[:-1] * idx.size).astype(np.int64)
            for bucket, piece in zip(buckets, np.split(rng.permutation(idx), cuts), strict=True):
                bucket.append(piece)
        parts = [np.sort(np.concatenate(b)).astype(np.int64) for b in buckets]
        if all(p.size for p in parts):
            return parts
    raise ConfigError(
        f"dirichlet split with alpha={alpha} left a client without records "
        f"after {_DIRICHLET_TRIES} draws; use a larger alpha or fewer clients"
    )


def _shards(y: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """McMahan et al. 2017's pathological non-IID split (see :func:`split_clients`)."""
    shuffled = rng.permutation(len(y))
    by_label = shuffled[np.argsort(y[shuffled], kind="stable")]
    shards = np.array_split(by_label, 2 * num_clients)
    owner = rng.permutation(2 * num_clients)
    return [np.sort(np.concatenate([shards[owner[2 * k]], shards[owner[2 * k + 1]]]))
            .astype(np.int64) for k in range(num_clients)]


def _label_dirichlet(y: np.ndarray, num_clients: int, alpha: float, classes: int,
                     rng: np.random.Generator) -> list[np.ndarray]:
    """Hsu et al. 2019's split (see :func:`split_clients`): client k's labels drawn from its
    own q_k ~ Dirichlet(alpha), without replacement, classes that run out dropped."""
    pools = [rng.permutation(np.flatnonzero(y == c)) for c in range(classes)]
    left = np.array([p.size for p in pools], dtype=np.int64)
    taken = np.zeros(classes, dtype=np.int64)
    mixes = rng.dirichlet(np.full(classes, alpha), size=num_clients)
    parts = []
    for k, size in enumerate(np.diff(np.linspace(0, len(y), num_clients + 1).astype(np.int64))):
        counts = np.zeros(classes, dtype=np.int64)
        need = int(size)
        while need > 0:
            weights = np.where(left > 0, mixes[k], 0.0)
            if weights.sum() <= 0:  # its mix is on exhausted classes only: any class left
                weights = (left > 0).astype(np.float64)
            draw = np.minimum(rng.multinomial(need, weights / weights.sum()), left)
            counts += draw
            left -= draw
            need -= int(draw.sum())
        parts.append(np.sort(np.concatenate(
            [pools[c][taken[c]:taken[c] + counts[c]] for c in range(classes)])).astype(np.int64))
        taken += counts
    return parts
