"""Membership-inference attacks on per-record features (docs/audit.md#features-and-attacks).

Both attacks follow scikit-learn's shape: ``fit(X, is_member)`` on the attack half only,
then ``predict_proba(X)`` (columns: non-member, member) and ``score(X)`` (higher = more
likely a member) on the audit half. ``X`` is one feature per record, shape ``(N,)`` or
``(N, d)``; features are positive (losses, gradient norms), so they enter as ``log``.

* :class:`MLPAttack` -- the paper's "neural network": ``log`` -> ``StandardScaler`` ->
  ``MLPClassifier`` in a :class:`~sklearn.pipeline.Pipeline`, seeded.
* :class:`ThresholdAttack` -- the training-free baseline (Yeom et al. 2018): score =
  ``-feature`` (a lower loss / smaller gradient means member). ``fit`` only picks the
  threshold for ``predict_proba``; the score, hence the ROC, never depends on training data.
"""

from __future__ import annotations

import warnings

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler

from fedlap_privacy.errors import ConfigError

__all__ = ["ATTACK_MODELS", "MLPAttack", "ThresholdAttack", "make_attack"]

_TINY = 1e-30  # losses of a memorised record can underflow to exactly 0


def _log_features(x: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(x, _TINY))


def _as_2d(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    if x.ndim != 2 or not np.all(np.isfinite(x)):
        raise ConfigError("attack features must be a finite (N,) or (N, d) array")
    return x


def _as_labels(y: np.ndarray, n: int) -> np.ndarray:
    y = np.asarray(y).astype(bool)
    if y.shape != (n,) or y.all() or not y.any():
        raise ConfigError("attack training needs one label per record, both classes present")
    return y


class MLPAttack:
    """The paper's neural-network attack: log-feature, standardised, into a small MLP."""

    def __init__(
        self, hidden: tuple[int, ...] = (32, 32), seed: int = 0, max_iter: int = 1000
    ) -> None:
        self.hidden, self.seed, self.max_iter = hidden, seed, max_iter
        self.pipeline_: Pipeline | None = None

    def fit(self, x: np.ndarray, is_member: np.ndarray) -> MLPAttack:
        x = _as_2d(x)
        y = _as_labels(is_member, len(x))
        self.pipeline_ = Pipeline(
            [
                ("log", FunctionTransformer(_log_features)),
                ("scale", StandardScaler()),
                (
                    "mlp",
                    MLPClassifier(
                        hidden_layer_sizes=self.hidden,
                        alpha=1e-3,
                        max_iter=self.max_iter,
                        random_state=self.seed,
                    ),
                ),
            ]
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            self.pipeline_.fit(x, y.astype(np.int64))
        return self

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        if self.pipeline_ is None:
            raise ConfigError("MLPAttack.predict_proba called before fit")
        return self.pipeline_.predict_proba(_as_2d(x))

    def score(self, x: np.ndarray) -> np.ndarray:
        """Probability of membership, shape ``(N,)``."""
        return self.predict_proba(x)[:, 1]


class ThresholdAttack:
    """Training-free baseline: a lower feature value (loss, gradient norm) means member."""

    def __init__(self) -> None:
        self.threshold_: float | None = None

    def fit(self, x: np.ndarray, is_member: np.ndarray) -> ThresholdAttack:
        """Pick the score threshold of best accuracy on the (attack-half) training data."""
        s = self.score(x)
        y = _as_labels(is_member, len(s))
        cuts = np.unique(s)
        pos, neg = np.sort(s[y]), np.sort(s[~y])
        tp = len(pos) - np.searchsorted(pos, cuts, side="left")  # members with s >= cut
        tn = np.searchsorted(neg, cuts, side="left")  # non-members with s < cut
        self.threshold_ = float(cuts[int(np.argmax(tp + tn))])
        return self

    def score(self, x: np.ndarray) -> np.ndarray:
        x = _as_2d(x)
        if x.shape[1] != 1:
            raise ConfigError("the threshold attack takes exactly one feature")
        return -x[:, 0]

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        """Hard 0/1 membership decisions at the fitted threshold, as probabilities."""
        if self.threshold_ is None:
            raise ConfigError("ThresholdAttack.predict_proba called before fit")
        member = (self.score(x) >= self.threshold_).astype(np.float64)
        return np.stack([1.0 - member, member], axis=1)


ATTACK_MODELS = {"mlp": MLPAttack, "threshold": ThresholdAttack}


def make_attack(kind: str, seed: int = 0) -> MLPAttack | ThresholdAttack:
    """An unfitted attack model by name (``"mlp"`` or ``"threshold"``)."""
    if kind == "mlp":
        return MLPAttack(seed=seed)
    if kind == "threshold":
        return ThresholdAttack()
    raise ConfigError(f"unknown attack model {kind!r}; choose from {', '.join(ATTACK_MODELS)}")
