"""Secure aggregation over Flower messages (fl/flower/secure_node.py, issue 59): the real
ServerApp logic (:class:`FlowerClients`) and the real ClientApp through Flower's Grid
in-process (:class:`FakeGrid`), every message the server receives recorded."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

flwr = pytest.importorskip("flwr")

from flower_grid import FakeGrid, task_identity  # noqa: E402, F401
from flwr.app import ConfigRecord, Message, RecordDict  # noqa: E402

from fedlap_privacy.fl.config import TrainConfig  # noqa: E402
from fedlap_privacy.fl.engine.flower_app import (  # noqa: E402
    ClientFailure,
    FlowerClients,
    expected_partitions,
)
from fedlap_privacy.fl.engine.simulation import train  # noqa: E402
from fedlap_privacy.fl.flower import secure_node  # noqa: E402
from fedlap_privacy.fl.flower.secure_node import UNMASK, UPLOAD_RECORD, raw_public_key  # noqa: E402
from fedlap_privacy.fl.secure_sum.masking import SecureSumServer  # noqa: E402
from fedlap_privacy.fl.secure_sum.training import SecurePlan  # noqa: E402
from fedlap_privacy.state.secure_rounds import REFUSED  # noqa: E402


class RecordingGrid(FakeGrid):
    """The in-process Grid, keeping every reply the server pulls."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.received: list[Message] = []

    def pull_messages(self, ids: list[str]) -> list[Message]:
        got = super().pull_messages(ids)
        self.received.extend(got)
        return got


def _cfg(**kw) -> TrainConfig:
    base = dict(method="dp-fedavg-client", clients=4, rounds=2, sigma=1.0, split="iid",
                split_seed=0,
                local_steps=2, lr_local=0.1, width=8, secure_aggregation="skellam")
    return TrainConfig(**{**base, **kw}).validate()


def _driver(grid: FakeGrid, cfg: TrainConfig, **kw) -> FlowerClients:
    clients = FlowerClients(grid, node_wait=5.0, log=lambda line: None, **kw)  # type: ignore[arg-type]
    clients.discover(cfg, expected_partitions(cfg))
    return clients


def test_the_server_receives_only_masked_uploads_and_unmasks_their_sum(tmp_path, monkeypatch):
    cfg = _cfg()
    encoded: list[np.ndarray] = []  # each node's noisy share, before its masks
    sums: list[np.ndarray] = []
    real_encode, real_unmask = secure_node.encode, SecureSumServer.unmask

    def spy_encode(update, spec, **kw):
        encoded.append(share := real_encode(update, spec, **kw))
        return share

    def spy_unmask(server, reveal):
        sums.append(total := real_unmask(server, reveal))
        return total

    monkeypatch.setattr(secure_node, "encode", spy_encode)
    monkeypatch.setattr(SecureSumServer, "unmask", spy_unmask)
    grid = RecordingGrid(4)
    flower = train(cfg, tmp_path / "flower", "cpu", ask_clients=_driver(grid, cfg))
    assert len(encoded) == 8 and len(sums) == 2  # 4 clients x 2 rounds, one sum a round
    uploads = [np.frombuffer(bytes(m.content.config_records[UPLOAD_RECORD]["masked"]), "<u8")
               for m in grid.received if UPLOAD_RECORD in m.content.config_records]
    assert len(uploads) == 8
    for m in grid.received:  # no update in the clear, in any message the server received
        assert not any(name.startswith("payload") for name in m.content.array_records)
        assert not any(name.startswith("payload") for name in m.content.config_records)
    modulus = 1 << flower.ledger.entries[0].secure.bits
    for upload in uploads:
        for share in encoded:
            assert np.mean(upload == share) < 0.01  # uniform mod 2^b: no coordinate kept
    for r in range(2):
        expected = np.zeros_like(encoded[0])
        for share in encoded[4 * r:4 * r + 4]:
            expected = (expected + share) % np.uint64(modulus)
        np.testing.assert_array_equal(sums[r], expected)  # the masks cancel, nothing else
    assert [e.status for e in flower.ledger.entries] == ["completed", "completed"]
    # the same privacy as the run in process: every share arrived in both
    local = train(cfg, None, "cpu")
    assert flower.ledger.server_epsilon() == pytest.approx(local.ledger.server_epsilon(),
                                                           rel=1e-12)


