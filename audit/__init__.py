"""Membership-inference audit (SPEC 4; paper section 6.6): features -> attacks -> metrics -> report.

``membership`` (balanced member / non-member sets), ``features`` (per-record loss and
gradient norm), ``attacks`` (MLP and threshold attacks), ``metrics`` (ROC, AUC, TPR at low
FPR, epsilon lower bound) and ``report`` (:func:`run_audit`, JSON and ROC plot). Importing
this package does not import torch; :func:`run_audit` and ``compute_features`` load it.
"""

from __future__ import annotations

from typing import Any

from fedlap_privacy.audit.attacks import MLPAttack, ThresholdAttack
from fedlap_privacy.audit.membership import MembershipSplit, make_membership_split, member_indices
from fedlap_privacy.audit.metrics import (
    attack_metrics,
    clopper_pearson_upper,
    epsilon_lower_bound,
    tpr_at_fpr,
)

__all__ = [
    "MLPAttack",
    "MembershipSplit",
    "ThresholdAttack",
    "attack_metrics",
    "clopper_pearson_upper",
    "compute_features",
    "epsilon_lower_bound",
    "make_membership_split",
    "member_indices",
    "run_audit",
    "tpr_at_fpr",
]


def __getattr__(name: str) -> Any:  # lazy: these two need torch
    if name == "run_audit":
        from fedlap_privacy.audit.report import run_audit

        return run_audit
    if name == "compute_features":
        from fedlap_privacy.audit.features import compute_features

        return compute_features
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
