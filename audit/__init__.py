"""Membership-inference audit (docs/audit.md): features -> attacks -> metrics -> report.

``membership`` (balanced member / non-member sets), ``features`` (per-record loss and
gradient norm), ``attacks`` (MLP and threshold attacks), ``metrics`` (ROC, AUC, TPR at low
FPR, epsilon lower bound) and ``report`` (:func:`run_audit`, JSON and ROC plot). Importing
this package does not import torch; :func:`run_audit` and ``compute_features`` load it.

Canary audits (torch-free): ``score_audit`` (:func:`audit_canary_scores`, the one-run audit
of canary scores from any framework, :class:`ClaimedMechanism`), ``record_canaries``
(:class:`RecordCanaries`, black-box canary records for any training), ``one_run`` (one-run
epsilon lower bound, Steinke, Nasr, Jagielski 2023), ``canary_clients`` (canary-client
epsilon estimate, Andrew et al. 2024) and ``reference_attacks`` (offline LiRA, Carlini et al.
2022, and offline RMIA, Zarifzadeh, Liu, Shokri 2024). ``gradient_canaries``
(:class:`GradientCanaries`, white-box gradient canaries inside an Opacus or a plain torch
DP-SGD run) needs torch and loads on first use. ``CanaryClients``
(``flower_audit``, ``flower_canaries``) puts canary clients into any Flower strategy's
aggregation, and ``rehearse_flower`` (``flower_rehearsal``) drives a strategy in-process
with synthetic clients (both need the ``flower`` extra).
"""

from __future__ import annotations

from typing import Any

from fedlap_privacy.audit.bounds.metrics import (
    attack_metrics,
    clopper_pearson_upper,
    epsilon_lower_bound,
    tpr_at_fpr,
)
from fedlap_privacy.audit.bounds.one_run import (
    OneRunResult,
    one_run_audit,
    one_run_candidate_grid,
    one_run_ceiling,
    one_run_lower_bound,
    one_run_p_value,
)
from fedlap_privacy.audit.canaries.canary_clients import (
    CanaryClientEstimate,
    canary_client_epsilon,
    canary_cosines,
    cosine_null_threshold_epsilon,
    gaussian_epsilon,
    gaussian_pair_epsilon,
    max_cosines_over_rounds,
)
from fedlap_privacy.audit.canaries.record_canaries import RecordCanaries
from fedlap_privacy.audit.canaries.score_audit import (
    ClaimedMechanism,
    ScoreAuditResult,
    audit_canary_scores,
)
from fedlap_privacy.audit.inference.attacks import MLPAttack, ThresholdAttack
from fedlap_privacy.audit.inference.membership import (
    MembershipSplit,
    make_membership_split,
    member_indices,
)
from fedlap_privacy.audit.inference.reference_attacks import (
    RmiaTuning,
    lira_offline_scores,
    lira_signal,
    rmia_offline_scores,
    true_label_probability,
    tune_rmia_a,
)
from fedlap_privacy.audit.reports.results import AttackResult, AuditReport, PrivacyClaim

__all__ = [
    "AttackResult",
    "AuditReport",
    "CanaryClientEstimate",
    "CanaryClients",
    "ClaimedMechanism",
    "GradientCanaries",
    "MLPAttack",
    "MembershipSplit",
    "OneRunResult",
    "PrivacyClaim",
    "RecordCanaries",
    "RmiaTuning",
    "ScoreAuditResult",
    "ThresholdAttack",
    "attack_metrics",
    "audit_canary_scores",
    "audit_model",
    "canary_client_epsilon",
    "canary_cosines",
    "clopper_pearson_upper",
    "compute_features",
    "cosine_null_threshold_epsilon",
    "epsilon_lower_bound",
    "gaussian_epsilon",
    "gaussian_pair_epsilon",
    "lira_offline_scores",
    "lira_signal",
    "load_external_model",
    "make_membership_split",
    "max_cosines_over_rounds",
    "member_indices",
    "one_run_audit",
    "one_run_candidate_grid",
    "one_run_ceiling",
    "one_run_lower_bound",
    "one_run_p_value",
    "rehearse_flower",
    "rmia_offline_scores",
    "run_audit",
    "run_canary_audits",
    "tpr_at_fpr",
    "true_label_probability",
    "tune_rmia_a",
]


#: names that need torch, imported on first use: name -> module
_LAZY = {
    "run_audit": "fedlap_privacy.audit.inference.report",
    "compute_features": "fedlap_privacy.audit.inference.features",
    "audit_model": "fedlap_privacy.audit.inference.external",
    "load_external_model": "fedlap_privacy.audit.inference.external",
    "run_canary_audits": "fedlap_privacy.audit.canaries.canary_audit",
    "GradientCanaries": "fedlap_privacy.audit.canaries.gradient_canaries",
    "CanaryClients": "fedlap_privacy.audit.flower.flower_audit",
    "rehearse_flower": "fedlap_privacy.audit.flower.flower_rehearsal",
}


def __getattr__(name: str) -> Any:  # lazy: these need torch
    if name in _LAZY:
        import importlib

        attribute = "rehearse" if name == "rehearse_flower" else name
        return getattr(importlib.import_module(_LAZY[name]), attribute)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
