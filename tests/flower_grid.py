"""Test helpers for the Flower driver: Flower's Grid in-process, calling the real ClientApp.

A test module that uses :class:`FakeGrid` imports the autouse fixture ``task_identity`` too.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, Error, Message, RecordDict

from fedlap_privacy.fl.config_rules import METHODS
from fedlap_privacy.fl.engine.flower_app import client_app
from fedlap_privacy.fl.flower.run_config import toml_table

#: a node that trusts the server: any method, seeded noise allowed (the tests that compare
#: the driver with the simulator bit for bit need both)
TRUSTING = {"threat-model": "trusted-server", "allowed-methods": ",".join(METHODS),
            "allow-reproducible-noise": True}


def write_policy(path: Path, **values: Any) -> Path:
    """A node policy TOML file (keys in snake case here, kebab case in the file)."""
    path.write_text(toml_table({k.replace("_", "-"): v for k, v in values.items()}))
    return path


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    """Messages built in this process (the ServerApp's, in the fake tests) need the identity
    Flower's runtime gives a ServerApp process."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


class FakeGrid:
    """Flower's Grid in-process: each node answers with the real ClientApp and its Context.

    Node 100 + i holds partition ``partitions[i]``, with its own state folder (its ledger)
    and node config ``TRUSTING`` updated with ``node_config``.
    ``silent[node] = m``: from round m on the node never answers (a dead machine);
    ``unavailable[node] = m``: the SuperLink answers for it with Flower's node-unavailable
    error (what it does once the node's heartbeats stop).
    """

    def __init__(self, clients: int, partitions: list[int] | None = None,
                 node_config: dict[str, Any] | None = None, run_id: int = 1) -> None:
        parts = list(range(clients)) if partitions is None else partitions
        self._tmp = tempfile.TemporaryDirectory(prefix="fedlap-fake-nodes-")
        self.state_root = Path(self._tmp.name)
        self.contexts = {
            100 + i: Context(run_id=run_id, node_id=100 + i, node_config={
                "partition-id": k, "num-partitions": clients, "device": "cpu",
                "state-dir": str(self.state_root / f"node-{i}"),
                **TRUSTING, **(node_config or {})},
                state=RecordDict(), run_config={})
            for i, k in enumerate(parts)
        }
        self.silent: dict[int, int] = {}
        self.unavailable: dict[int, int] = {}
        self.replies: dict[str, Message] = {}
        self.sent: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: list[Message]) -> list[str]:
        ids = []
        for msg in messages:
            mid = f"m{len(self.sent)}"
            msg.metadata.__dict__["_message_id"] = mid
            self.sent.append(msg)
            ids.append(mid)
            node = msg.metadata.dst_node_id
            m = int(msg.metadata.group_id or 0)
            if m and m >= self.silent.get(node, 10**9):
                continue
            if m and m >= self.unavailable.get(node, 10**9):
                self.replies[mid] = Message(Error(code=1, reason="node_unavail"), reply_to=msg)
                continue
            self.replies[mid] = client_app(msg, self.contexts[node])
        return ids

    def pull_messages(self, ids: list[str]) -> list[Message]:
        return [self.replies.pop(i) for i in ids if i in self.replies]
