"""The audit's results as typed records: the claim it tests, one attack's result, the report.

Each has ``to_json()``, the plain dict that ``audit --json`` prints and ``report.json`` holds
(docs/audit.md describes every field). Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["AttackResult", "AuditReport", "PrivacyClaim"]


@dataclass(frozen=True)
class PrivacyClaim:
    """The promise an audit tests (docs/audit.md#what-is-tested).

    ``epsilon`` / ``delta`` are what the ledger composes to (recomputed, for a run of this
    package) or what the owner of a model trained elsewhere claims; ``epsilon_tested`` /
    ``delta_tested`` the record-level promise they imply (None: nothing to test) and
    ``basis`` says why. ``stored_epsilon`` / ``stored_matches``: the checkpoint's stored
    number, only reported.
    """

    notion: str
    epsilon: float | None
    delta: float | None
    basis: str
    epsilon_tested: float | None = None
    delta_tested: float | None = None
    accountant: str | None = None
    threat_model: str | None = None
    noise: str | None = None
    rounds: int | None = None
    stored_epsilon: float | None = None
    stored_matches: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class AttackResult:
    """One attack measured on the audit half (docs/audit.md#metrics).

    ``tpr_at_fpr`` maps each low FPR to the best TPR at or below it; ``medians`` holds the
    members' and non-members' median of the attacked feature (``median_of="feature"``) or
    of the score itself (``"score"``, attacks that need no fitting: RMIA, LiRA).
    """

    auc: float
    tpr_at_fpr: dict[float, float]
    balanced_accuracy: float
    eps_lb: float
    eps_lb_detail: dict[str, Any]
    n_members: int
    n_nonmembers: int
    roc: dict[str, list[float]]
    medians: dict[str, float] | None = None
    median_of: str = "feature"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "auc": self.auc,
            **{f"tpr_at_fpr_{x:g}": v for x, v in self.tpr_at_fpr.items()},
            "balanced_accuracy": self.balanced_accuracy,
            "eps_lb": self.eps_lb,
            "eps_lb_detail": self.eps_lb_detail,
            "n_members": self.n_members,
            "n_nonmembers": self.n_nonmembers,
            "roc": self.roc,
        }
        if self.medians is not None:
            out[f"{self.median_of}_median"] = self.medians
        return out


@dataclass(frozen=True)
class AuditReport:
    """Everything one audit found (docs/audit.md); ``to_json()`` is ``report.json``."""

    source: str
    method: str | None
    round: int | None
    dataset: dict[str, Any]
    sets: dict[str, Any]
    privacy: PrivacyClaim
    confidence: float
    semantics: dict[str, str]
    attacks: dict[str, dict[str, AttackResult]]
    max_eps_lb: float
    max_eps_lb_attack: str
    violation: bool
    one_run: dict[str, Any] | None
    reference_models: dict[str, Any] | None
    feature_seconds: float
    release: dict[str, Any] | None = None  # ledger summary and public metadata

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.source,
            "method": self.method,
            "round": self.round,
            "dataset": self.dataset,
            "sets": self.sets,
            "privacy": self.privacy.to_json(),
            "confidence": self.confidence,
            "semantics": self.semantics,
            "attacks": {f: {k: r.to_json() for k, r in by.items()}
                        for f, by in self.attacks.items()},
            "max_eps_lb": self.max_eps_lb,
            "max_eps_lb_attack": self.max_eps_lb_attack,
            "violation": self.violation,
            "one_run": self.one_run,
            "reference_models": self.reference_models,
            "feature_seconds": self.feature_seconds,
            "release": self.release,
        }
