"""The membership-inference audit of a checkpoint, end to end (docs/audit.md; paper section 6.6).

:func:`run_audit` loads a checkpoint written by ``fedlap-privacy train`` (safely: weights
only), rebuilds the model, reloads the dataset and checks that it matches, draws the
balanced attack / audit sets of :mod:`.membership`, computes each record's loss and
gradient norm once (:mod:`.features`), trains every attack of :mod:`.attacks` on the attack
half and measures it on the audit half (:mod:`.metrics`). The result is set against the
privacy the accountant promised, recomputed from the run's ledger (:mod:`.claim`: the
record-level promise a record-level, client-level, local or non-private run implies).

``violation`` is True (loudly) when some attack's epsilon lower bound exceeds the tested
epsilon: either the implementation or its accounting is wrong.

With reference models (:mod:`.reference_audit`: offline RMIA, Zarifzadeh, Liu, Shokri,
ICML 2024; offline LiRA, Carlini et al. 2022), two more scores, ``rmia`` and ``lira``, join
the features. They are not fitted on the attack half: the score is the attack (kind
``score``), measured on the audit half like the others, in the same Bonferroni family; the
attack half's non-members serve as RMIA's population (:func:`audited_records` lists the
records reference models must not train on). The same scores are added to the
black-box canary audit (``black-box/rmia``, ``black-box/lira``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlap_privacy.audit.bounds.canary_verdicts import strongest_audit
from fedlap_privacy.audit.bounds.claim import config_delta, privacy_claim
from fedlap_privacy.audit.bounds.claim_curve import ClaimCurve, ledger_steps
from fedlap_privacy.audit.bounds.metrics import attack_metrics
from fedlap_privacy.audit.canaries.canary_audit import run_canary_audits
from fedlap_privacy.audit.canaries.score_audit import score_summary
from fedlap_privacy.audit.inference.attacks import ATTACK_MODELS, make_attack
from fedlap_privacy.audit.inference.features import FEATURES, compute_features
from fedlap_privacy.audit.inference.membership import make_membership_split, member_indices
from fedlap_privacy.audit.inference.reference_audit import ReferenceModel, ReferenceScorer
from fedlap_privacy.audit.reports.privacy_report import ledger_summary
from fedlap_privacy.audit.reports.report_files import write_report
from fedlap_privacy.audit.reports.results import AttackResult, AuditReport, PrivacyClaim
from fedlap_privacy.data.datasets import CUSTOM, DATASETS, Dataset
from fedlap_privacy.data.user_data import load_run_data
from fedlap_privacy.errors import CheckpointError, ConfigError, DataError
from fedlap_privacy.model_factory import FactorySpec
from fedlap_privacy.state.canary_state import CanaryState
from fedlap_privacy.state.checkpoint import CHECKPOINT, PRIVATE, committed_file
from fedlap_privacy.state.ledger import PrivacyLedger
from fedlap_privacy.state.run_state import ModelRelease, PrivateRunState
from fedlap_privacy.vocabulary import CanaryKind, Notion

__all__ = [
    "AuditTarget",
    "RunRecords",
    "audit_target",
    "audited_records",
    "evaluate_attacks",
    "load_run_records",
    "parse_attacks",
    "rebuilt_model",
    "run_audit",
]

CONFIDENCE = 0.95


def parse_attacks(attacks: str | Sequence[str]) -> tuple[str, ...]:
    """``"loss,grad-norm"`` (or a sequence) -> validated, de-duplicated feature names."""
    names = attacks.split(",") if isinstance(attacks, str) else list(attacks)
    out: list[str] = []
    for name in (n.strip() for n in names):
        if not name:
            continue
        if name not in FEATURES:
            raise ConfigError(f"unknown attack {name!r}; choose from {', '.join(FEATURES)}")
        if name not in out:
            out.append(name)
    if not out:
        raise ConfigError(f"no attack given; choose from {', '.join(FEATURES)}")
    return tuple(out)


def evaluate_attacks(
    features: dict[str, np.ndarray],
    is_member: np.ndarray,
    is_audit: np.ndarray,
    seed: int = 0,
    delta: float = 0.0,
    confidence: float = CONFIDENCE,
    direct_scores: dict[str, np.ndarray] | None = None,
) -> dict[str, dict[str, AttackResult]]:
    """Fit every attack model on each feature's attack half, measure it on the audit half.

    Returns ``{feature: {"mlp": metrics, "threshold": metrics}}``, and ``{name: {"score":
    metrics}}`` for each of ``direct_scores``: membership scores that need no fitting (higher =
    member, e.g. RMIA / LiRA), measured on the audit half only. The epsilon lower bounds
    share one Bonferroni family over all these attacks (see :mod:`.metrics`).
    """
    is_member, is_audit = np.asarray(is_member, bool), np.asarray(is_audit, bool)
    direct = direct_scores or {}
    family = len(features) * len(ATTACK_MODELS) + len(direct)
    results: dict[str, dict[str, AttackResult]] = {}
    for name, values in features.items():
        values = np.asarray(values, dtype=np.float64)
        results[name] = {}
        for kind in ATTACK_MODELS:
            attack = make_attack(kind, seed=seed)
            attack.fit(values[~is_audit], is_member[~is_audit])  # never sees the audit half
            scores = attack.score(values[is_audit])
            metrics = attack_metrics(is_member[is_audit], scores, delta, confidence, family)
            results[name][kind] = dataclasses.replace(
                metrics, medians=_medians(values, is_member, is_audit))
    for name, values in direct.items():
        values = np.asarray(values, dtype=np.float64)
        metrics = attack_metrics(is_member[is_audit], values[is_audit], delta, confidence,
                                 family)
        results[name] = {"score": dataclasses.replace(
            metrics, medians=_medians(values, is_member, is_audit), median_of="score")}
    return results


def _medians(values: np.ndarray, is_member: np.ndarray, is_audit: np.ndarray) -> dict[str, float]:
    """The audit half's members' and non-members' median of ``values``."""
    return {"members": float(np.median(values[is_audit & is_member])),
            "nonmembers": float(np.median(values[is_audit & ~is_member]))}


