"""Membership scores calibrated with reference models: offline LiRA and offline RMIA.

Torch-free: every function takes per-record model outputs as numpy arrays of shape
``(n, classes)`` (logits, or probabilities with ``outputs="probs"``) and integer labels.
Reference models are "OUT" models: trained like the target but on data that excludes the
audited records (the offline setting of both papers). Every score is "higher = more likely
a member", as :mod:`fedlap_privacy.audit.bounds.metrics` expects.

* LiRA (N. Carlini, S. Chien, M. Nasr, S. Song, A. Terzis, F. Tramer, "Membership
  inference attacks from first principles", IEEE S&P 2022): the logit-scaled confidence
  ``phi = ln p_y - ln sum_{y' != y} p_y'`` ("logit scaling"), a Gaussian fitted per
  record to the OUT models' ``phi``, and the offline one-sided test (their Algorithm 1,
  offline variant): ``score = ln Phi((phi_target - mu_out) / sigma_out)``.
* RMIA (S. Zarifzadeh, P. Liu, R. Shokri, "Low-cost high-power membership inference
  attacks", ICML 2024): likelihood ratio against population records ``z``,
  ``LR(x, z) = [P(x|theta) / P(x)] / [P(z|theta) / P(z)]`` and
  ``score(x) = |{z : LR(x, z) > gamma}| / |Z|`` (their pairwise likelihood-ratio test),
  with the offline approximation ``P(x) = ((1 + a)/2) P_OUT(x) + (1 - a)/2`` (offline
  RMIA; ``a`` tuned on a reference model, :func:`tune_rmia_a`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy.special import log_ndtr, log_softmax, logsumexp
from sklearn.metrics import roc_auc_score

from fedlap_privacy.errors import ConfigError

__all__ = [
    "RmiaTuning",
    "lira_offline_scores",
    "lira_signal",
    "rmia_offline_scores",
    "true_label_probability",
    "tune_rmia_a",
]

Outputs = Literal["logits", "probs"]

#: Carlini et al. (2022) fit a global variance when fewer reference models than this exist.
FEW_REFERENCE_MODELS = 64

_PROB_FLOOR = 1e-300


def _log_probs(outputs: np.ndarray, kind: Outputs) -> np.ndarray:
    """Row-wise log-probabilities from logits (log-softmax) or probabilities (log)."""
    x = np.asarray(outputs, dtype=np.float64)
    if kind == "logits":
        if not np.all(np.isfinite(x)):
            raise ConfigError("logits must be finite")
        return log_softmax(x, axis=-1)
    if kind == "probs":
        if np.any(~np.isfinite(x)) or np.any(x < 0) or np.any(x > 1 + 1e-6):
            raise ConfigError("probabilities must lie in [0, 1]")
        with np.errstate(divide="ignore"):
            return np.log(np.maximum(x, _PROB_FLOOR))
    raise ConfigError(f"outputs must be 'logits' or 'probs', got {kind!r}")


def _check_outputs(outputs: np.ndarray, labels: np.ndarray, name: str) -> np.ndarray:
    """Validate ``(..., n, classes)`` outputs against ``(n,)`` integer labels."""
    out = np.asarray(outputs)
    lab = np.asarray(labels)
    if lab.ndim != 1 or not np.issubdtype(lab.dtype, np.integer):
        raise ConfigError("labels must be a 1-D integer array")
    if out.ndim < 2 or out.shape[-2] != lab.shape[0] or out.shape[-1] < 2:
        raise ConfigError(
            f"{name} must have shape (..., {lab.shape[0]}, classes >= 2), got {out.shape}"
        )
    if lab.size and (lab.min() < 0 or lab.max() >= out.shape[-1]):
        raise ConfigError(f"labels must lie in 0..{out.shape[-1] - 1}")
    return lab


def _take_label(values: np.ndarray, labels: np.ndarray) -> np.ndarray:
    idx = np.broadcast_to(labels[:, None], (*values.shape[:-1], 1))
    return np.take_along_axis(values, idx, axis=-1)[..., 0]


def true_label_probability(
    outputs: np.ndarray, labels: np.ndarray, outputs_kind: Outputs = "logits"
) -> np.ndarray:
    """``P(y | x, theta)`` per record (shape ``outputs.shape[:-1]``)."""
    labels = _check_outputs(outputs, labels, "outputs")
    return np.exp(_take_label(_log_probs(outputs, outputs_kind), labels))


def lira_signal(
    outputs: np.ndarray, labels: np.ndarray, outputs_kind: Outputs = "logits"
) -> np.ndarray:
    """LiRA's logit-scaled confidence ``phi = ln p_y - ln sum_{y' != y} p_y'``.

    Carlini et al. (2022), "logit scaling" of the confidence: computed as
    ``z_y - logsumexp_{y' != y} z_{y'}`` on the log-probabilities, which never forms
    ``1 - p_y`` and so stays exact for confident models. Works on any leading shape
    ``(..., n, classes)`` and returns ``(..., n)``.
    """
    labels = _check_outputs(outputs, labels, "outputs")
    logp = _log_probs(outputs, outputs_kind)
    own = _take_label(logp, labels)
    mask = np.zeros(logp.shape[-2:], dtype=bool)
    mask[np.arange(labels.shape[0]), labels] = True
    others = np.where(mask, -np.inf, logp)
    return own - logsumexp(others, axis=-1)


def lira_offline_scores(
    target_outputs: np.ndarray,
    labels: np.ndarray,
    reference_outputs: np.ndarray,
    outputs_kind: Outputs = "logits",
    global_variance: bool | None = None,
) -> np.ndarray:
    """Offline LiRA membership score (Carlini et al. 2022, Algorithm 1, offline variant).

    ``target_outputs``: ``(n, classes)``; ``reference_outputs``: ``(k, n, classes)`` from
    ``k >= 2`` reference models that did not train on these records (OUT). Per record,
    ``mu_out`` is the mean of the reference signals; the standard deviation is global
    (the root mean of the per-record variances) when ``global_variance`` is true, by
    default when ``k < 64`` as in the paper, and per record otherwise. The score is
    ``ln Phi((phi_target - mu_out) / sigma_out)``: the log of the one-sided tail
    probability of the OUT Gaussian (``log_ndtr`` keeps resolution where ``Phi`` rounds to
    1); it ranks records exactly as ``Phi`` or the z-score does.
    """
    labels = _check_outputs(target_outputs, labels, "target_outputs")
    if np.ndim(target_outputs) != 2:
        raise ConfigError("target_outputs must have shape (n, classes)")
    ref = np.asarray(reference_outputs)
    _check_outputs(ref, labels, "reference_outputs")
    if ref.ndim != 3 or ref.shape[-1] != np.shape(target_outputs)[-1]:
        raise ConfigError("reference_outputs must have shape (k, n, classes) like the target")
    k = ref.shape[0]
    if k < 2:
        raise ConfigError(f"LiRA needs at least 2 reference models to fit a variance, got {k}")
    phi = lira_signal(target_outputs, labels, outputs_kind)
    phi_ref = lira_signal(ref, labels, outputs_kind)  # (k, n)
    mu = phi_ref.mean(axis=0)
    var = phi_ref.var(axis=0, ddof=1)
    use_global = k < FEW_REFERENCE_MODELS if global_variance is None else global_variance
    sigma = np.full_like(mu, math.sqrt(float(var.mean()))) if use_global else np.sqrt(var)
    sigma = np.maximum(sigma, 1e-12)
    return log_ndtr((phi - mu) / sigma)


def _offline_ratio(p_target: np.ndarray, p_out_mean: np.ndarray, a: float) -> np.ndarray:
    """``P(x|theta) / P(x)`` with ``P(x) = ((1+a)/2) P_OUT(x) + (1-a)/2``."""
    prior = 0.5 * (1.0 + a) * p_out_mean + 0.5 * (1.0 - a)
    return p_target / np.maximum(prior, _PROB_FLOOR)


def _fraction_dominated(ratio_x: np.ndarray, ratio_z: np.ndarray, gamma: float) -> np.ndarray:
    """``|{z : ratio_x / ratio_z > gamma}| / |Z|`` for each x, by sorting (no n x |Z| array)."""
    sorted_z = np.sort(ratio_z)
    # ratio_x / ratio_z > gamma  <=>  ratio_z < ratio_x / gamma  (all ratios >= 0)
    return np.searchsorted(sorted_z, ratio_x / gamma, side="left") / sorted_z.size


def rmia_offline_scores(
    target_outputs: np.ndarray,
    labels: np.ndarray,
    reference_outputs: np.ndarray,
    population_target_outputs: np.ndarray,
    population_labels: np.ndarray,
    population_reference_outputs: np.ndarray,
    a: float = 0.3,
    gamma: float = 1.0,
    outputs_kind: Outputs = "logits",
    break_ties: bool = False,
) -> np.ndarray:
    """Offline RMIA membership score (Zarifzadeh, Liu, Shokri, ICML 2024).

    ``P(x|theta)`` is the target model's probability of the true label;
    ``P(x) = ((1+a)/2) P_OUT(x) + (1-a)/2`` with ``P_OUT`` the mean over the ``k >= 1``
    OUT reference models (``reference_outputs``: ``(k, n, classes)``); the same
    approximation is applied to the population records ``z`` (``population_*``: records
    that no model trained on, ``(n_pop, classes)`` and ``(k, n_pop, classes)``).
    ``score(x) = |{z : LR(x, z) > gamma}| / n_pop`` with
    ``LR(x, z) = [P(x|theta)/P(x)] / [P(z|theta)/P(z)]`` (the paper's test), computed by
    sorting the population ratios: ``O((n + n_pop) log n_pop)`` time, no ``n x n_pop``
    matrix. The paper uses ``gamma`` between 1 and 2 and tunes ``a`` (offline) on a
    reference model: see :func:`tune_rmia_a`. The score takes ``n_pop + 1`` distinct
    values, so a few thousand population records are needed for a useful TPR at low FPR.

    ``break_ties``: add ``0.5 / n_pop * r / (1 + r)`` with ``r = P(x|theta)/P(x)``, less than
    one step of the fraction, so records the fraction leaves tied (e.g. all those whose
    ratio exceeds every population ratio) are ordered by their ratio. The fraction is a
    non-decreasing function of that same ratio (for any ``gamma``), so this never reorders
    records the fraction separates; it only resolves ties, which matters for the TPR at
    low FPR when the population is small.
    """
    if not (math.isfinite(a) and -1.0 <= a <= 1.0):
        raise ConfigError(f"a must lie in [-1, 1] (0..1 in practice), got {a}")
    if not (math.isfinite(gamma) and gamma > 0):
        raise ConfigError(f"gamma must be finite and > 0, got {gamma}")
    classes = np.shape(target_outputs)[-1]
    for name, arr, ndim in (
        ("target_outputs", target_outputs, 2),
        ("reference_outputs", reference_outputs, 3),
        ("population_target_outputs", population_target_outputs, 2),
        ("population_reference_outputs", population_reference_outputs, 3),
    ):
        if np.ndim(arr) != ndim or np.shape(arr)[-1] != classes:
            raise ConfigError(f"{name} must have {ndim} dimensions and {classes} classes")
    if np.shape(reference_outputs)[0] != np.shape(population_reference_outputs)[0]:
        raise ConfigError("the same reference models must score the records and the population")
    if np.shape(reference_outputs)[0] < 1:
        raise ConfigError("RMIA needs at least one reference model")
    if np.shape(population_target_outputs)[0] < 1:
        raise ConfigError("RMIA needs at least one population record")
    p_x = true_label_probability(target_outputs, labels, outputs_kind)
    p_x_out = true_label_probability(reference_outputs, labels, outputs_kind).mean(axis=0)
    p_z = true_label_probability(population_target_outputs, population_labels, outputs_kind)
    p_z_out = true_label_probability(
        population_reference_outputs, population_labels, outputs_kind
    ).mean(axis=0)
    ratio_x = _offline_ratio(p_x, p_x_out, a)
    ratio_z = _offline_ratio(p_z, p_z_out, a)
    scores = _fraction_dominated(ratio_x, ratio_z, gamma)
    if break_ties:
        scores = scores + 0.5 / ratio_z.size * (ratio_x / (1.0 + ratio_x))
    return scores


@dataclass(frozen=True)
class RmiaTuning:
    """Outcome of :func:`tune_rmia_a`: the chosen ``a`` and the AUC of every candidate."""

    a: float
    auc: float
    grid: tuple[float, ...]
    aucs: tuple[float, ...]


def tune_rmia_a(
    reference_outputs: np.ndarray,
    labels: np.ndarray,
    target_members: np.ndarray,
    target_index: int = 0,
    grid: Sequence[float] | None = None,
    gamma: float = 1.0,
    outputs_kind: Outputs = "logits",
    seed: int | None = 0,
) -> RmiaTuning:
    """Choose RMIA's offline ``a`` by attacking one reference model with the others.

    Zarifzadeh et al. (ICML 2024), offline RMIA: ``a`` is not learnt from the target but
    from a reference model whose training set is known. ``reference_outputs``
    (``(k, n, classes)``, ``k >= 2``) are the reference models' outputs on ``n`` records;
    ``target_members`` (``(n,)`` bool) says which of them model ``target_index`` trained
    on. That model plays the target, the other ``k - 1`` the OUT references (records they
    trained on make ``P_OUT`` slightly high, as in the paper). Half of its non-members
    (drawn with ``seed``) form the population ``Z``; the members and the other
    non-members are scored, and the ``a`` of ``grid`` (default ``0, 0.1, ..., 1``) with
    the highest AUC is returned (ties: the smallest ``a``).

    Typical use: train ``k`` reference models on random halves of a population set,
    keep their outputs on that set and each one's membership mask, then
    ``a = tune_rmia_a(ref_outputs, ref_labels, masks[0]).a`` and pass ``a`` to
    :func:`rmia_offline_scores` (with OUT reference outputs on the audited records).
    ``a = 1`` uses ``P_OUT`` as is; a smaller ``a`` pulls ``P(x)`` towards 1/2, which
    compensates for OUT-only references underestimating the IN/OUT average (the reason
    for the approximation); the default 0.3 is only a starting point.
    """
    ref = np.asarray(reference_outputs)
    if ref.ndim != 3 or ref.shape[0] < 2:
        raise ConfigError("tuning needs reference_outputs of shape (k >= 2, n, classes)")
    labels = _check_outputs(ref, labels, "reference_outputs")
    members = np.asarray(target_members)
    if members.shape != labels.shape:
        raise ConfigError("target_members must be a boolean array with one entry per record")
    members = members.astype(bool)
    if not 0 <= target_index < ref.shape[0]:
        raise ConfigError(f"target_index must lie in 0..{ref.shape[0] - 1}")
    default = np.round(np.linspace(0.0, 1.0, 11), 10)
    candidates = tuple(float(x) for x in (default if grid is None else grid))
    if not candidates:
        raise ConfigError("the grid of candidate values of a is empty")
    non = np.flatnonzero(~members)
    if members.sum() < 1 or non.size < 4:
        raise ConfigError("tuning needs members and at least 4 non-members of the target")
    rng = np.random.default_rng(seed)
    non = rng.permutation(non)
    pop, held = non[: non.size // 2], non[non.size // 2 :]
    audit = np.concatenate([np.flatnonzero(members), held])
    truth = members[audit]
    others = np.delete(np.arange(ref.shape[0]), target_index)
    p_all = true_label_probability(ref, labels, outputs_kind)  # (k, n)
    p_target, p_out = p_all[target_index], p_all[others].mean(axis=0)
    aucs = []
    for a in candidates:
        if not -1.0 <= a <= 1.0:
            raise ConfigError(f"every candidate a must lie in [-1, 1], got {a}")
        scores = _fraction_dominated(
            _offline_ratio(p_target[audit], p_out[audit], a),
            _offline_ratio(p_target[pop], p_out[pop], a),
            gamma,
        )
        aucs.append(float(roc_auc_score(truth, scores)))
    best = int(np.argmax(aucs))
    return RmiaTuning(a=candidates[best], auc=aucs[best], grid=candidates, aucs=tuple(aucs))
