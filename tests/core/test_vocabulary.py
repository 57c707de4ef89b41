"""The privacy vocabulary (``fedlap_privacy.vocabulary``) is what users read: the words in the
JSON they see, the CLI's choices, what the run files store. Enums must not change any of it:
the JSON is pinned here byte for byte (numbers masked, then checked to their own precision),
and everything a record stores is plain text (``torch.load(weights_only=True)`` reads no
enums)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import pytest
import torch
from helpers import tiny

from fedlap_privacy.accountant import accountant_names
from fedlap_privacy.fl.run.privacy import build_ledger, privacy_statement, with_planned_sigma
from fedlap_privacy.vocabulary import (
    NOTION_THREAT_MODELS,
    CanaryKind,
    NoiseKind,
    Notion,
    ThreatModel,
    words,
)

_NUMBER = re.compile(r"-?\d+\.\d+(?:e-?\d+)?")


def _masked(text: str) -> tuple[str, list[float]]:
    """``text`` with every float replaced by ``#``, and the floats."""
    return _NUMBER.sub("#", text), [float(v) for v in _NUMBER.findall(text)]


def test_the_words_are_the_documented_ones() -> None:
    assert words(ThreatModel) == ("server", "hidden-selection", "trusted-server")
    assert words(Notion) == ("record-level", "client-level", "local", "none")
    assert words(NoiseKind) == ("secret", "seeded", "none")
    assert words(CanaryKind) == ("white-box", "black-box", "clients")
    assert accountant_names()[:2] == ("rdp", "pld")
    assert [t for t in ThreatModel if t.hides_selection] == [
        ThreatModel.HIDDEN_SELECTION, ThreatModel.TRUSTED_SERVER]
    assert json.dumps({ThreatModel.SERVER: Notion.RECORD}) == '{"server": "record-level"}'


def test_the_cli_offers_the_vocabulary() -> None:
    from fedlap_privacy.cli import plan, train

    assert [m.value for m in plan.Accountant] == list(accountant_names())
    assert [m.value for m in plan.PlanThreatModel] == ["hidden-selection", "server"]
    assert set(NOTION_THREAT_MODELS[Notion.RECORD]) == set(plan.PlanThreatModel)
    assert train.ThreatModel is ThreatModel


#: ``plan --json --threat-model server --client-fraction 0.5 --rounds 3 --accountant rdp``
#: as it printed before the vocabulary became enums (floats masked; "warnings" added
#: since: the large-epsilon warning)
PLAN_JSON = (
    '{"mode": "epsilon", "accountant": "rdp", "epsilon": #, "epsilon_by_accountant": '
    '{"rdp": #, "pld": #}, "target_epsilon": null, "within_budget": null, "delta": #, '
    '"sigma": #, "rounds": 3, "q1": #, "q2": #, "local_steps": 200, "batch_size": #, '
    '"client_size": 10000, "client_fraction": #, "threat_model": "server", "order": #, '
    '"curve": [#, #, #], "warnings": []}\n'
)
PLAN_NUMBERS = [4.412868796635234, 4.412868796635234, 3.9543569715228015, 1e-05, 1.0, 0.0256,
                0.0256, 256.0, 0.5, 4.9, 2.786643942642235, 3.6737083951020395,
                4.412868796635234]


def test_plan_json_is_unchanged() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fedlap_privacy.cli.main", "plan", "--json", "--threat-model",
         "server", "--client-fraction", "0.5", "--rounds", "3", "--accountant", "rdp"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    skeleton, numbers = _masked(out.replace("1e-05", "0.00001"))
    assert skeleton == PLAN_JSON
    assert numbers == pytest.approx(PLAN_NUMBERS, rel=1e-9)


#: the privacy statement of ``tiny(method="dp-fedavg", client_fraction=0.5,
#: threat_model="hidden-selection")`` on clients of 300 records before any round, as the
#: summary JSON printed it before the vocabulary became enums (floats masked)
PRIVACY_JSON = (
    '{"notion": "record-level", "epsilon": #, "threat_model": "hidden-selection", '
    '"epsilon_by_threat_model": {"server": #, "hidden-selection": #}, "delta": #, '
    '"sigma": #, "accountant": "pld", "epsilon_by_accountant": {"pld": #, "rdp": #}, '
    '"round_epsilon": null, "noise": "secret", "private": true, "public": ["each client\'s '
    'dataset size N_k (the smallest sets the sampling rate)"], "selection": "withheld"}'
)


def test_the_privacy_statement_is_plain_json_and_plain_text() -> None:
    cfg = tiny(method="dp-fedavg", client_fraction=0.5, threat_model="hidden-selection",
               sigma=1.0)
    cfg = with_planned_sigma(cfg, [300] * cfg.clients)
    ledger = build_ledger(cfg, [300] * cfg.clients)
    block = privacy_statement(cfg, ledger).to_json()
    skeleton, _ = _masked(json.dumps(block).replace("1e-05", "0.00001"))
    assert skeleton == PRIVACY_JSON
    # what the run files store is plain text: checkpoints load with weights_only
    for value in (cfg.resolved_threat_model, cfg.resolved_canary_kind, cfg.noise,
                  ledger.notion, ledger.threat_model, ledger.noise, ledger.accountant,
                  *block["epsilon_by_threat_model"], *block["epsilon_by_accountant"]):
        assert type(value) is str, value
    buffer = io.BytesIO()
    torch.save({"privacy": block, "config": cfg.to_dict()}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["privacy"] == block
