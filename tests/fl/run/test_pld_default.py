"""PLD by default where a user spends a budget: ``train`` plans and reports with it, RDP's
figure is kept beside it, and dp-accounting's pessimistic PLD is the oracle.

The default run (FedLAP-DP on the embedded digits, 10 rounds, sigma 1.5, B 64, T 10, the
smallest client 281 records) is priced through the same functions ``train`` uses (its ledger
and privacy block) without training it; a tiny run checks the summary end to end.
"""

from __future__ import annotations

import dataclasses

import pytest
from dp_accounting.pld import PLDAccountant
from helpers import tiny

from fedlap_privacy.accountant import FedLAPSchedule, epsilon
from fedlap_privacy.accountant.dp_events import schedule_event
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.config_resolve import resolve_config
from fedlap_privacy.fl.engine.compare_budgets import client_sizes
from fedlap_privacy.fl.engine.simulation import train
from fedlap_privacy.fl.run.privacy import build_ledger, privacy_statement, with_planned_sigma
from fedlap_privacy.fl.run.run_records import PrivacyStatement

#: our PLD against dp-accounting's pessimistic PLD at its default grid (issue 35)
PLD_RTOL = 2e-3


def dp_accounting_pld(schedule: FedLAPSchedule, sigma: float, rounds: int, delta: float) -> float:
    accountant = PLDAccountant()  # pessimistic, value_discretization_interval 1e-4
    accountant.compose(schedule_event(schedule, sigma, rounds))
    return float(accountant.get_epsilon(delta))


def _priced(cfg: TrainConfig) -> PrivacyStatement:
    """The privacy statement ``train`` would release after every round of ``cfg`` (every client
    selected every round, as the default's client fraction 1 does)."""
    sizes = client_sizes(cfg)
    cfg = with_planned_sigma(cfg, sizes)
    ledger = build_ledger(cfg, sizes)
    for m in range(1, cfg.rounds + 1):
        ledger.record(m, cfg.accesses_per_round, list(range(cfg.clients)))
    return privacy_statement(cfg, ledger)


def test_the_default_run_reports_pld_below_rdp_and_equal_to_dp_accounting() -> None:
    cfg = resolve_config()
    assert cfg.accountant == "pld" and cfg.sigma == 1.5 and cfg.rounds == 10
    block = _priced(cfg)
    schedule = FedLAPSchedule(batch_size=64, client_size=281, local_steps=10)
    assert min(client_sizes(cfg)) == 281 and cfg.accesses_per_round == 10
    by = block.epsilon_by_accountant
    assert by is not None and block.accountant == "pld" and list(by) == ["pld", "rdp"]
    assert block.epsilon == by["pld"]
    assert by["pld"] == pytest.approx(dp_accounting_pld(schedule, 1.5, 10, 1e-5), rel=PLD_RTOL)
    # RDP's figure is Theorem 5.8's, the number the default run quoted before (9.546)
    assert by["rdp"] == pytest.approx(epsilon(schedule, 1.5, 10, 1e-5), rel=1e-12)
    assert by["rdp"] == pytest.approx(9.546, abs=5e-4)
    # where they differ, and by how much: PLD 8.6% below RDP on the default run
    assert by["pld"] == pytest.approx(8.725, abs=0.01)
    assert 0.08 < 1 - by["pld"] / by["rdp"] < 0.095
    # an RDP run (--set accountant=rdp): the same two figures, RDP's first and guaranteed
    rdp = _priced(dataclasses.replace(cfg, accountant="rdp"))
    assert rdp.accountant == "rdp" and list(rdp.epsilon_by_accountant or {}) == ["rdp", "pld"]
    assert rdp.epsilon == by["rdp"] and rdp.epsilon_by_accountant == by


def test_a_target_is_planned_to_the_same_guarantee_with_less_noise() -> None:
    """--target-eps 3 on the default run: PLD's sigma meets (3, 1e-5) by dp-accounting's
    PLD too, with less noise than RDP's sigma for the same (3, 1e-5)."""
    planned = {acc: with_planned_sigma(resolve_config(flags={"target_eps": 3.0},
                                                      settings=[f"accountant={acc}"]),
                                       [291, 288, 281, 290, 288])
               for acc in ("pld", "rdp")}
    schedule = FedLAPSchedule(batch_size=64, client_size=281, local_steps=10)
    pld, rdp = planned["pld"].sigma, planned["rdp"].sigma
    assert pld is not None and rdp is not None and pld < 0.96 * rdp
    assert 2.99 < dp_accounting_pld(schedule, pld, 10, 1e-5) <= 3.0 * (1 + PLD_RTOL)
    assert epsilon(schedule, pld, 10, 1e-5) > 3.0  # RDP would not certify PLD's sigma


def test_train_summary_names_the_accountant_and_keeps_rdp_beside_it() -> None:
    cfg = tiny(method="dp-fedavg", rounds=2, split="iid", split_seed=0)
    result = train(cfg)
    privacy = result.summary.privacy
    schedule = result.ledger.schedule
    assert schedule is not None and privacy.accountant == "pld"
    by = privacy.epsilon_by_accountant
    assert privacy.epsilon == by["pld"] <= by["rdp"]
    assert by["pld"] == pytest.approx(dp_accounting_pld(schedule, cfg.sigma, 2, cfg.delta),
                                      rel=PLD_RTOL)
    assert by["rdp"] == pytest.approx(epsilon(schedule, cfg.sigma, 2, cfg.delta), rel=1e-12)
    # the ledger's entries record the accountant that priced them
    assert {e.accountant for e in result.ledger.entries} == {"pld"}


def test_a_resumed_run_keeps_the_accountant_it_started_with(tmp_path) -> None:
    """A run started with RDP resumes with RDP (its ledger's entries say so), also when its
    recorded configuration predates the ``accountant`` key; one that recorded PLD but whose
    ledger says RDP is refused in one line."""
    from fedlap_privacy.errors import CheckpointError
    from fedlap_privacy.fl.engine.simulation import resume
    from fedlap_privacy.state.checkpoint import (
        PRIVATE,
        PRIVATE_FORMAT,
        load_checkpoint,
        save_checkpoint,
    )

    def edit_config(out, change) -> None:
        payload = load_checkpoint(out / PRIVATE, PRIVATE_FORMAT)
        payload.pop("format")
        payload["config"] = change(payload["config"])
        save_checkpoint(out / PRIVATE, payload, PRIVATE_FORMAT)

    cfg = tiny(method="dp-fedavg", rounds=1, local_steps=1, accountant="rdp")
    out = tmp_path / "run"
    first = train(cfg, out).summary
    assert first.privacy.accountant == "rdp"
    edit_config(out, lambda c: {k: v for k, v in c.items() if k != "accountant"})  # an old run
    resumed = resume(out, rounds=2)
    assert resumed.summary.privacy.accountant == "rdp"
    assert {e.accountant for e in resumed.ledger.entries} == {"rdp"}
    schedule = resumed.ledger.schedule
    assert resumed.summary.privacy.epsilon == pytest.approx(
        epsilon(schedule, cfg.sigma, 2, cfg.delta))
    edit_config(out, lambda c: {**c, "accountant": "pld"})
    with pytest.raises(CheckpointError, match="has accountant 'rdp', the run 'pld'"):
        resume(out, rounds=3)
