"""The typed records of a run: their JSON is the JSON users have always read, and a file
read back (untrusted) is refused in one line when a field is missing or of the wrong type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedlap_privacy.errors import CheckpointError
from fedlap_privacy.fl.run.released_metrics import RELEASED_UNDER_HIDDEN_SELECTION, released_round
from fedlap_privacy.fl.run.run_files import METRICS, load_history
from fedlap_privacy.fl.run.run_records import PrivacyStatement, RoundRecord, RunSummary

ROUND = {"round": 2, "test_accuracy": 0.5, "test_loss": 1.25, "epsilon": 1.5, "delta": 1e-5,
         "rounds_spent": 2, "accesses": 4, "local_steps": 4, "clients": 3, "replies": 3,
         "lr": 0.05, "upload_bytes": 1056.0, "server_steps": 2, "radius": 1.5,
         "seconds": 0.25}
PRIVACY = {"notion": "client-level", "epsilon": 2.0, "threat_model": "trusted-server",
           "epsilon_by_threat_model": None, "delta": 1e-5, "sigma": 1.1, "accountant": "pld",
           "epsilon_by_accountant": {"pld": 2.0, "rdp": 2.4}, "round_epsilon": None,
           "noise": "secret", "private": True, "public": ["the split seed"],
           "selection": "withheld", "client_sampling": "Poisson client sampling at rate 0.5"}
SUMMARY = {"method": "dp-normfedavg", "dataset": "digits", "rounds_run": 2,
           "test_accuracy": 0.5, "validation_accuracy": None, **PRIVACY,
           "sigma_planned": True, "upload_bytes_mean": None, "upload_bytes_total": 0,
           "stopped": "completed", "out": None}


def test_records_write_back_the_json_they_read_key_for_key_in_order() -> None:
    record = RoundRecord.from_json(ROUND)
    assert record.extras == {"server_steps": 2, "radius": 1.5} and record.clients == 3
    assert json.dumps(record.to_json()) == json.dumps(ROUND)
    statement = PrivacyStatement.from_json(PRIVACY)
    assert statement.public == ("the split seed",)
    assert json.dumps(statement.to_json()) == json.dumps(PRIVACY)
    summary = RunSummary.from_json(SUMMARY)
    assert summary.privacy == statement and summary.has_validation
    assert json.dumps(summary.to_json()) == json.dumps(SUMMARY)
    # no validation hold-out, no record-level sampling: neither key is written
    plain = {k: v for k, v in SUMMARY.items() if k not in ("validation_accuracy",
                                                           "client_sampling")}
    assert json.dumps(RunSummary.from_json(plain).to_json()) == json.dumps(plain)


def test_a_hidden_selection_releases_the_allow_list_and_the_public_extras_only() -> None:
    record = RoundRecord.from_json(ROUND)
    released = released_round(record, "hidden-selection", public_extras=("radius",))
    assert list(released.to_json()) == [*RELEASED_UNDER_HIDDEN_SELECTION, "radius"]
    assert released_round(record, "server") == record
    assert RoundRecord.from_json(released.to_json()) == released


@pytest.mark.parametrize(("change", "message"), [
    ({"test_accuracy": "high"}, "'test_accuracy' is str"),
    ({"round": 2.5}, "'round' is float"),
    ({"clients": True}, "'clients' is bool"),
    ({"radius": [1]}, "'radius' is list"),
    ({"round": None}, "'round' is NoneType"),
])
def test_a_round_of_the_wrong_shape_is_one_line(change, message) -> None:
    with pytest.raises(CheckpointError, match=message):
        RoundRecord.from_json({**ROUND, **change})
    without = {k: v for k, v in ROUND.items() if k != "lr"}
    with pytest.raises(CheckpointError, match="has no 'lr'"):
        RoundRecord.from_json(without)


def test_a_summary_of_the_wrong_shape_is_one_line() -> None:
    with pytest.raises(CheckpointError, match="'private' is str"):
        RunSummary.from_json({**SUMMARY, "private": "yes"})
    with pytest.raises(CheckpointError, match="'public' is not a list of strings"):
        PrivacyStatement.from_json({**PRIVACY, "public": [1]})
    with pytest.raises(CheckpointError, match="not a mapping of names to numbers"):
        PrivacyStatement.from_json({**PRIVACY, "epsilon_by_accountant": {"pld": "2"}})
    with pytest.raises(CheckpointError, match="not a JSON object"):
        RunSummary.from_json([SUMMARY])


def test_load_history_names_the_line_it_cannot_read(tmp_path: Path) -> None:
    good = json.dumps(ROUND)
    (tmp_path / METRICS).write_text(good + "\n\n" + good + "\n")
    assert [r.round for r in load_history(tmp_path)] == [2, 2]
    (tmp_path / METRICS).write_text(good + "\n{not json\n")
    with pytest.raises(CheckpointError, match=r"metrics.jsonl line 2 is not JSON"):
        load_history(tmp_path)
    (tmp_path / METRICS).write_text(json.dumps({**ROUND, "epsilon": "1"}) + "\n")
    with pytest.raises(CheckpointError, match=r"line 1: 'epsilon' is str"):
        load_history(tmp_path)
