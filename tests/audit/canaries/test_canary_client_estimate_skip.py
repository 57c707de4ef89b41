"""Issue 44 item 7: a run with too few canary clients on one side (a tiny dp-normfedavg run)
still audits: the bounds run and the epsilon ESTIMATE is skipped with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from fedlap_privacy.audit.canaries.canary_audit import run_canary_audits
from fedlap_privacy.audit.reports.privacy_report import canary_blocks, to_markdown
from fedlap_privacy.cli.main import app
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.simulation import train
from fedlap_privacy.state.canary_state import CanaryState
from fedlap_privacy.state.checkpoint import CHECKPOINT
from fedlap_privacy.vocabulary import CanaryKind

D = 50


def _state(included: list[bool], signal: float = 3.0) -> CanaryState:
    """Canary clients whose updates (their directions, times ``signal``) entered each of two
    rounds when included."""
    g = torch.Generator().manual_seed(0)
    state = CanaryState(CanaryKind.CLIENTS.value, torch.tensor(included),
                        torch.arange(len(included)), direction_seed=7, dimension=D)
    inserted = sum(state.direction(j) for j, x in enumerate(included) if x)
    deltas = [signal * inserted + torch.randn(D, generator=g, dtype=torch.float64)
              for _ in range(2)]
    state.cosines = [state.cosines_with(d) for d in deltas]
    state.total_delta = deltas[0] + deltas[1]
    return state


def test_one_unobserved_canary_client_skips_the_estimate_not_the_audit() -> None:
    # was: ConfigError "unobserved_cosines need at least 2 values to fit a Gaussian, got 1"
    audits = run_canary_audits(_state([True, True, False]), None, 2.0, 1e-5)
    assert [a.name for a in audits] == ["clients/final", "clients/all-iterates"]
    final, every = audits
    assert final.estimate is not None and final.estimate_skipped is None
    assert every.estimate is None
    assert "unobserved_cosines need at least 2 values" in every.estimate_skipped
    for audit in audits:  # the bounds ran on all three canaries
        assert audit.result.canaries == 3 and audit.verdict == "inconclusive"
    entry = every.to_json()
    assert "epsilon_estimate" not in entry and "at least 2 values" in entry[
        "epsilon_estimate_skipped"]
    report = {"confidence": 0.95, "one_run": {"canaries": 3, "kind": "clients",
                                              "audits": [a.to_json() for a in audits]}}
    text = to_markdown(canary_blocks(report))
    assert "<code>clients/all-iterates</code>: no epsilon ESTIMATE" in text


def test_every_canary_client_included_still_gives_bounds() -> None:
    audits = run_canary_audits(_state([True, True]), None, 2.0, 1e-5)
    assert audits[1].estimate is None and "got 0" in audits[1].estimate_skipped
    assert all(a.result.canaries == 2 for a in audits)


def test_canaries_below_the_null_skip_the_estimate() -> None:
    # no signal: the observed canaries' mean cosine falls below the null's (was: the whole
    # audit failed with "mu must be > 0 (above the null's mean 0)")
    final = run_canary_audits(_state([True, True, False], signal=0.0), None, 2.0, 1e-5)[0]
    assert final.estimate is None and "mu must be > 0" in final.estimate_skipped
    assert final.result.canaries == 3


def test_a_tiny_dp_normfedavg_run_audits(tmp_path: Path) -> None:
    """The reported case end to end: 3 canary clients (whatever their coins) audit with
    --json; each audit has an estimate or the reason it has none."""
    run = tmp_path / "run"
    train(TrainConfig(method="dp-normfedavg", rounds=1, local_steps=1, width=8, clients=3,
                      sigma=1.0, canaries=3), run)
    result = CliRunner().invoke(app, ["audit", "--model", str(run / CHECKPOINT), "--json",
                                      "--max-per-half", "40", "--attacks", "loss"])
    assert result.exit_code == 0, result.stderr
    one_run = json.loads(result.stdout)["one_run"]
    assert one_run["kind"] == "clients" and one_run["canaries"] == 3
    for audit in one_run["audits"]:
        assert ("epsilon_estimate" in audit) != ("epsilon_estimate_skipped" in audit)
