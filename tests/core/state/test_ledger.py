"""The ledger's notions and the heterogeneous composition it rests on
(docs/accounting.md#theorem-58, #other-privacy-notions)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fedlap_privacy.accountant import (
    DEFAULT_ORDERS,
    FedLAPSchedule,
    composed_epsilon,
    epsilon,
    rdp_to_epsilon,
    sgm_rdp,
)
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.state.ledger import PrivacyLedger

REF = FedLAPSchedule(batch_size=256, client_size=10000, local_steps=200)


def test_equal_rounds_compose_to_the_paper() -> None:
    assert composed_epsilon([REF] * 15, 1.0, 1e-5) == pytest.approx(10.1830, abs=5e-5)
    assert composed_epsilon([REF] * 3, 1.0, 1e-5, "pld") == pytest.approx(
        epsilon(REF, 1.0, 3, 1e-5, "pld"), rel=1e-12
    )
    assert composed_epsilon([], 1.0, 1e-5) == 0.0


def test_rounds_with_different_t_add_their_rdp() -> None:
    """ALI-DPFL: round m makes tau_m accesses; RDP of the run = sum of the rounds' RDP."""
    taus = [3, 7, 7, 1]
    rounds = [dataclasses.replace(REF, local_steps=t, client_fraction=0.5) for t in taus]
    q1, q2 = 0.5 * 256 / 10000, 256 / 10000
    rdp = sum(sgm_rdp(q1, 1.2, DEFAULT_ORDERS) + (t - 1) * sgm_rdp(q2, 1.2, DEFAULT_ORDERS)
              for t in taus)
    expected = rdp_to_epsilon(rdp, DEFAULT_ORDERS, 1e-5)[0]
    assert composed_epsilon(rounds, 1.2, 1e-5) == pytest.approx(expected, rel=1e-12)
    # order does not matter; PLD stays below RDP
    assert composed_epsilon(rounds[::-1], 1.2, 1e-5) == pytest.approx(expected, rel=1e-12)
    assert composed_epsilon(rounds, 1.2, 1e-5, "pld") < expected


def test_client_level_schedule_is_one_sgm_over_clients() -> None:
    s = FedLAPSchedule.client_level(clients=100, client_fraction=0.1)
    assert s.q1 == s.q2 == pytest.approx(0.1) and s.local_steps == 1
    expected = rdp_to_epsilon(20 * sgm_rdp(0.1, 1.0, DEFAULT_ORDERS), DEFAULT_ORDERS, 1e-5)[0]
    assert epsilon(s, 1.0, 20, 1e-5) == pytest.approx(expected, rel=1e-12)
    # every client in every round: the plain Gaussian mechanism, RDP alpha / (2 sigma^2)
    full = FedLAPSchedule.client_level(clients=5)
    g = rdp_to_epsilon(10 * DEFAULT_ORDERS / (2 * 4.0**2), DEFAULT_ORDERS, 1e-5)[0]
    assert epsilon(full, 4.0, 10, 1e-5) == pytest.approx(g, rel=1e-12)


def test_record_level_ledger_enters_each_round_with_its_t() -> None:
    ledger = PrivacyLedger("record-level", REF, 1.0, 1e-5, clients=5)
    ledger.record(1, accesses=200, participants=range(5))
    entry = ledger.record(2, accesses=50, participants=range(5), local_steps=50)
    assert entry.local_steps == 50 and entry.rounds_spent == 2
    short = dataclasses.replace(REF, local_steps=50)
    assert entry.epsilon == pytest.approx(composed_epsilon([REF, short], 1.0, 1e-5), rel=1e-12)
    assert ledger.projected_epsilon(10) > ledger.epsilon
    with pytest.raises(ConfigError, match="more than the 50"):
        ledger.record(3, accesses=51, participants=range(5), local_steps=50)


def test_local_ledger_composes_per_weight_epsilon() -> None:
    ledger = PrivacyLedger("local", round_epsilon=0.5, clients=4)
    for m in (1, 2, 3):
        entry = ledger.record(m, accesses=1, participants=range(4))
    assert entry.epsilon == pytest.approx(1.5) and entry.round_epsilon == 0.5
    assert entry.delta is None and entry.sigma is None and entry.q1 is None


def test_non_private_ledger_has_no_epsilon() -> None:
    ledger = PrivacyLedger("none", clients=5)
    entry = ledger.record(1, accesses=10, participants=range(5))
    assert entry.epsilon is None and math.isinf(ledger.epsilon)


@pytest.mark.parametrize(
    "kwargs",
    [dict(notion="secret"), dict(notion="record-level"), dict(notion="local", round_epsilon=0)],
)
def test_ledger_refuses_an_incomplete_notion(kwargs) -> None:
    with pytest.raises(ConfigError):
        PrivacyLedger(**kwargs)
