"""The client splits (fedlap_privacy.data.client_splits): the paper's non-IID split, IID,
Dirichlet, the cross-device shards and label-Dirichlet splits, the per-client caps and the
validation hold-out."""

from __future__ import annotations

import numpy as np
import pytest

from fedlap_privacy.data.client_splits import holdout_indices, split_clients, subsample_parts
from fedlap_privacy.data.datasets import PAPER_CLASS_ORDER
from fedlap_privacy.errors import ConfigError


def _labels(per_class: int = 30, classes: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(classes), per_class))


def _assert_partition(parts: list[np.ndarray], n: int) -> None:
    for part in parts:
        assert part.dtype == np.int64 and np.all(np.diff(part) > 0)  # sorted, no repeats
    joined = np.concatenate(parts)
    assert len(joined) == n and np.array_equal(np.sort(joined), np.arange(n))


def test_noniid_matches_the_paper() -> None:
    labels = _labels()
    parts = split_clients(labels, 5)
    _assert_partition(parts, len(labels))
    classes = [sorted(set(labels[p].tolist())) for p in parts]
    assert classes == [[5, 6], [1, 2], [0, 8], [3, 9], [4, 7]]
    assert [len(p) for p in parts] == [60] * 5  # all records of both classes


def test_noniid_other_client_counts() -> None:
    labels = _labels()
    parts = split_clients(labels, 3)
    assert [sorted(set(labels[p].tolist())) for p in parts] == [[1, 2, 5, 6], [0, 8, 9], [3, 4, 7]]
    assert [set(labels[p].tolist()) for p in split_clients(labels, 10)] == [
        {c} for c in PAPER_CLASS_ORDER
    ]
    three = _labels(classes=4)
    assert [sorted(set(three[p].tolist())) for p in split_clients(three, 2)] == [[0, 1], [2, 3]]
    with pytest.raises(ConfigError, match="num_clients <= 10"):
        split_clients(labels, 11)


def test_iid_sizes() -> None:
    labels = _labels()
    parts = split_clients(labels, 7, kind="iid", seed=3)
    _assert_partition(parts, len(labels))
    assert sorted({len(p) for p in parts}) == [42, 43]
    again = split_clients(labels, 7, kind="iid", seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = split_clients(labels, 7, kind="iid", seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


@pytest.mark.parametrize("alpha", [0.05, 0.5, 100.0])
def test_dirichlet_deterministic_and_non_empty(alpha: float) -> None:
    labels = _labels()
    parts = split_clients(labels, 10, kind="dirichlet", alpha=alpha, seed=7)
    _assert_partition(parts, len(labels))
    assert all(len(p) > 0 for p in parts)
    again = split_clients(labels, 10, kind="dirichlet", alpha=alpha, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_dirichlet_skew_depends_on_alpha() -> None:
    labels = _labels(per_class=200)

    def classes_per_client(alpha: float) -> float:
        parts = split_clients(labels, 5, kind="dirichlet", alpha=alpha, seed=0)
        return float(np.mean([len(set(labels[p].tolist())) for p in parts]))

    assert classes_per_client(0.05) < classes_per_client(100.0) == 10


def test_shards_give_each_client_two_label_sorted_shards() -> None:
    labels = _labels(per_class=100)  # 1,000 records, 100 clients: 200 shards of 5 records
    parts = split_clients(labels, 100, kind="shards", seed=3)
    _assert_partition(parts, len(labels))
    assert {len(p) for p in parts} == {10}
    # a shard lies inside one label (100 records per label, 5 per shard), so a client holds
    # at most 2 labels, and McMahan's split gives most clients 2
    labels_per_client = [len(set(labels[p].tolist())) for p in parts]
    assert max(labels_per_client) == 2 and labels_per_client.count(2) > 70
    assert all(np.array_equal(a, b) for a, b in
               zip(parts, split_clients(labels, 100, kind="shards", seed=3), strict=True))
    other = split_clients(labels, 100, kind="shards", seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_label_dirichlet_scales_to_clients_of_a_few_records() -> None:
    labels = _labels(per_class=300)  # 3,000 records in 1,000 clients of 3
    parts = split_clients(labels, 1000, kind="label-dirichlet", alpha=0.1, seed=1)
    _assert_partition(parts, len(labels))
    assert {len(p) for p in parts} == {3}
    # the per-class dirichlet split cannot make these clients (some stay empty)
    with pytest.raises(ConfigError, match="without records"):
        split_clients(labels, 1000, kind="dirichlet", alpha=0.1, seed=1)

    def labels_per_client(alpha: float) -> float:
        parts = split_clients(labels, 300, kind="label-dirichlet", alpha=alpha, seed=0)
        return float(np.mean([len(set(labels[p].tolist())) for p in parts]))

    assert labels_per_client(0.05) < 2.0 < 6.0 < labels_per_client(100.0)


def test_dirichlet_impossible_is_a_config_error() -> None:
    labels = np.zeros(3, dtype=np.int64)  # one class, 3 records, 3 clients, extreme skew
    with pytest.raises(ConfigError, match="without records"):
        split_clients(labels, 3, kind="dirichlet", alpha=1e-3, seed=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_clients": 0}, "num_clients"),
        ({"num_clients": 2, "kind": "pathological"}, "unknown split kind 'pathological'"),
        ({"num_clients": 151, "kind": "shards"}, "at most 150 clients"),
        ({"num_clients": 2, "kind": "label-dirichlet", "alpha": -1.0}, "alpha"),
        ({"num_clients": 2, "kind": "dirichlet", "alpha": 0.0}, "alpha"),
        ({"num_clients": 2, "kind": "dirichlet", "alpha": float("nan")}, "alpha"),
        ({"num_clients": 2, "num_classes": 5}, r"0\.\.4"),
        ({"num_clients": 301, "kind": "iid"}, "exceeds"),
    ],
)
def test_bad_split_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        split_clients(_labels(), **kwargs)


def test_noniid_with_a_missing_class_is_a_config_error() -> None:
    labels = np.array([0, 1, 2, 3, 4, 7, 8, 9] * 3)  # no records of classes 5 and 6
    with pytest.raises(ConfigError, match=r"\[5, 6\] have no records"):
        split_clients(labels, 5, num_classes=10)




def test_subsample_parts_caps_each_client_reproducibly():
    y = np.repeat(np.arange(10), 100)
    parts = split_clients(y, 5, "noniid")
    small = subsample_parts(parts, 60, seed=0)
    assert [len(p) for p in small] == [60] * 5
    for full, cut in zip(parts, small, strict=True):
        assert np.isin(cut, full).all() and np.all(np.diff(cut) > 0)
        assert len(np.unique(y[cut])) == 2  # the client's two classes, both kept
    again = subsample_parts(parts, 60, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(small, again, strict=True))
    assert not np.array_equal(subsample_parts(parts, 60, seed=1)[0], small[0])
    assert subsample_parts(parts, 10_000, seed=0)[0] is parts[0]  # smaller parts untouched
    with pytest.raises(ConfigError):
        subsample_parts(parts, 0, seed=0)


def test_holdout_indices_are_a_seeded_subset():
    held = holdout_indices(1000, 100, seed=3)
    assert len(np.unique(held)) == 100 and held.min() >= 0 and held.max() < 1000
    assert np.array_equal(held, holdout_indices(1000, 100, seed=3))
    assert not np.array_equal(held, holdout_indices(1000, 100, seed=4))
    for bad in (0, 1000):
        with pytest.raises(ConfigError, match="validation split"):
            holdout_indices(1000, bad, seed=0)