def _load_private_state(checkpoint: Path) -> PrivateRunState:
    """The run's private state beside ``checkpoint``: the audit needs its member indices."""
    path = (committed_file(checkpoint.parent, PRIVATE) if checkpoint.name == CHECKPOINT
            else checkpoint.parent / PRIVATE)
    if not path.is_file():
        raise CheckpointError(
            f"no {PRIVATE} beside {checkpoint}: the audit needs the run's private state (the "
            "member indices), which a shared model checkpoint does not carry"
        )
    return PrivateRunState.load(path)


@dataclass(frozen=True)
class AuditTarget:
    """What an audit reads: the model, the dataset, the member indices, the data folder
    used and, for a run of this package, its release checkpoint and private state."""

    model: torch.nn.Module
    dataset: Dataset
    members: np.ndarray
    data_dir: str | None = None
    release: ModelRelease | None = None
    private: PrivateRunState | None = None


@dataclass(frozen=True)
class RunRecords:
    """What an audit of a run reads besides its model: the release, the private state, the
    dataset, the member indices and the data folder used."""

    release: ModelRelease
    private: PrivateRunState
    dataset: Dataset
    members: np.ndarray
    data_dir: str | None


def load_run_records(checkpoint_path: str | Path, data_dir: str | Path | None,
                     factory: str | None = None) -> RunRecords:
    """Checkpoint, private state, dataset, member indices -- all checked, no model built
    and nothing the checkpoint names imported; first of all, a factory-built model that the
    user names no factory for (``factory``) is refused in one line showing the recorded
    spec (:meth:`~fedlap_privacy.state.run_state.ModelRelease.factory_to_build`). A run on a
    user's records (dataset ``custom``) reads them again from the path its private state
    records (``data_dir`` replaces it)."""
    path = Path(checkpoint_path)
    release = ModelRelease.load(  # a run folder's ckpt.pt: the committed one (the pair)
        committed_file(path.parent, CHECKPOINT) if path.name == CHECKPOINT else path)
    release.factory_to_build(factory, str(path))
    name = release.dataset
    if name not in DATASETS and name != CUSTOM:
        raise CheckpointError(
            f"checkpoint {path} names unknown dataset {name!r}; known: {', '.join(DATASETS)}"
        )
    private = _load_private_state(path)
    recorded_dir = private.config.get("data" if name == CUSTOM else "data_dir")
    from_checkpoint = data_dir is None and recorded_dir is not None
    used = data_dir if data_dir is not None else recorded_dir
    try:
        dataset = load_run_data(name, private.config, private.split_seed, data_dir)
    except DataError as exc:
        if not from_checkpoint:
            raise
        raise DataError(
            f"{exc} (data {used} recorded in the run's private state; pass --data-dir)"
        ) from None
    _check_shape(release, dataset)
    members = member_indices(private.client_indices, len(dataset.y_train))
    return RunRecords(release, private, dataset, members, None if used is None else str(used))