def test_a_dropped_client_leaves_a_correct_sum_and_too_few_refuse_the_round(tmp_path):
    cfg = _cfg(min_survivors=3)
    grid = FakeGrid(4)
    grid.silent[103] = 2  # from round 2 on, node 103 never answers
    run = train(cfg, tmp_path / "one", "cpu",
                ask_clients=_driver(grid, cfg, round_timeout=1.0, allow_failures=True))
    entries = run.ledger.entries
    assert [e.status for e in entries] == ["completed", "completed"]
    assert [e.secure.received for e in entries] == [4, 3]
    grid = FakeGrid(4)
    grid.silent.update({102: 2, 103: 2})  # two of four: below min_survivors 3
    run = train(cfg, tmp_path / "two", "cpu",
                ask_clients=_driver(grid, cfg, round_timeout=1.0, allow_failures=True))
    assert [e.status for e in run.ledger.entries] == ["completed", REFUSED]
    assert run.ledger.server_epsilon() == pytest.approx(
        train(_cfg(rounds=1, min_survivors=3), None, "cpu").ledger.server_epsilon(),
        rel=1e-12)  # the refused round spends nothing


def test_a_node_answers_one_survivor_set_per_round_and_checks_its_key(tmp_path):
    cfg = _cfg(rounds=1, min_survivors=3)
    grid = RecordingGrid(4)
    train(cfg, tmp_path / "r", "cpu", ask_clients=_driver(grid, cfg))

    def unmask(survivors: list[int]) -> Message:
        request = RecordDict({"unmask": ConfigRecord({"round": 1, "survivors": survivors})})
        (mid,) = grid.push_messages([Message(request, 100, f"query.{UNMASK}", group_id="1")])
        return grid.pull_messages([mid])[0]

    same = unmask([0, 1, 2, 3])  # the set it answered in the round: answered again
    assert "unmask" in same.content.config_records
    other = unmask([0, 1, 2])  # client 3 named dropped to client 0 only: refused
    assert "another survivor set" in str(other.content.config_records["refusal"]["reason"])
    few = unmask([0, 1])  # fewer than min_survivors: the node itself refuses
    assert "fewer than the round's min_survivors 3" in str(
        few.content.config_records["refusal"]["reason"])
    # a server relaying another key for a node than the node's own (to learn its pair
    # seeds), or a key without a shared secret, is refused by the nodes in one line
    for key, refused in ((raw_public_key(X25519PrivateKey.generate().public_key()),
                          "client 0 refused round 1: the server relays another public key"),
                         (bytes(32), "refused round 1: a peer's public key gives no shared")):
        clients = _driver(FakeGrid(4), cfg)
        clients.nodes[0] = dataclasses.replace(clients.nodes[0], secure_key=key)
        with pytest.raises(ClientFailure, match=refused):
            train(cfg, tmp_path / key.hex()[:8], "cpu", ask_clients=clients)


def test_each_node_charges_its_secure_rounds_against_the_server_to_its_budget(tmp_path):
    """A node under threat-model server keeps its own ledger of a secure run: each round at
    the fewest shares a released round holds (what the server's plan never exceeds), charged
    to its client-epsilon budget; a round past the budget is refused before training."""
    cfg = _cfg(min_survivors=3)
    grid = FakeGrid(4, node_config={"threat-model": "server"})
    run = train(cfg, tmp_path / "r", "cpu", ask_clients=_driver(grid, cfg))
    entries = json.loads(next((grid.state_root / "node-0").glob("run-*.json")).read_text())[
        "entries"]
    size = sum(p.numel() for p in run.model.parameters())
    plan = SecurePlan.of(cfg, size)
    assert [e["secure"]["received"] for e in entries] == [3, 3]  # min_survivors, not 4
    assert entries[-1]["secure"]["server_epsilon"] == pytest.approx(
        plan.planned_epsilon(2, cfg.delta), rel=1e-9)
    one_round = plan.planned_epsilon(1, cfg.delta)
    grid = FakeGrid(4, node_config={"threat-model": "server", "client-epsilon": 1.1 * one_round})
    with pytest.raises(ClientFailure, match=r"above the node's budget .* \(client-epsilon\)"):
        train(cfg, tmp_path / "b", "cpu", ask_clients=_driver(grid, cfg))
