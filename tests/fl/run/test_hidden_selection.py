"""The release does not reveal whom the server selected when the epsilon assumes it hidden.

An epsilon that uses amplification by client sampling (``hidden-selection``, and the
client-level SGM of ``trusted-server``) holds only against someone who does not know who
was selected. Each test reads a run's released files as that someone would (``ckpt.pt``
loaded with weights_only, ``metrics.jsonl``) and looks for the selection: the participant
ids, the number of clients per round, the realised accesses, and the metrics that grow with
the cohort. Under the ``server`` threat model they stay released, and its epsilon (the
largest over the clients of their own rounds) still follows from them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from helpers import edit_checkpoint, tiny

from fedlap_privacy.audit.bounds.claim import privacy_claim
from fedlap_privacy.audit.inference.report import run_audit
from fedlap_privacy.errors import CheckpointError
from fedlap_privacy.fl.engine.simulation import resume, train
from fedlap_privacy.fl.run.released_metrics import RELEASED_UNDER_HIDDEN_SELECTION
from fedlap_privacy.fl.run.run_files import METRICS
from fedlap_privacy.state.checkpoint import (
    CHECKPOINT,
    PRIVATE,
    PRIVATE_FORMAT,
)
from fedlap_privacy.state.ledger import LedgerEntry, PrivacyLedger
from fedlap_privacy.state.run_state import ModelRelease, PrivateRunState

#: what would tell the adversary who (or how many) took part in a round
REVEALING = ("participants", "clients", "replies", "accesses", "seconds", "upload_bytes",
             "server_steps", "radius")

HIDDEN_RUNS = {
    "record-level hidden-selection": dict(method="dp-fedavg", threat_model="hidden-selection",
                                          client_fraction=0.5),
    "dp-normfedavg": dict(method="dp-normfedavg", client_fraction=0.5),
    "dp-fedavg-client poisson": dict(method="dp-fedavg-client", client_fraction=0.5),
    "dp-fedavg-client fixed": dict(method="dp-fedavg-client", clients_per_round=2,
                                   clip_quantile=0.5),
}


def _cfg(**kw: Any):
    return tiny(rounds=3, local_steps=1, sigma=1.0, split="iid", **kw)


def _revealing_values(value: Any) -> list[tuple[str, Any]]:
    """Every (key, value) anywhere in a released record whose key would reveal the
    selection and whose value is not withheld (tensors skipped)."""
    found: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if k in REVEALING and v is not None:
                found.append((k, v))
            found += _revealing_values(v)
    elif isinstance(value, list | tuple):
        for v in value:
            found += _revealing_values(v)
    return found


def _released(out: Path) -> tuple[ModelRelease, list[dict[str, Any]]]:
    release = ModelRelease.load(out / CHECKPOINT)  # weights_only, as anyone may load it
    metrics = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
    return release, metrics


@pytest.mark.parametrize("kind", sorted(HIDDEN_RUNS))
def test_release_withholds_the_selection_where_the_epsilon_assumes_it_hidden(tmp_path, kind):
    out = tmp_path / "run"
    result = train(_cfg(**HIDDEN_RUNS[kind]), out, device="cpu")
    # the run did select subsets (otherwise there would be nothing to hide)
    assert any(len(e.participants or ()) < 5 for e in result.ledger.entries)
    release, metrics = _released(out)
    # (the configuration's "clients" is K, the public number of clients of the run)
    readable = {k: v for k, v in dataclasses.asdict(release).items()
                if k not in ("model_state", "config")}
    assert _revealing_values(readable) == []
    assert _revealing_values(metrics) == []
    allowed = set(RELEASED_UNDER_HIDDEN_SELECTION) | {"expected_clients", "clip",
                                                      "below_clip_fraction"}
    assert all(set(h) <= allowed for h in [*release.history, *metrics])
    assert release.privacy["selection"] == "withheld"
    assert not any("selected" in p for p in release.privacy["public"])
    # the stated epsilon needs nothing withheld: the released ledger alone composes to it
    replayed = PrivacyLedger.replay(release.ledger)
    assert replayed.epsilon == pytest.approx(result.ledger.epsilon, rel=1e-12)
    assert release.privacy["epsilon"] == pytest.approx(result.summary.privacy.epsilon, rel=1e-12)
    # the private state keeps the selection (for --resume), the same one the run drew
    private = PrivateRunState.load(out / PRIVATE)
    assert [e["participants"] for e in private.ledger] == [
        list(e.participants or ()) for e in result.ledger.entries]
    assert [h["clients"] for h in private.history] == [h.clients for h in result.history]


def test_server_threat_release_keeps_the_selection_and_its_epsilon(tmp_path):
    out = tmp_path / "run"
    result = train(_cfg(method="dp-fedavg", client_fraction=0.5), out, device="cpu")
    release, metrics = _released(out)
    assert release.privacy["selection"] == "released"
    assert [e["participants"] for e in release.ledger] == [
        list(e.participants or ()) for e in result.ledger.entries]
    assert [h["clients"] for h in metrics] == [len(e.participants or ())
                                               for e in result.ledger.entries]
    assert any("selected" in p for p in release.privacy["public"])
    # the max-over-clients epsilon is recomputed from the released participants
    assert PrivacyLedger.replay(release.ledger).epsilon == pytest.approx(
        result.summary.privacy.epsilon, rel=1e-12)
    assert result.summary.privacy.epsilon > result.summary.privacy.epsilon_by_threat_model[
        "hidden-selection"]


def test_withheld_ledger_is_refused_where_the_epsilon_needs_the_participants():
    ledger = PrivacyLedger("record-level", _schedule(), 1.0, 1e-5, clients=4)
    for m in (1, 2, 3):
        ledger.record(m, 1, [m % 4])
    assert ledger.released_entries() == ledger.entries  # server: released as recorded
    withheld = [e.without_selection().to_dict() for e in ledger.entries]
    with pytest.raises(CheckpointError, match="needs the participants"):
        PrivacyLedger.replay(withheld)
    hidden = dataclasses.replace(ledger, threat_model="hidden-selection", entries=[])
    for m in (1, 2, 3):
        hidden.record(m, 1, [m % 4])
    released = hidden.released_entries()
    assert all(e.participants is None and e.accesses is None for e in released)
    again = PrivacyLedger.replay([e.to_dict() for e in released])
    assert again.epsilon == pytest.approx(hidden.epsilon, rel=1e-12)
    # its epsilon against the server, from the released form: every client in every round
    every_round = dataclasses.replace(ledger, entries=[])
    for m in (1, 2, 3):
        every_round.record(m, 1, [0, 1, 2, 3])
    assert again.epsilon_under("server") == pytest.approx(every_round.epsilon, rel=1e-12)
    assert again.epsilon_under("server") > ledger.epsilon  # the true one: one round each
    assert LedgerEntry.from_dict(released[0].to_dict()) == released[0]


def _schedule():
    from fedlap_privacy.accountant import FedLAPSchedule

    return FedLAPSchedule(batch_size=32, client_size=200, local_steps=1, client_fraction=0.5)


@pytest.mark.parametrize("kind", ["record-level hidden-selection", "dp-fedavg-client poisson"])
def test_resume_continues_and_refuses_a_tampered_ledger(tmp_path, kind):
    cfg = _cfg(**HIDDEN_RUNS[kind])
    out = tmp_path / "run"
    first = train(cfg, out, device="cpu")
    resumed = resume(out, rounds=4, device="cpu")
    assert [e.round for e in resumed.ledger.entries] == [1, 2, 3, 4]
    assert resumed.ledger.entries[:3] == first.ledger.entries  # participants restored
    fresh = dataclasses.replace(first.ledger, entries=list(first.ledger.entries))
    fresh.record(4, 1, list(resumed.ledger.entries[3].participants or ()))
    assert resumed.ledger.epsilon == pytest.approx(fresh.epsilon, rel=1e-12)
    release, metrics = _released(out)
    assert len(release.ledger) == 4 and _revealing_values(release.ledger) == []
    assert len(metrics) == 4 and _revealing_values(metrics) == []
    # the released ledger shortened, or the private one: both refused
    saved = (out / CHECKPOINT).read_bytes()
    edit_checkpoint(out / CHECKPOINT, ledger=lambda entries: entries[:-1])
    with pytest.raises(CheckpointError, match="private state"):
        resume(out, rounds=5, device="cpu")
    (out / CHECKPOINT).write_bytes(saved)
    edit_checkpoint(out / PRIVATE, PRIVATE_FORMAT, ledger=lambda entries: entries[:-1])
    with pytest.raises(CheckpointError, match="does not match the released"):
        resume(out, rounds=5, device="cpu")


def test_audit_states_the_same_claim_from_a_withheld_release(tmp_path):
    out = tmp_path / "run"
    result = train(_cfg(**HIDDEN_RUNS["record-level hidden-selection"]), out, device="cpu")
    release = ModelRelease.load(out / CHECKPOINT)
    private = PrivateRunState.load(out / PRIVATE)
    claim = privacy_claim(release.privacy, release.ledger, private.ledger_digest)
    assert claim.epsilon == pytest.approx(result.summary.privacy.epsilon, rel=1e-12)
    assert claim.threat_model == "hidden-selection" and claim.rounds == 3
    assert claim.stored_matches
    report = run_audit(out / CHECKPOINT, seed=0).to_json()
    assert report["privacy"]["epsilon"] == pytest.approx(result.ledger.epsilon, rel=1e-12)


def test_a_run_written_before_withholding_resumes_and_is_then_withheld(tmp_path):
    """A hidden-selection run folder of the previous layout (full ledger in ckpt.pt, its
    fingerprint in private.pt, no private copy) resumes; its next release withholds."""
    from fedlap_privacy.state.ledger import ledger_digest

    out = tmp_path / "run"
    first = train(_cfg(**HIDDEN_RUNS["record-level hidden-selection"]), out, device="cpu")
    full = [e.to_dict() for e in first.ledger.entries]
    history = PrivateRunState.load(out / PRIVATE).history
    edit_checkpoint(out / CHECKPOINT, ledger=lambda _: full, history=lambda _: history)
    edit_checkpoint(out / PRIVATE, PRIVATE_FORMAT, ledger=lambda _: [], history=lambda _: [],
          ledger_digest=lambda _: ledger_digest(first.ledger.entries))
    resumed = resume(out, rounds=4, device="cpu")
    assert resumed.ledger.entries[:3] == first.ledger.entries
    release, metrics = _released(out)
    assert len(release.ledger) == 4 and _revealing_values(release.ledger) == []
    assert _revealing_values(metrics) == []