def rebuilt_model(release: ModelRelease, path: str | Path, factory: str | None) -> torch.nn.Module:
    """The model of ``release`` (read from ``path``): a factory-built one only by the factory
    the user names (``factory``) or a package factory it records
    (:meth:`~fedlap_privacy.state.run_state.ModelRelease.build_model`)."""
    try:
        return release.build_model(factory, where=str(path))
    except CheckpointError as exc:
        raise CheckpointError(str(exc).replace("checkpoint:", f"checkpoint {path}:")) from None


def _load_target(checkpoint_path: str | Path, data_dir: str | Path | None,
                 factory: str | None = None) -> AuditTarget:
    """:func:`load_run_records` and the rebuilt model (:func:`rebuilt_model`); the model is
    built only once every file of the run has been read and checked."""
    records = load_run_records(checkpoint_path, data_dir, factory)
    model = rebuilt_model(records.release, checkpoint_path, factory)
    return AuditTarget(model, records.dataset, records.members, records.data_dir,
                       records.release, records.private)


def _check_shape(release: ModelRelease, dataset: Dataset) -> None:
    """The records fit the checkpoint's model: input shape and classes."""
    if release.model_factory is not None:
        spec = FactorySpec.from_dict(release.model_factory)
        expected = (tuple(spec.input_shape), spec.num_classes)
    else:
        config = release.model_config
        size = config["image_size"]
        expected = ((config["in_channels"], size, size), config["num_classes"])
    found = (dataset.input_shape, dataset.num_classes)
    if expected != found:
        def shape(s: tuple[int, ...]) -> str:
            return "x".join(map(str, s))
        raise DataError(
            f"dataset {dataset.name!r} has records of {shape(found[0])} and {found[1]} classes, "
            f"but the checkpoint's model expects {shape(expected[0])} and {expected[1]}"
        )


def run_audit(
    checkpoint_path: str | Path,
    data_dir: str | Path | None = None,
    attacks: str | Sequence[str] = FEATURES,
    seed: int = 0,
    out_dir: str | Path | None = None,
    max_per_half: int | None = None,
    device: str | None = None,
    reference_models: Sequence[ReferenceModel] = (),
    factory: str | None = None,
) -> AuditReport:
    """Audit one checkpoint; returns the report (and writes it when ``out_dir`` is set).

    ``attacks`` names the features (``"loss"``, ``"grad-norm"``); each is attacked by the
    MLP and by the threshold baseline. ``max_per_half`` caps each of the four record sets
    (all records by default). ``device`` defaults to CUDA when available. With ``out_dir``,
    ``report.json`` and ``roc.png`` are written there. ``reference_models`` (trained
    without any record of :func:`audited_records` for the same ``seed`` and
    ``max_per_half``) add the ``rmia`` and ``lira`` scores (module docstring); the report's
    ``reference_models`` says which were used and how. ``factory``: the model factory
    the user names for a factory-built run (a recorded factory is never imported on its
    own: :mod:`fedlap_privacy.model_factory`, consent).
    """
    target = _load_target(checkpoint_path, data_dir, factory)
    assert target.release is not None and target.private is not None
    claim = privacy_claim(target.release.privacy, target.release.ledger,
                          target.private.ledger_digest)
    return audit_target(target, claim, str(checkpoint_path), attacks, seed, out_dir,
                        max_per_half, device, reference_models)


