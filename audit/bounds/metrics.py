"""Attack metrics: ROC, AUC, TPR at low FPR, balanced accuracy, epsilon lower bound (docs/audit.md).

Conventions: ``labels`` are 1 for members and 0 for non-members; ``scores`` are "higher =
more likely a member"; a threshold ``t`` predicts *member* for ``score >= t``.

* ROC / AUC: ``sklearn.metrics.roc_curve`` / ``roc_auc_score`` (AUC 0.5 = random guess).
* TPR at FPR ``x`` (Carlini et al. 2022, "Membership inference attacks from first
  principles"): the best TPR among thresholds whose empirical FPR is ``<= x`` -- no
  interpolation between ROC points, so never optimistic. With ``n`` non-members the
  smallest non-zero FPR is ``1/n``; for ``x < 1/n`` this is the TPR at FPR = 0.
* Balanced accuracy: ``max_t (TPR + TNR) / 2`` over all thresholds of the evaluated set
  (the best threshold, chosen on that same set -- an optimistic summary, as in the paper's
  "attack accuracy"); on the balanced sets of :mod:`.membership` it equals accuracy.
* Epsilon lower bound (Jagielski et al. 2020; Nasr et al. 2021;
  docs/audit.md#epsilon-lower-bound): an
  ``(epsilon, delta)``-DP mechanism forces every test to satisfy
  ``FPR + e^eps FNR >= 1 - delta`` and ``FNR + e^eps FPR >= 1 - delta``, hence at each
  threshold ``eps >= max(log((1-delta-FPR)/FNR), log((1-delta-FNR)/FPR))``. The rates are
  replaced by their one-sided Clopper-Pearson *upper* bounds (``scipy.stats.beta``), the
  largest value over thresholds is taken and clamped at 0.

  Confidence semantics -- the conservative option: the max over thresholds is a multiple
  comparison, so the level ``alpha = 1 - confidence`` is split (Bonferroni) over two bounds
  (FPR and FNR) per candidate threshold, and the number of candidates is taken as
  ``n_members + n_nonmembers + 1`` (every possible cut of the sorted scores, a bound that
  does not depend on the data), times ``family_size`` (the number of attacks whose maximum
  is reported). With probability >= ``confidence`` (over the draw of the audit records)
  *all* the bounds hold at once, so the reported maximum is a valid lower bound rather than
  the optimistic max of per-threshold bounds. Caveat: this is the paper's protocol with
  fixed (not randomly included) members and one trained model; it treats records as
  independent trials, which one training run does not strictly give (Steinke, Nasr,
  Jagielski 2023). It is an audit heuristic that a correct implementation must pass,
  not a proof of privacy.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import beta
from sklearn.metrics import roc_auc_score, roc_curve

from fedlap_privacy.audit.reports.results import AttackResult
from fedlap_privacy.errors import ConfigError

__all__ = [
    "attack_metrics",
    "best_balanced_accuracy",
    "clopper_pearson_interval",
    "clopper_pearson_upper",
    "epsilon_lower_bound",
    "error_counts",
    "tpr_at_fpr",
]

LOW_FPRS = (0.001, 0.01)


def clopper_pearson_upper(k: np.ndarray | int, n: int, alpha: float) -> np.ndarray:
    """One-sided upper ``1 - alpha`` Clopper-Pearson bound on a rate from ``k`` of ``n``.

    ``P[p <= upper] >= 1 - alpha``; it is ``beta.ppf(1 - alpha, k + 1, n - k)``, and 1 for
    ``k = n``. For ``k = 0`` it is ``1 - alpha ** (1 / n)`` > 0, so a bound is never 0.
    """
    if n < 1:
        raise ConfigError(f"a Clopper-Pearson bound needs n >= 1 trials, got {n}")
    if not 0 < alpha < 1:
        raise ConfigError(f"alpha must lie in (0, 1), got {alpha}")
    k = np.asarray(k, dtype=np.float64)
    if np.any((k < 0) | (k > n)):
        raise ConfigError(f"counts must lie in 0..{n}")
    full = k >= n
    upper = beta.ppf(1.0 - alpha, k + 1.0, np.where(full, 1.0, n - k))
    return np.where(full, 1.0, upper)


def clopper_pearson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The two-sided exact (Clopper-Pearson) interval, ``alpha/2`` in each tail."""
    alpha = 1.0 - confidence
    lower = 0.0 if k == 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
    upper = float(clopper_pearson_upper(k, n, alpha / 2))
    return lower, upper


def _check(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, dtype=np.float64)
    if labels.shape != scores.shape or labels.ndim != 1:
        raise ConfigError("labels and scores must be 1-D arrays of the same length")
    if labels.all() or not labels.any():
        raise ConfigError("metrics need both members and non-members")
    if not np.all(np.isfinite(scores)):
        raise ConfigError("scores must be finite")
    return labels, scores


