"""Canary clients inside Flower's own DP strategies (issue 44, item 4), run in-process.

Flower's wrappers (``DifferentialPrivacyServerSideFixedClipping`` and friends, legacy and
Message API) are driven through their own configure / aggregate calls by
:func:`~fedlap_privacy.audit.flower.flower_rehearsal.rehearse` with synthetic clients; the canaries
of :func:`~fedlap_privacy.audit.flower.flower_audit.CanaryClients` go into every aggregation.
Flower's noise draws from ``np.random`` (seeded here), the canaries from seeded generators
put in place of the OS ones.
Configurations (measured in benchmarks/audit_power/flower_canaries.py over seeds):

* cohort: 600 clients, 60 sampled (q = 0.1), 20 rounds, 1000 canaries (about 50 in a
  round, each replacing a sampled client), z = 1.2 (claim 2.52 at delta 1e-5);
* sparse: 1000 clients, 20 sampled (q = 0.02), 100 rounds, 200 canaries (2 per round), z = 1
  (claim 1.43): a canary's aggregation weight is then its own, as one large client's is.
"""

from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="the flower extra is not installed")

from flwr.server import strategy as legacy  # noqa: E402
from flwr.serverapp import strategy as messages  # noqa: E402

from fedlap_privacy.audit import CanaryClients, rehearse_flower  # noqa: E402
from fedlap_privacy.audit.flower import flower_canaries  # noqa: E402
from fedlap_privacy.errors import ConfigError  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded_canaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The canaries' OS draws replaced by seeded ones, so each verdict here is the same on
    every run (the product has no seed: a known one would make the coins public)."""
    seeds = iter(range(1000))
    monkeypatch.setattr(flower_canaries, "os_generator",
                        lambda: np.random.default_rng(next(seeds)))


COHORT = {"population": 600, "sampled": 60, "rounds": 20, "m": 1000, "z": 1.2}
SPARSE = {"population": 1000, "sampled": 20, "rounds": 100, "m": 200, "z": 1.0}
DIMENSION = 5000


def _audit(api, config, noise, *, wrapper="ServerSideFixedClipping", seed=0, **canary_kw):
    """Rehearse ``config`` with the wrapper's noise at ``noise`` times the claimed one; the
    audit tests the claim (the configured z)."""
    np.random.seed(seed)  # noqa: NPY002 (Flower adds its noise from the global state)
    z, n, population = config["z"], config["sampled"], config["population"]
    module = legacy if api == "legacy" else messages
    if api == "legacy":
        inner = legacy.FedAvg(fraction_fit=n / population, min_fit_clients=2,
                              min_available_clients=2)
    else:
        inner = messages.FedAvg(fraction_train=n / population, min_train_nodes=2,
                                min_available_nodes=2)
    dp = getattr(module, f"DifferentialPrivacy{wrapper}")(
        inner, noise_multiplier=noise * z, clipping_norm=1.0, num_sampled_clients=n)
    strategy = CanaryClients(dp, m=config["m"], **canary_kw)
    rehearse_flower(strategy, config["rounds"], population=population, dimension=DIMENSION,
                    seed=seed)
    result = strategy.audit(noise_multiplier=z)
    return strategy, result


def test_a_correct_server_side_wrapper_is_consistent():
    _, result = _audit("legacy", COHORT, 1.0)
    assert result.claim.mechanism.sample_rate == pytest.approx(0.1)
    assert result.claim.epsilon == pytest.approx(2.520, abs=0.01)
    assert result.verdict == "consistent"
    assert result.epsilon_lower_bound < result.claim.epsilon
    assert 1.5 < result.run.mean_participations < 2.5  # q T = 2


def test_noise_at_a_third_of_the_claim_is_a_violation():
    _, result = _audit("legacy", COHORT, 0.3)
    assert result.violation
    assert result.claim_p_value < 0.05 / 9


def test_the_message_api_wrapper_is_audited_too():
    strategy, result = _audit("message", COHORT, 0.3)
    assert type(strategy).__name__ == "MessageCanaryClients"
    assert result.violation


def test_a_large_num_examples_scales_a_client_past_the_noise():
    """FedAvg weights replies by num_examples; the legacy wrapper clips each update to C and
    calibrates its noise to C / n, so a client that reports 10x the others' examples moves
    the average by up to ~5x C / n: caught, while equal weights are consistent."""
    _, equal = _audit("legacy", SPARSE, 1.0)
    _, large = _audit("legacy", SPARSE, 1.0, num_examples=1000)  # the real clients: 100
    assert equal.verdict == "consistent"
    assert large.violation
    assert large.epsilon_lower_bound > equal.epsilon_lower_bound + 0.5
    estimate = large.audit.score("clients/final").estimate
    baseline = equal.audit.score("clients/final").estimate
    assert estimate is not None and estimate.epsilon > baseline.epsilon


def _one_round_change(wrapper, **canary_kw):
    np.random.seed(0)  # noqa: NPY002 (Flower adds its noise from the global state)
    dp = getattr(legacy, f"DifferentialPrivacy{wrapper}")(
        legacy.FedAvg(fraction_fit=0.5, min_fit_clients=2, min_available_clients=2),
        noise_multiplier=0.0, clipping_norm=2.0, num_sampled_clients=10)
    strategy = CanaryClients(dp, m=24, **canary_kw)
    rehearse_flower(strategy, 1, population=20, dimension=50, update_norm=1e-9, seed=0)
    canaries = strategy.canaries
    taking_part = np.flatnonzero(canaries.participations)
    return canaries, taking_part


@pytest.mark.parametrize("wrapper,expected", [
    ("ServerSideFixedClipping", 2.0),  # sent at 10 C, clipped by the server to C
    ("ClientSideFixedClipping", 2.0),  # sent at exactly C (its clients clip)
])
def test_a_canary_enters_the_average_at_exactly_the_clip(wrapper, expected):
    canaries, taking_part = _one_round_change(wrapper)
    assert 2 <= len(taking_part) <= 10
    delta = canaries.total_delta
    # no noise, real updates ~0: the change is the canaries' updates over the n = 10 replies
    # (each canary replaced a sampled client)
    expected_change = sum(canaries.directions[j].astype(np.float64) for j in taking_part)
    np.testing.assert_allclose(delta, expected_change * expected / 10, atol=1e-5)


def test_without_clipping_the_canary_update_is_ten_times_the_clip():
    canaries, taking_part = _one_round_change("ClientSideFixedClipping", update_scale=10.0)
    expected_change = sum(canaries.directions[j].astype(np.float64) for j in taking_part)
    np.testing.assert_allclose(canaries.total_delta, expected_change * 20.0 / 10, atol=1e-4)


def test_what_it_cannot_wrap_or_audit_is_one_line():
    with pytest.raises(ConfigError, match="wraps a Flower strategy"):
        CanaryClients(object(), m=10)
    with pytest.raises(ConfigError, match="at least 4 canary"):
        CanaryClients(legacy.FedAvg(), m=2)
    plain = CanaryClients(legacy.FedAvg(fraction_fit=0.5), m=10)
    with pytest.raises(ConfigError, match="no clipping_norm"):
        rehearse_flower(plain, 1, population=10, dimension=10)
    clipped = CanaryClients(legacy.FedAvg(fraction_fit=0.5), m=10, clip_norm=1.0)
    rehearse_flower(clipped, 2, population=10, dimension=10)
    with pytest.raises(ConfigError, match="no noise_multiplier"):
        clipped.audit()
    with pytest.raises(ConfigError, match="nothing to audit"):
        CanaryClients(legacy.FedAvg(), m=10, clip_norm=1.0).audit(noise_multiplier=1.0)


def test_the_report_is_written(tmp_path):
    strategy = CanaryClients(legacy.DifferentialPrivacyServerSideFixedClipping(
        legacy.FedAvg(fraction_fit=0.5), noise_multiplier=1.0, clipping_norm=1.0,
        num_sampled_clients=5), m=40)
    rehearse_flower(strategy, 5, population=10, dimension=100, seed=1)
    result = strategy.audit(out=tmp_path / "audit")
    import json

    report = json.loads((tmp_path / "audit" / "report.json").read_text())
    assert report["verdict"] == result.verdict
    ours = json.loads((tmp_path / "audit" / "flower-canaries.json").read_text())
    assert {a["audit"] for a in ours["audits"]} == {
        "clients/final", "clients/all-iterates", "clients/round-likelihood"}
    assert ours["claim"]["mechanism"]["steps"] == 5
    assert (tmp_path / "audit" / "report.html").exists()


def test_the_report_states_the_mechanisms_own_epsilon_and_one_claim(tmp_path):
    """A claim of 0.1 for sigma 1 at rate 0.5 over 5 rounds: the report said the mechanism
    was "(0.1, 1e-05)-DP", the claim, not what the mechanism spends. A second claim on the
    same canaries is refused."""
    import json

    strategy = CanaryClients(legacy.DifferentialPrivacyServerSideFixedClipping(
        legacy.FedAvg(fraction_fit=0.5), noise_multiplier=1.0, clipping_norm=1.0,
        num_sampled_clients=5), m=40)
    rehearse_flower(strategy, 5, population=10, dimension=100, seed=1)
    strategy.audit(claimed_epsilon=0.1, out=tmp_path / "audit")
    report = json.loads((tmp_path / "audit" / "report.json").read_text())
    assert report["claim"]["epsilon"] == 0.1
    assert report["claim"]["mechanism_epsilon"] > 2.0
    assert "(0.1, 1e-05)-DP" not in (tmp_path / "audit" / "report.md").read_text()
    strategy.audit(claimed_epsilon=0.1)  # the same claim again: allowed
    with pytest.raises(ConfigError, match=r"already audited against epsilon 0\.1"):
        strategy.audit(claimed_epsilon=5.0)
