"""Offline LiRA (Carlini et al. 2022) and offline RMIA (Zarifzadeh, Liu, Shokri 2024).

Synthetic world with a known ground truth, numpy only: each record has a difficulty (the
true-label logit margin any model reaches on it, widely spread: some records are always
hard, some always easy); each model adds its own training noise; the target model gives
its members a boost. Reference models are trained "OUT": the same difficulty and noise,
no boost. The loss attack cannot tell a hard member from an easy non-member; the
reference-model attacks calibrate each record's difficulty away.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import log_softmax, softmax
from sklearn.metrics import roc_auc_score, roc_curve

from fedlap_privacy.audit import (
    RmiaTuning,
    lira_offline_scores,
    lira_signal,
    rmia_offline_scores,
    true_label_probability,
    tune_rmia_a,
)
from fedlap_privacy.audit.bounds.metrics import tpr_at_fpr
from fedlap_privacy.errors import ConfigError

CLASSES = 10


class World:
    """Records with per-record difficulty; models are noisy draws around it."""

    def __init__(self, n: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n = n
        self.difficulty = self.rng.normal(1.5, 2.0, n)  # true-label margin
        self.rest = self.rng.normal(0.0, 1.0, (n, CLASSES))  # the other classes' logits
        self.labels = self.rng.integers(0, CLASSES, n)

    def model(self, members: np.ndarray, boost: float = 1.0, noise: float = 0.5) -> np.ndarray:
        logits = self.rest + self.rng.normal(0.0, 0.3, self.rest.shape)
        margin = self.difficulty + self.rng.normal(0.0, noise, self.n) + boost * members
        logits[np.arange(self.n), self.labels] = margin
        return logits


def _setup(n: int = 4000, n_pop: int = 4000, k: int = 8, seed: int = 0) -> dict:
    world = World(n + n_pop, seed)
    members = np.zeros(n + n_pop, dtype=bool)
    members[: n // 2] = True
    out = np.zeros(n + n_pop, dtype=bool)
    return {
        "world": world,
        "truth": members[:n],
        "labels": world.labels[:n],
        "pop_labels": world.labels[n:],
        "target": world.model(members),
        "other": world.model(out),  # a target that is just another OUT model
        "refs": np.stack([world.model(out) for _ in range(k)]),
        "n": n,
    }


def _metrics(truth: np.ndarray, scores: np.ndarray) -> tuple[float, float]:
    fpr, tpr, _ = roc_curve(truth, scores)
    return float(roc_auc_score(truth, scores)), tpr_at_fpr(fpr, tpr, 0.01)


def _rmia(s: dict, target: np.ndarray, **kw: float) -> np.ndarray:
    n = s["n"]
    return rmia_offline_scores(
        target[:n],
        s["labels"],
        s["refs"][:, :n],
        target[n:],
        s["pop_labels"],
        s["refs"][:, n:],
        **kw,
    )


@pytest.fixture(scope="module")
def world() -> dict:
    return _setup()


def test_signal_and_probability_are_stable_and_agree() -> None:
    logits = np.array([[2.0, 0.0, -1.0], [800.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    labels = np.array([0, 0, 2])
    phi = lira_signal(logits, labels)
    p = softmax(logits, axis=1)[np.arange(3), labels]
    assert phi[0] == pytest.approx(np.log(p[0]) - np.log(1 - p[0]))
    assert phi[1] == pytest.approx(800.0 - np.log(2.0))  # no overflow, no log(0)
    assert phi[2] == pytest.approx(-np.log(2.0))
    probs = softmax(logits[[0, 2]], axis=1)
    assert lira_signal(probs, labels[[0, 2]], "probs") == pytest.approx(phi[[0, 2]])
    assert true_label_probability(logits, labels) == pytest.approx(p)
    assert true_label_probability(probs, labels[[0, 2]], "probs") == pytest.approx(p[[0, 2]])
    # Leading model axis: (k, n, classes) -> (k, n).
    stacked = np.stack([logits, logits + 1.0])
    assert lira_signal(stacked, labels) == pytest.approx(np.stack([phi, phi]))


def test_reference_attacks_beat_the_loss_attack(world: dict) -> None:
    n, truth = world["n"], world["truth"]
    loss = _metrics(truth, np.log(true_label_probability(world["target"][:n], world["labels"])))
    lira = _metrics(
        truth, lira_offline_scores(world["target"][:n], world["labels"], world["refs"][:, :n])
    )
    rmia = _metrics(truth, _rmia(world, world["target"]))
    # Measured: loss AUC 0.63 / TPR@1% 0.02; LiRA 0.90 / 0.30; RMIA 0.70 / 0.20.
    assert lira[0] > loss[0] + 0.15 and lira[1] > 5 * loss[1]
    assert rmia[0] > loss[0] + 0.04 and rmia[1] > 4 * loss[1]
    # Same with probabilities instead of logits.
    probs = softmax(world["target"], axis=1)
    ref_probs = softmax(world["refs"], axis=2)
    lira_p = lira_offline_scores(probs[:n], world["labels"], ref_probs[:, :n], "probs")
    assert _metrics(truth, lira_p)[0] == pytest.approx(lira[0], abs=1e-6)


def test_a_target_that_is_another_out_model_gives_auc_one_half(world: dict) -> None:
    n, truth = world["n"], world["truth"]
    lira = lira_offline_scores(world["other"][:n], world["labels"], world["refs"][:, :n])
    assert abs(roc_auc_score(truth, lira) - 0.5) < 0.03
    assert abs(roc_auc_score(truth, _rmia(world, world["other"])) - 0.5) < 0.03


def test_scores_do_not_depend_on_record_order(world: dict) -> None:
    n = world["n"]
    perm = np.random.default_rng(9).permutation(n)
    target, labels, refs = world["target"][:n], world["labels"], world["refs"][:, :n]
    lira = lira_offline_scores(target, labels, refs)
    assert lira_offline_scores(target[perm], labels[perm], refs[:, perm]) == pytest.approx(
        lira[perm]
    )
    rmia = _rmia(world, world["target"])
    pop_perm = n + np.random.default_rng(10).permutation(n)
    shuffled = rmia_offline_scores(
        target[perm],
        labels[perm],
        refs[:, perm],
        world["target"][pop_perm],
        world["world"].labels[pop_perm],
        world["refs"][:, pop_perm],
    )
    assert shuffled == pytest.approx(rmia[perm])


def test_rmia_matches_the_pairwise_definition() -> None:
    s = _setup(n=300, n_pop=200, k=2, seed=3)
    n, a, gamma = s["n"], 0.3, 1.5
    p = log_softmax(s["target"], axis=1)[np.arange(500), s["world"].labels]
    p_out = log_softmax(s["refs"], axis=2)[:, np.arange(500), s["world"].labels]
    prior = 0.5 * (1 + a) * np.exp(p_out).mean(axis=0) + 0.5 * (1 - a)
    ratio = np.exp(p) / prior
    lr = ratio[:n, None] / ratio[None, n:]  # the full n x n_pop matrix
    expected = (lr > gamma).mean(axis=1)
    assert _rmia(s, s["target"], a=a, gamma=gamma) == pytest.approx(expected)
    # A larger gamma is a stricter test.
    assert np.all(_rmia(s, s["target"], gamma=2.0) <= _rmia(s, s["target"], gamma=1.0))


def test_lira_variance_modes() -> None:
    s = _setup(n=400, n_pop=0, k=64, seed=4)
    target, labels, refs = s["target"], s["labels"], s["refs"]
    per_record = lira_offline_scores(target, labels, refs)  # k = 64: per-record variance
    fixed = lira_offline_scores(target, labels, refs, global_variance=True)
    assert not np.allclose(per_record, fixed)
    phi_ref = lira_signal(refs, labels)
    z = (lira_signal(target, labels) - phi_ref.mean(0)) / phi_ref.std(0, ddof=1)
    assert np.array_equal(np.argsort(per_record), np.argsort(z))
    assert np.all(per_record <= 0)  # log of a probability
    assert lira_offline_scores(target, labels, refs[:10]) == pytest.approx(
        lira_offline_scores(target, labels, refs[:10], global_variance=True)
    )


def test_tune_rmia_a_on_a_reference_model() -> None:
    world = World(4000, seed=5)
    k = 6
    members = world.rng.random((k, 4000)) < 0.5
    refs = np.stack([world.model(members[j]) for j in range(k)])
    tuning = tune_rmia_a(refs, world.labels, members[0])
    assert isinstance(tuning, RmiaTuning)
    assert len(tuning.aucs) == len(tuning.grid) == 11 and tuning.a in tuning.grid
    assert tuning.auc == max(tuning.aucs) > 0.6
    custom = tune_rmia_a(refs, world.labels, members[0], grid=[0.1, 0.9], gamma=1.5)
    assert custom.grid == (0.1, 0.9)


def test_reference_attacks_reject_bad_input(world: dict) -> None:
    n, target, labels, refs = world["n"], world["target"], world["labels"], world["refs"]
    with pytest.raises(ConfigError):
        lira_offline_scores(target[:n], labels, refs[:1, :n])  # one reference model
    with pytest.raises(ConfigError):
        lira_offline_scores(target[:n], labels[:-1], refs[:, :n])
    with pytest.raises(ConfigError):
        lira_signal(target[:n], labels.astype(float))
    with pytest.raises(ConfigError):
        lira_signal(target[:n], labels + CLASSES)
    with pytest.raises(ConfigError):
        lira_signal(np.full((n, CLASSES), 2.0), labels, "probs")
    with pytest.raises(ConfigError):
        _rmia(world, target, gamma=0.0)
    with pytest.raises(ConfigError):
        _rmia(world, target, a=2.0)
    with pytest.raises(ConfigError):
        tune_rmia_a(refs[:, :n], labels, np.zeros(n, dtype=bool))  # no members
