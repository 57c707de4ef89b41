"""Reference-model membership scores of a checkpoint: offline RMIA and LiRA.

The audit is given reference models already trained (by
``fedlap_privacy.fl.auditing.reference_models``; the audit never trains) with the ids of the records
each trained on, and turns them into two membership scores, "higher = more likely a member", for any
records:

* ``rmia`` -- offline RMIA (S. Zarifzadeh, P. Liu, R. Shokri, "Low-cost high-power
  membership inference attacks", ICML 2024): ``score(x) = |{z : LR(x, z) > gamma}| / |Z|``
  with ``LR(x, z) = [P(x|theta)/P(x)] / [P(z|theta)/P(z)]`` and the offline
  ``P(x) = ((1+a)/2) P_OUT(x) + (1-a)/2`` (``P_OUT``: mean over the reference models).
  ``gamma = 1`` (the low end of the paper's 1-2; with a single threshold on the fraction,
  ``gamma`` only moves where records tie). ``a`` is tuned with
  :func:`~fedlap_privacy.audit.inference.reference_attacks.tune_rmia_a` when there are at least 2
  reference models (reference 0 plays the target on the records no audit set uses, at most
  5,000 of them, its own training records as members, the others as OUT references); with
  one, the default 0.3.
  Ties in the fraction are broken by the ratio itself (``break_ties``), which ranks as the
  fraction does wherever the fraction differs.
* ``lira`` -- offline LiRA (N. Carlini, S. Chien, M. Nasr, S. Song, A. Terzis, F. Tramer,
  "Membership inference attacks from first principles", IEEE S&P 2022): the one-sided
  tail of a Gaussian fitted to the reference models' logit-scaled confidences, with one
  global variance (the paper's choice with few reference models). With ONE reference
  model no variance can be fitted; the score is then ``phi_target - phi_ref``, which ranks
  records exactly as the global-variance score does for any variance (so every metric of
  the audit is the same as with a fitted one).

Records are named by one id over the dataset's train and test sets (train record ``i`` is
``i``, test record ``j`` is ``n_train + j``), as reference models may train on both. The
population ``Z`` of RMIA are records that neither the target nor any reference model
trained on: in the member/non-member audit, the attack half's non-members. The records
under audit and ``Z`` must be OUT for every reference model (offline setting);
:class:`ReferenceScorer` refuses a reference model that trained on one of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedlap_privacy.audit.inference.reference_attacks import (
    lira_offline_scores,
    lira_signal,
    rmia_offline_scores,
    tune_rmia_a,
)
from fedlap_privacy.errors import ConfigError, FedlapError

__all__ = [
    "DEFAULT_RMIA_A",
    "REFERENCE_SCORES",
    "RMIA_GAMMA",
    "ReferenceModel",
    "ReferenceScorer",
    "model_logits",
]

#: the scores this module adds to an audit
REFERENCE_SCORES = ("rmia", "lira")
#: RMIA's offline ``a`` with a single reference model (nothing to tune it on)
DEFAULT_RMIA_A = 0.3
#: RMIA's ``gamma`` (Zarifzadeh et al. use 1 to 2)
RMIA_GAMMA = 1.0
#: at most this many population records are scored to tune ``a`` (cost bound)
_TUNING_RECORDS = 5000


@dataclass(frozen=True)
class ReferenceModel:
    """A reference model handed to the audit: the module, the ids of the records (module
    docstring) it trained on, and a name for the report (e.g. its folder)."""

    model: nn.Module
    trained_on: np.ndarray
    name: str


def model_logits(
    model: nn.Module, x: np.ndarray | torch.Tensor, batch_size: int = 1024,
    device: torch.device | None = None,
) -> np.ndarray:
    """The model's logits on ``x``, float64 ``(n, classes)``, in eval mode, without
    gradients (on ``device``, default the model's); non-finite logits raise."""
    dev = device or next(model.parameters()).device
    model.to(dev)
    was_training = model.training
    model.eval()
    xt = torch.as_tensor(x, dtype=torch.float32)
    out = []
    try:
        with torch.no_grad():
            for i in range(0, len(xt), batch_size):
                out.append(model(xt[i : i + batch_size].to(dev)).double().cpu())
    finally:
        model.train(was_training)
    if not out:
        raise ConfigError("no records to compute logits on")
    logits = torch.cat(out).numpy()
    if not np.all(np.isfinite(logits)):
        raise FedlapError("a model gives non-finite logits (diverged weights?)")
    return logits


class ReferenceScorer:
    """RMIA and LiRA scores of a target against its reference models (module docstring).

    Built once per audit: the target and reference models, the population ``Z`` (records
    no model trained on: ``population_x`` / ``population_y``), the ids of the records
    under audit and of ``Z`` (``audited``: no reference model may have trained on them)
    and, to tune RMIA's ``a`` with two or more reference models, ``tuning_x`` /
    ``tuning_y`` / ``tuning_index``: records outside ``audited`` with their ids
    (membership in reference 0 is read from its ``trained_on``). :meth:`score` then scores
    any records.
    """

    def __init__(
        self,
        target: nn.Module,
        references: Sequence[ReferenceModel],
        population_x: np.ndarray,
        population_y: np.ndarray,
        audited: np.ndarray,
        tuning_x: np.ndarray | None = None,
        tuning_y: np.ndarray | None = None,
        tuning_index: np.ndarray | None = None,
        device: torch.device | None = None,
        seed: int = 0,
    ) -> None:
        if not references:
            raise ConfigError("the reference-model attacks need at least one reference model")
        audited = np.asarray(audited, dtype=np.int64)
        for ref in references:
            overlap = np.intersect1d(np.asarray(ref.trained_on, np.int64), audited).size
            if overlap:
                raise ConfigError(f"reference model {ref.name} trained on {overlap} of the "
                                  "records under audit: it is not an OUT (offline) reference")
        self.target, self.references, self.device = target, list(references), device
        self.population_y = np.asarray(population_y, dtype=np.int64)
        self.population_target = model_logits(target, population_x, device=device)
        self.population_refs = self._ref_logits(population_x)
        self.tuning: dict[str, Any] | None = None
        self.a = DEFAULT_RMIA_A
        if len(self.references) >= 2:
            if tuning_x is None or tuning_y is None or tuning_index is None:
                raise ConfigError("tuning RMIA's a needs population records with indices")
            self._tune(tuning_x, np.asarray(tuning_y, np.int64),
                       np.asarray(tuning_index, np.int64), seed)

    def _ref_logits(self, x: np.ndarray) -> np.ndarray:
        return np.stack([model_logits(r.model, x, device=self.device) for r in self.references])

    def _tune(self, x: np.ndarray, y: np.ndarray, index: np.ndarray, seed: int) -> None:
        if len(y) > _TUNING_RECORDS:
            keep = np.sort(np.random.default_rng(seed).choice(len(y), _TUNING_RECORDS, False))
            x, y, index = x[keep], y[keep], index[keep]
        members = np.isin(index, self.references[0].trained_on)
        if members.sum() < 1 or (~members).sum() < 4:
            return  # nothing to tune on: keep the default
        tuned = tune_rmia_a(self._ref_logits(x), y, members, gamma=RMIA_GAMMA, seed=seed)
        self.a = tuned.a
        self.tuning = {"records": len(y), "members": int(members.sum()),
                       "auc": tuned.auc, "grid": list(tuned.grid), "aucs": list(tuned.aucs)}

    def score(self, x: np.ndarray | torch.Tensor, y: np.ndarray | torch.Tensor) -> dict[
            str, np.ndarray]:
        """``{"rmia": ..., "lira": ...}`` for the records ``(x, y)`` (higher = member)."""
        labels = np.asarray(y, dtype=np.int64)
        target = model_logits(self.target, x, device=self.device)
        refs = self._ref_logits(np.asarray(x))
        rmia = rmia_offline_scores(
            target, labels, refs, self.population_target, self.population_y,
            self.population_refs, a=self.a, gamma=RMIA_GAMMA, break_ties=True,
        )
        if len(self.references) >= 2:
            lira = lira_offline_scores(target, labels, refs, global_variance=True)
        else:
            lira = lira_signal(target, labels) - lira_signal(refs[0], labels)
        return {"rmia": rmia, "lira": lira}

    def describe(self) -> dict[str, Any]:
        """What the report says about the reference models and the two scores."""
        k = len(self.references)
        return {
            "count": k,
            "models": [r.name for r in self.references],
            "trained_on": [len(r.trained_on) for r in self.references],
            "setting": "offline: every audited record is OUT for every reference model",
            "population_records": len(self.population_y),
            "rmia": {"a": self.a, "a_tuned": self.tuning is not None, "gamma": RMIA_GAMMA,
                     "tuning": self.tuning},
            "lira": {"variance": "global" if k >= 2 else
                     "none (one reference model: phi_target - phi_reference, the same ranking)"},
        }