def audit_target(
    target: AuditTarget,
    claim: PrivacyClaim,
    source: str,
    attacks: str | Sequence[str] = FEATURES,
    seed: int = 0,
    out_dir: str | Path | None = None,
    max_per_half: int | None = None,
    device: str | None = None,
    reference_models: Sequence[ReferenceModel] = (),
) -> AuditReport:
    """The audit of :func:`run_audit` on a loaded target and its claim (``source`` names
    the model in the report); shared with
    :func:`fedlap_privacy.audit.inference.external.audit_model`."""
    features_wanted = parse_attacks(attacks)
    model, dataset, members = target.model, target.dataset, target.members
    used_dir = target.data_dir
    split = make_membership_split(
        members, dataset.y_train, dataset.y_test, seed=seed, max_per_half=max_per_half
    )
    x, y, is_member, is_audit = split.gather(
        dataset.x_train, dataset.y_train, dataset.x_test, dataset.y_test
    )
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(dev)
    start = time.perf_counter()
    features = compute_features(model, x, y, features_wanted)
    feature_seconds = time.perf_counter() - start
    scorer = None
    direct: dict[str, np.ndarray] = {}
    if reference_models:
        start = time.perf_counter()
        scorer = _reference_scorer(target, split, reference_models, dev, seed)
        direct = scorer.score(x, y)
        feature_seconds += time.perf_counter() - start

    delta = claim.delta_tested if claim.delta_tested is not None else 0.0
    results = evaluate_attacks(features, is_member, is_audit, seed=seed, delta=delta,
                               direct_scores=direct)
    best_name, best = max(
        ((f"{f}/{k}", r.eps_lb) for f, by in results.items() for k, r in by.items()),
        key=lambda item: item[1],
    )
    tested = claim.epsilon_tested
    one_run = _canary_report(target, claim, scorer)
    canary_violation = one_run is not None and any(
        a["verdict"] == "violation" for a in one_run["audits"])
    report = AuditReport(
        source=source,
        method=None if target.release is None else target.release.method,
        round=None if target.release is None else target.release.round,
        dataset={
            "name": dataset.name,
            "data_dir": used_dir,
            "n_train": len(dataset.y_train),
            "n_test": len(dataset.y_test),
        },
        sets={
            "seed": seed,
            "members_total": len(members),
            "per_half": split.per_half,
            "attack_half": {"members": split.per_half, "nonmembers": split.per_half},
            "audit_half": {"members": split.per_half, "nonmembers": split.per_half},
            "member_classes": sorted(np.unique(dataset.y_train[members]).tolist()),
        },
        privacy=claim,
        confidence=CONFIDENCE,
        semantics={
            "metrics": "computed on the audit half only; attacks are fitted on the other half",
            "balanced_accuracy": "best threshold on the audit half (optimistic)",
            "tpr_at_fpr": "best TPR with empirical FPR <= target, no interpolation",
            "eps_lb": (
                "max over audit thresholds of the docs/audit.md#epsilon-lower-bound bound with "
                "one-sided Clopper-Pearson "
                "upper bounds, Bonferroni over 2 bounds x (n+1) cuts x all attacks "
                f"(family-wise {CONFIDENCE:.0%}); delta = delta_tested"
            ),
        },
        attacks=results,
        max_eps_lb=best,
        max_eps_lb_attack=best_name,
        violation=bool(tested is not None and best > tested) or canary_violation,
        one_run=one_run,
        reference_models=None if scorer is None else scorer.describe(),
        feature_seconds=feature_seconds,
        release=_release_summary(target),
    )
    if out_dir is not None:
        write_report(report, out_dir)
    return report


def _release_summary(target: AuditTarget) -> dict[str, Any] | None:
    """The ledger's summary and what the run declared public (:func:`ledger_summary`)."""
    if target.release is None or not target.release.ledger:
        return None
    public = target.release.privacy.get("public") if isinstance(target.release.privacy,
                                                                dict) else None
    items = [str(x) for x in public] if isinstance(public, list) else []
    return ledger_summary(PrivacyLedger.replay(target.release.ledger), items)


def _audited_ids(split: Any, n_train: int) -> dict[str, np.ndarray]:
    """Record ids over train + test (train ``i`` -> ``i``, test ``j`` -> ``n_train + j``) of
    the audit half and of RMIA's population (the attack half's non-members)."""
    return {
        "audit": np.concatenate([split.audit_members, n_train + split.audit_nonmembers]),
        "population": n_train + split.attack_nonmembers,
    }


