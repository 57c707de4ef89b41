"""Record canaries: a black-box one-run audit of any training that takes a training set.

Steinke, Nasr, Jagielski (NeurIPS 2023), the black-box game: ``m`` canary records are made,
each is put into the training set with a secret fair coin, the model is trained once, and
each canary is scored from the finished model alone (minus its loss, or its logit margin:
higher = more likely trained on). The scores and coins go to the score audit
(:func:`~fedlap_privacy.audit.canaries.score_audit.audit_canary_scores`). Canaries that no other
record explains are the ones a model must memorise to fit, so they are what a private model
may not reveal:

* ``"mislabelled"``: ``m`` of the user's own records, drawn at random, relabelled to a random
  other class; their originals leave the training set (else the original would explain its
  canary away), so the mixed set holds ``n - m`` of the user's records and the included
  canaries;
* ``"out-of-distribution"``: ``m`` synthetic inputs, each coordinate uniform over the range the
  user's features take, with random labels; every user record stays.

The coins and the canaries are drawn from a generator seeded by the operating system
(:mod:`secrets`), never from a configuration's seed: anyone who could recompute them could
read the answers of the audit. What the audit shows: a violation means the training leaked
more about a canary record than the claimed epsilon allows (for instance DP-SGD whose noise,
clipping or sampling differs from what was accounted). What it cannot show: that the claim
holds; and a black-box score of the final model sees less than the training saw, so its
bounds are usually far below a correct claim (an audit with white-box gradient canaries,
or of the claimed mechanism's curve, sees more). Torch is needed only by :meth:`score`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from fedlap_privacy.audit.bounds.canary_verdicts import audit_once
from fedlap_privacy.audit.canaries.score_audit import (
    ClaimedMechanism,
    ScoreAuditResult,
    audit_canary_scores,
    check_scores,
)
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.secret_random import os_generator

if TYPE_CHECKING:
    from torch import nn

__all__ = ["CANARY_KINDS", "RecordCanaries"]

CanaryRecordKind = Literal["mislabelled", "out-of-distribution"]
CANARY_KINDS: tuple[str, ...] = ("mislabelled", "out-of-distribution")
STATISTICS: tuple[str, ...] = ("loss", "logit-margin")


class RecordCanaries:
    """``m`` canary records with secret inclusion coins (module docstring).

    ``mix(features, labels)`` returns the training set with the included canaries appended
    (train on it, any framework); then ``score(model)`` (a torch model) or
    ``score_losses(losses)`` (each canary's loss, any framework, in the order of
    ``features`` / ``labels``) and ``audit(claimed_epsilon, delta)``.
    """

    def __init__(self, m: int, kind: CanaryRecordKind = "mislabelled", *,
                 num_classes: int | None = None) -> None:
        if isinstance(m, bool) or not isinstance(m, int | np.integer) or m < 10:
            raise ConfigError(f"record canaries need an integer m >= 10, got {m!r}")
        if kind not in CANARY_KINDS:
            raise ConfigError(f"kind must be one of {', '.join(CANARY_KINDS)}, got {kind!r}")
        if num_classes is not None and (not isinstance(num_classes, int) or num_classes < 2):
            raise ConfigError(f"num_classes must be an integer >= 2, got {num_classes!r}")
        self.m = int(m)
        self.kind = kind
        self.num_classes = num_classes
        self._rng = os_generator()  # secret: never a seed
        #: the secret inclusion bits (drawn now, before any training)
        self.included = self._rng.random(self.m) < 0.5
        #: the canary records (all m, in and out), set by :meth:`mix`
        self.features: np.ndarray | None = None
        self.labels: np.ndarray | None = None
        self.scores: np.ndarray | None = None

    def mix(self, features: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
        """The training set with the canaries mixed in: ``(features, labels)`` as numpy arrays
        (the user's rows first, in their order, then the included canaries). For
        ``"mislabelled"``, the ``m`` records turned into canaries are left out of the user's
        rows. Once per instance (a second mix would reuse the coins)."""
        if self.features is not None:
            raise ConfigError("these canaries are already mixed into a training set: make a "
                              "new RecordCanaries for another training")
        x, y = np.asarray(features), np.asarray(labels)
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer) or len(y) != len(x):
            raise ConfigError(f"labels must be 1-D integers, one per row of features, got "
                              f"shape {y.shape} ({y.dtype}) for {len(x)} rows")
        if x.ndim < 2 or not np.issubdtype(x.dtype, np.number) or not np.all(np.isfinite(x)):
            raise ConfigError(f"features must be a finite numeric array (rows, ...), got shape "
                              f"{x.shape} ({x.dtype})")
        if len(y) and y.min() < 0:
            raise ConfigError("labels must be >= 0")
        k = self.num_classes if self.num_classes is not None else int(y.max()) + 1
        if k < 2 or y.max() >= k:
            raise ConfigError(f"labels must lie in 0..{k - 1} (num_classes {k}) with at least "
                              "2 classes")
        self.num_classes = k
        keep = np.ones(len(x), dtype=bool)
        if self.kind == "mislabelled":
            if len(x) < 2 * self.m:
                raise ConfigError(f"{self.m} mislabelled canaries need at least {2 * self.m} "
                                  f"records (they are taken from yours), got {len(x)}")
            chosen = self._rng.choice(len(x), size=self.m, replace=False)
            keep[chosen] = False
            self.features = x[chosen].copy()
            shift = self._rng.integers(1, k, size=self.m)  # any other class
            self.labels = ((y[chosen] + shift) % k).astype(y.dtype)
        else:
            lo, hi = x.min(axis=0), x.max(axis=0)
            noise = self._rng.random((self.m, *x.shape[1:]))
            self.features = (lo + noise * (hi - lo)).astype(x.dtype)
            self.labels = self._rng.integers(0, k, size=self.m).astype(y.dtype)
        mixed_x = np.concatenate([x[keep], self.features[self.included]])
        mixed_y = np.concatenate([y[keep], self.labels[self.included]])
        return mixed_x, mixed_y

    def _records(self) -> tuple[np.ndarray, np.ndarray]:
        if self.features is None or self.labels is None:
            raise ConfigError("mix the canaries into the training set first (mix)")
        return self.features, self.labels

    def score(self, model: nn.Module, statistic: str = "loss", batch_size: int = 1024,
              device: str | None = None) -> np.ndarray:
        """Score every canary under a trained torch classifier (logits out): minus its
        cross-entropy (``"loss"``) or its logit margin (``"logit-margin"``, its label's logit
        minus the largest other); higher = more likely trained on. Stored for :meth:`audit`."""
        import torch

        if statistic not in STATISTICS:
            raise ConfigError(f"statistic must be one of {', '.join(STATISTICS)}, got "
                              f"{statistic!r}")
        x, y = self._records()
        if device is None:
            device = str(next(iter(model.parameters()), torch.empty(0)).device)
        model.eval()
        out = []
        with torch.no_grad():
            for start in range(0, len(x), batch_size):
                xb = torch.as_tensor(x[start:start + batch_size], dtype=torch.float32,
                                     device=device)
                yb = torch.as_tensor(y[start:start + batch_size], dtype=torch.long,
                                     device=device)
                logits = model(xb).double()
                if statistic == "loss":
                    value = -torch.nn.functional.cross_entropy(logits, yb, reduction="none")
                else:
                    own = logits.gather(1, yb[:, None])[:, 0]
                    other = logits.scatter(1, yb[:, None], -torch.inf).max(1).values
                    value = own - other
                out.append(value.cpu().numpy())
        self.scores = check_scores(np.concatenate(out), "canary scores")
        return self.scores

    def score_losses(self, per_record_losses: Any) -> np.ndarray:
        """Scores from each canary's loss under the trained model, computed in any framework
        (in the order of :attr:`features` / :attr:`labels`): minus the loss."""
        self._records()
        losses = check_scores(per_record_losses, "per-record losses")
        if len(losses) != self.m:
            raise ConfigError(f"expected one loss per canary ({self.m}), got {len(losses)}")
        self.scores = -losses
        return self.scores

    def audit(self, claimed_epsilon: float, delta: float, *, out: str | Path | None = None,
              mechanism: ClaimedMechanism | None = None,
              confidence: float = 0.95) -> ScoreAuditResult:
        """The one-run audit of the scores against ``(claimed_epsilon, delta)``
        (:func:`~fedlap_privacy.audit.canaries.score_audit.audit_canary_scores`); one claim per set
        of canaries (:func:`~fedlap_privacy.audit.bounds.canary_verdicts.audit_once`)."""
        if self.scores is None:
            raise ConfigError("score the canaries first (score or score_losses)")
        scores = self.scores
        return audit_once(self, claimed_epsilon, delta, lambda: audit_canary_scores(
            {f"records/{self.kind}": scores}, self.included,
            claimed_epsilon=claimed_epsilon, delta=delta, mechanism=mechanism,
            confidence=confidence, out=out, title=f"{self.m} {self.kind} record canaries"))