def error_counts(
    labels: np.ndarray, scores: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every distinct cut: ``(thresholds, false positives, false negatives)`` as counts.

    Thresholds run from ``+inf`` (nobody is called a member) down to the lowest score
    (everybody is); each predicts member for ``score >= threshold``.
    """
    labels, scores = _check(labels, scores)
    pos = np.sort(scores[labels])
    neg = np.sort(scores[~labels])
    thresholds = np.concatenate([[np.inf], np.unique(scores)[::-1]])
    fp = len(neg) - np.searchsorted(neg, thresholds, side="left")
    fn = np.searchsorted(pos, thresholds, side="left")
    return thresholds, fp, fn


def epsilon_lower_bound(
    labels: np.ndarray,
    scores: np.ndarray,
    delta: float = 0.0,
    confidence: float = 0.95,
    family_size: int = 1,
) -> dict[str, float]:
    """Empirical lower bound on epsilon with Clopper-Pearson bounds (module docstring).

    Returns ``eps_lb`` (>= 0), the ``threshold`` where it is reached, the bounds
    ``fpr_hi`` / ``fnr_hi`` there, and ``alpha_per_bound`` (the Bonferroni share).
    """
    labels, scores = _check(labels, scores)
    if not 0 <= delta < 1:
        raise ConfigError(f"delta must lie in [0, 1), got {delta}")
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must lie in (0, 1), got {confidence}")
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    candidates = n_pos + n_neg + 1
    alpha_each = (1.0 - confidence) / (2 * candidates * max(1, family_size))
    thresholds, fp, fn = error_counts(labels, scores)
    fpr_hi = clopper_pearson_upper(fp, n_neg, alpha_each)
    fnr_hi = clopper_pearson_upper(fn, n_pos, alpha_each)
    with np.errstate(divide="ignore", invalid="ignore"):
        num1, num2 = 1.0 - delta - fpr_hi, 1.0 - delta - fnr_hi
        eps1 = np.where(num1 > 0, np.log(np.maximum(num1, 1e-300) / fnr_hi), -np.inf)
        eps2 = np.where(num2 > 0, np.log(np.maximum(num2, 1e-300) / fpr_hi), -np.inf)
    eps = np.maximum(eps1, eps2)
    best = int(np.argmax(eps))
    return {
        "eps_lb": max(0.0, float(eps[best])),
        "threshold": float(thresholds[best]),
        "fpr_hi": float(fpr_hi[best]),
        "fnr_hi": float(fnr_hi[best]),
        "alpha_per_bound": alpha_each,
    }


def tpr_at_fpr(fpr: np.ndarray, tpr: np.ndarray, target: float) -> float:
    """Best TPR among ROC points with ``FPR <= target`` (no interpolation; conservative)."""
    fpr, tpr = np.asarray(fpr), np.asarray(tpr)
    ok = fpr <= target + 1e-12
    return float(tpr[ok].max()) if ok.any() else 0.0


def best_balanced_accuracy(fpr: np.ndarray, tpr: np.ndarray) -> float:
    """``max_t (TPR + 1 - FPR) / 2`` over the ROC points (best threshold on this set)."""
    return float(np.max((np.asarray(tpr) + 1.0 - np.asarray(fpr)) / 2.0))


def attack_metrics(
    labels: np.ndarray,
    scores: np.ndarray,
    delta: float = 0.0,
    confidence: float = 0.95,
    family_size: int = 1,
) -> AttackResult:
    """All the metrics of one attack on one (audit) set, with compact ROC points."""
    labels, scores = _check(labels, scores)
    fpr, tpr, _ = roc_curve(labels, scores, drop_intermediate=False)
    roc_fpr, roc_tpr, _ = roc_curve(labels, scores, drop_intermediate=True)
    bound = epsilon_lower_bound(labels, scores, delta, confidence, family_size)
    detail = {k: v for k, v in bound.items() if k != "eps_lb"}
    if not math.isfinite(detail["threshold"]):
        detail["threshold"] = None
    return AttackResult(
        auc=float(roc_auc_score(labels, scores)),
        tpr_at_fpr={x: tpr_at_fpr(fpr, tpr, x) for x in LOW_FPRS},
        balanced_accuracy=best_balanced_accuracy(fpr, tpr),
        eps_lb=bound["eps_lb"],
        eps_lb_detail=detail,
        n_members=int(labels.sum()),
        n_nonmembers=int((~labels).sum()),
        roc={"fpr": roc_fpr.tolist(), "tpr": roc_tpr.tolist()},
    )
