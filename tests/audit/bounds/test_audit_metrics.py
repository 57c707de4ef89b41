"""Audit metrics, member/non-member sets and the privacy claim, on hand-made inputs
(docs/audit.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import ledger_claiming
from scipy.stats import beta, binom

from fedlap_privacy.audit.bounds.metrics import (
    attack_metrics,
    best_balanced_accuracy,
    clopper_pearson_interval,
    clopper_pearson_upper,
    epsilon_lower_bound,
    error_counts,
    tpr_at_fpr,
)
from fedlap_privacy.audit.inference.attacks import MLPAttack, ThresholdAttack
from fedlap_privacy.audit.inference.membership import make_membership_split, member_indices
from fedlap_privacy.errors import CheckpointError, ConfigError

# ------------------------------------------------------------------ Clopper-Pearson


def test_clopper_pearson_known_values() -> None:
    # Textbook exact 95% interval for 5 successes in 10 trials: (0.1871, 0.8129).
    lo, hi = clopper_pearson_interval(5, 10, 0.95)
    assert lo == pytest.approx(0.187086, abs=1e-6)
    assert hi == pytest.approx(0.812914, abs=1e-6)
    # Closed forms at the edges: k = 0 -> 1 - alpha^(1/n); k = n -> lower alpha^(1/n), upper 1.
    assert clopper_pearson_upper(0, 10, 0.05) == pytest.approx(1 - 0.05**0.1, rel=1e-12)
    assert clopper_pearson_upper(0, 10, 0.05) == pytest.approx(0.258866, abs=1e-6)
    assert clopper_pearson_upper(10, 10, 0.05) == 1.0
    lo, hi = clopper_pearson_interval(10, 10, 0.95)
    assert (lo, hi) == (pytest.approx(0.025**0.1, rel=1e-12), 1.0)
    # Definition: the upper bound p_hi is where P[Binomial(n, p_hi) <= k] = alpha.
    for k, n, alpha in [(3, 40, 0.05), (17, 50, 1e-4), (0, 1, 0.3)]:
        p_hi = float(clopper_pearson_upper(k, n, alpha))
        assert binom.cdf(k, n, p_hi) == pytest.approx(alpha, rel=1e-8)


def test_clopper_pearson_rejects_bad_input() -> None:
    with pytest.raises(ConfigError):
        clopper_pearson_upper(3, 0, 0.05)
    with pytest.raises(ConfigError):
        clopper_pearson_upper(11, 10, 0.05)
    with pytest.raises(ConfigError):
        clopper_pearson_upper(1, 10, 1.0)


# ------------------------------------------------------------ epsilon lower bound


def test_eps_lower_bound_perfect_separation_by_hand() -> None:
    members = np.arange(50) + 100.0
    outsiders = np.arange(50, dtype=float)
    labels = np.r_[np.ones(50), np.zeros(50)]
    scores = np.r_[members, outsiders]
    delta = 1e-5
    out = epsilon_lower_bound(labels, scores, delta=delta, confidence=0.95)
    # Bonferroni: 2 bounds x (50 + 50 + 1) candidate cuts; best cut has FP = FN = 0.
    a = 0.05 / (2 * 101)
    u = 1 - a ** (1 / 50)
    assert out["alpha_per_bound"] == pytest.approx(a)
    assert out["fpr_hi"] == pytest.approx(u) and out["fnr_hi"] == pytest.approx(u)
    assert out["eps_lb"] == pytest.approx(math.log((1 - delta - u) / u), rel=1e-10)
    assert out["threshold"] == 100.0
    # A family of 4 attacks widens the bounds, so the bound can only drop.
    wider = epsilon_lower_bound(labels, scores, delta=delta, family_size=4)
    assert wider["eps_lb"] < out["eps_lb"]


def test_eps_lower_bound_partial_separation_by_hand() -> None:
    # 180 of 200 members and 20 of 200 non-members score 1, the rest 0.
    labels = np.r_[np.ones(200), np.zeros(200)]
    scores = np.r_[np.ones(180), np.zeros(20), np.ones(20), np.zeros(180)]
    delta = 0.01
    a = 0.05 / (2 * 401)
    h = beta.ppf(1 - a, 20 + 1, 200 - 20)  # upper bound on 20/200, for FPR and FNR alike
    expected = math.log((1 - delta - h) / h)
    out = epsilon_lower_bound(labels, scores, delta=delta)
    assert out["eps_lb"] == pytest.approx(expected, rel=1e-10)
    assert expected > 0.3  # the example is informative, not clamped
    # Swapping the roles of members and non-members swaps FPR and FNR: same bound.
    assert epsilon_lower_bound(1 - labels, -scores, delta=delta)["eps_lb"] == pytest.approx(
        expected, rel=1e-10
    )


def test_eps_lower_bound_zero_for_uninformative_scores() -> None:
    labels = np.r_[np.ones(200), np.zeros(200)]
    assert epsilon_lower_bound(labels, np.zeros(400))["eps_lb"] == 0.0  # all ties
    rng = np.random.default_rng(1)
    assert epsilon_lower_bound(labels, rng.normal(size=400))["eps_lb"] == 0.0


def test_error_counts() -> None:
    labels = np.array([1, 1, 0, 0, 1])
    scores = np.array([3.0, 1.0, 2.0, 0.0, 1.0])
    thresholds, fp, fn = error_counts(labels, scores)
    assert thresholds.tolist() == [np.inf, 3.0, 2.0, 1.0, 0.0]
    assert fp.tolist() == [0, 0, 1, 1, 2]
    assert fn.tolist() == [3, 2, 2, 0, 0]


# ------------------------------------------------------------------- ROC metrics


def test_tpr_at_low_fpr_constructed() -> None:
    # 1000 non-members score 0..999; 10 members beat them all, 90 sit between the top two.
    outsiders = np.arange(1000, dtype=float)
    members = np.r_[np.full(10, 2000.0), np.full(90, 998.5)]
    labels = np.r_[np.ones(100), np.zeros(1000)]
    m = attack_metrics(labels, np.r_[members, outsiders]).to_json()
    assert m["tpr_at_fpr_0.001"] == 1.0  # one false positive is FPR 0.001 exactly: allowed
    from sklearn.metrics import roc_curve

    fpr, tpr, _ = roc_curve(labels, np.r_[members, outsiders], drop_intermediate=False)
    assert tpr_at_fpr(fpr, tpr, 0.0005) == pytest.approx(0.1)  # no interpolation to 0.55
    assert tpr_at_fpr(fpr, tpr, 0.0) == pytest.approx(0.1)
    assert m["auc"] == pytest.approx(1 - 0.9 * 0.001, abs=1e-9)
    assert best_balanced_accuracy(fpr, tpr) == pytest.approx((1.0 + 0.999) / 2)
    assert m["n_members"] == 100 and m["n_nonmembers"] == 1000


def test_attack_models_direction() -> None:
    rng = np.random.default_rng(0)
    loss_in, loss_out = rng.lognormal(-4, 1, 300), rng.lognormal(-2, 1, 300)
    x = np.r_[loss_in, loss_out]
    y = np.r_[np.ones(300, bool), np.zeros(300, bool)]
    for attack in (MLPAttack(seed=0), ThresholdAttack()):
        attack.fit(x, y)
        proba = attack.predict_proba(x)
        assert proba.shape == (600, 2) and np.allclose(proba.sum(1), 1)
        assert attack_metrics(y, attack.score(x)).auc > 0.8
    # The MLP follows its labels: trained on swapped labels it calls members non-members.
    assert attack_metrics(y, MLPAttack(seed=0).fit(x, ~y).score(x)).auc < 0.2


# ----------------------------------------------------------- member / non-member sets


def test_membership_split_is_balanced_disjoint_and_seeded() -> None:
    y_train = np.arange(1000) % 10
    y_test = np.arange(301) % 10
    members = member_indices([np.arange(0, 400), np.arange(300, 700)], 1000)
    assert members.tolist() == list(range(700))  # union, deduplicated
    s = make_membership_split(members, y_train, y_test, seed=3)
    assert s.per_half == 150  # limited by the test set (301 // 2)
    sets = [s.attack_members, s.attack_nonmembers, s.audit_members, s.audit_nonmembers]
    assert all(len(part) == 150 for part in sets)
    assert not set(s.attack_members) & set(s.audit_members)
    assert not set(s.attack_nonmembers) & set(s.audit_nonmembers)
    assert set(s.attack_members) | set(s.audit_members) <= set(members.tolist())
    again = make_membership_split(members, y_train, y_test, seed=3)
    same = [again.attack_members, again.attack_nonmembers, again.audit_members]
    same.append(again.audit_nonmembers)
    assert all(np.array_equal(a, b) for a, b in zip(sets, same, strict=True))
    other = make_membership_split(members, y_train, y_test, seed=4)
    assert not np.array_equal(other.audit_members, s.audit_members)
    # Few members: fewer records, still balanced.
    few = make_membership_split(np.arange(21), y_train, y_test, seed=0)
    assert few.per_half == 10
    capped = make_membership_split(members, y_train, y_test, max_per_half=7)
    assert capped.per_half == 7
    x, _, is_member, is_audit = s.gather(np.arange(1000.0), y_train, -np.arange(301.0) - 1, y_test)
    assert len(x) == 600 and is_member.sum() == 300 and is_audit.sum() == 300
    assert np.all((x >= 0) == is_member)  # members come from the train set
    assert (is_member & is_audit).sum() == 150


def test_membership_split_uses_members_classes_only() -> None:
    y_train = np.arange(1000) % 10
    y_test = np.arange(500) % 10
    members = np.flatnonzero(np.isin(y_train, [5, 6]))  # one non-IID client
    s = make_membership_split(members, y_train, y_test)
    assert set(y_test[np.r_[s.attack_nonmembers, s.audit_nonmembers]]) <= {5, 6}
    assert s.per_half == 50


def test_member_indices_rejects_bad_splits() -> None:
    with pytest.raises(CheckpointError, match="out of range"):
        member_indices([np.array([0, 5, 1000])], 1000)
    with pytest.raises(CheckpointError, match="out of range"):
        member_indices([np.array([-1])], 1000)
    with pytest.raises(CheckpointError):
        member_indices([], 1000)
    with pytest.raises(CheckpointError):
        member_indices([np.array([0.5])], 1000)
    with pytest.raises(ConfigError, match="too few"):
        make_membership_split(np.array([0]), np.zeros(10, int), np.zeros(10, int))


# ------------------------------------------------------------------- privacy claim


def _client_level_ledger(eps: float) -> list[dict]:
    from fedlap_privacy.accountant import FedLAPSchedule, plan_sigma
    from fedlap_privacy.state.ledger import PrivacyLedger

    schedule = FedLAPSchedule.client_level(5)
    ledger = PrivacyLedger("client-level", schedule, plan_sigma(schedule, 1, eps, 1e-5), 1e-5,
                           threat_model="trusted-server", clients=5)
    ledger.record(1, 1, range(5))
    return ledger.to_list()


def test_privacy_claim_is_recomputed_from_the_ledger() -> None:
    from fedlap_privacy.audit.bounds.claim import privacy_claim
    from fedlap_privacy.state.ledger import PrivacyLedger

    rec = privacy_claim({"epsilon": 0.01}, ledger_claiming(2.0))  # a hand-edited claim
    assert rec.epsilon_tested == pytest.approx(2.0, rel=1e-3) and rec.delta_tested == 1e-5
    assert rec.stored_epsilon == 0.01 and rec.stored_matches is False
    cli = privacy_claim(None, _client_level_ledger(1.0))
    assert cli.epsilon is not None and cli.epsilon_tested == pytest.approx(2 * cli.epsilon)
    assert cli.delta_tested == pytest.approx((1 + math.exp(cli.epsilon)) * 1e-5)
    assert privacy_claim(None, _client_level_ledger(12.0)).epsilon_tested is None
    local = PrivacyLedger("local", round_epsilon=3.0, clients=1)
    local.record(1, 1, [0])
    for ledger in ([], local.to_list()):
        assert privacy_claim(None, ledger).epsilon_tested is None
    with pytest.raises(CheckpointError):
        privacy_claim(None, [{"notion": "weird", "epsilon": 1.0}])