def audited_records(
    checkpoint_path: str | Path,
    data_dir: str | Path | None = None,
    seed: int = 0,
    max_per_half: int | None = None,
    factory: str | None = None,
) -> np.ndarray:
    """The records :func:`run_audit` with these settings scores with reference models: its
    audit half (members and non-members) and RMIA's population sample (the attack half's
    non-members), as sorted ids over the train and test sets (train record ``i`` is ``i``,
    test record ``j`` is ``n_train + j``). Offline reference models must not train on any.
    ``factory``: as for :func:`run_audit` (no model is built here; the consent is checked)."""
    target = load_run_records(checkpoint_path, data_dir, factory)
    split = make_membership_split(target.members, target.dataset.y_train,
                                  target.dataset.y_test, seed=seed, max_per_half=max_per_half)
    ids = _audited_ids(split, len(target.dataset.y_train))
    return np.unique(np.concatenate([ids["audit"], ids["population"]]))


def _reference_scorer(
    target: AuditTarget, split: Any, references: Sequence[ReferenceModel],
    device: torch.device, seed: int,
) -> ReferenceScorer:
    """RMIA / LiRA for this audit: population ``Z`` = the attack half's non-members (test
    records no model trained on); ``a`` tuned on the records no audit set uses."""
    data = target.dataset
    n_train = len(data.y_train)
    ids = _audited_ids(split, n_train)
    audited = np.concatenate([ids["audit"], ids["population"]])
    x_all = np.concatenate([data.x_train, data.x_test])
    y_all = np.concatenate([data.y_train, data.y_test])
    pool = np.setdiff1d(np.arange(len(y_all)), audited)
    return ReferenceScorer(
        target.model, references, x_all[ids["population"]], y_all[ids["population"]],
        audited=audited, tuning_x=x_all[pool], tuning_y=y_all[pool], tuning_index=pool,
        device=device, seed=seed,
    )


def _canary_report(target: AuditTarget, claim: PrivacyClaim,
                   scorer: ReferenceScorer | None = None) -> dict[str, Any] | None:
    """The one-run audits of the run's canaries (:mod:`.canary_audit`), or None without.

    With reference models, black-box canaries are also scored by RMIA and LiRA (canary
    records are never in a reference model's data: references train without canaries).
    The top level holds the audit with the largest lower bound; ``audits`` every one, with
    the canary scores (in / out) for the histograms."""
    saved = None if target.private is None else target.private.canaries
    if saved is None:
        return None
    state = CanaryState.from_state(saved)
    delta = claim.delta if claim.delta is not None else config_delta(target.private)
    extra = None
    if scorer is not None and state.kind == CanaryKind.BLACK_BOX:
        assert state.images is not None and state.labels is not None
        found = scorer.score(state.images.float().numpy(), state.labels.long().numpy())
        extra = {f"black-box/{name}": values for name, values in found.items()}
    audits = run_canary_audits(state, target.model, claim.epsilon, delta, CONFIDENCE,
                               extra_scores=extra, curve=_claim_curve(target, state.kind))
    if not audits:
        return None
    entries = [{**a.to_json(), **score_summary(a.scores_in, a.scores_out)} for a in audits]
    best = audits.index(strongest_audit(audits))
    primary = {k: v for k, v in entries[best].items()
               if k not in ("scores_in", "scores_out", "histogram")}
    return {**primary, "kind": state.kind, "audits": entries}


def _claim_curve(target: AuditTarget, kind: str) -> ClaimCurve | None:
    """The trade-off curve of the mechanism the run's ledger describes, for canaries of
    ``kind`` (:mod:`.claim_curve`): record-level ledgers for record canaries (white-box,
    black-box), client-level ones for canary clients; None otherwise or without a ledger."""
    if target.release is None or not target.release.ledger:
        return None
    ledger = PrivacyLedger.replay(target.release.ledger)
    unit = Notion.CLIENT if kind == CanaryKind.CLIENTS else Notion.RECORD
    if ledger.notion != unit:
        return None
    steps = ledger_steps(ledger)
    if steps is None:
        return None
    return ClaimCurve.from_steps(steps, ledger.delta or 1e-5)
