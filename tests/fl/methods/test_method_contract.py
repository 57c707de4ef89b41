"""The contract every method of the method table must keep (one test, every row).

A new method is one module and one row; this test then checks it like every other:
its configuration validates, a client round touches private data no more often than the
round is accounted for, its reply's size is what ``upload_bytes`` reports, its node-local
and server states survive a checkpoint and a Flower message unchanged, and the server step
folds the replies into the model.
"""

from __future__ import annotations

import pytest
import torch
from helpers import METHOD_EXTRAS, tiny

from fedlap_privacy.data.datasets import load_dataset
from fedlap_privacy.fl.engine.simulation import client_parts, default_model_config
from fedlap_privacy.fl.methods.interface import Method, build_method
from fedlap_privacy.fl.methods.method_table import METHOD_TABLE
from fedlap_privacy.fl.run.privacy import build_ledger, with_planned_sigma
from fedlap_privacy.fl.run.randomness import seeded_generator
from fedlap_privacy.models import build_model
from fedlap_privacy.state.checkpoint import load_checkpoint, save_checkpoint


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("name", sorted(METHOD_TABLE))
def test_every_method_keeps_the_contract(name: str, tmp_path) -> None:
    spec = METHOD_TABLE[name]
    cfg = tiny(**{"method": name, "rounds": 2, **METHOD_EXTRAS.get(name, {})})
    data = load_dataset(cfg.dataset)
    parts = client_parts(cfg, data)
    cfg = with_planned_sigma(cfg.validate(), [len(p) for p in parts])
    assert cfg.notion == spec.notion and cfg.private == spec.private
    ledger = build_ledger(cfg, [len(p) for p in parts])
    torch.manual_seed(0)
    model = build_model(default_model_config(cfg, data))
    method = build_method(cfg, torch.device("cpu"))
    assert isinstance(method, Method) and method.cfg is cfg
    server_state = method.init_server_state(model, ledger)
    info = method.round_info(1, server_state)
    replies, states = [], []
    for k in (0, 1):
        x = torch.from_numpy(data.x_train[parts[k]])
        y = torch.from_numpy(data.y_train[parts[k]])
        state: dict = {}
        reply = method.client(model, x, y, state, info, seeded_generator(torch.device("cpu"), k))
        assert 0 <= reply.accesses <= method.accounted_steps(server_state) <= cfg.accesses_per_round
        assert reply.num_examples == len(y)
        payload = sum(t.numel() * t.element_size() for t in reply.payload.values())
        assert reply.upload_bytes == payload + 8 * len(reply.stats) > 0
        replies.append(reply)
        states.append(state)
    before = [p.detach().clone() for p in model.parameters()]
    method.aggregate(model, replies, server_state, info, seeded_generator(torch.device("cpu"), 9))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # node-local and server state: plain data, through a checkpoint and a Flower message
    save_checkpoint(tmp_path / "state.pt", {"clients": states, "server": server_state})
    loaded = load_checkpoint(tmp_path / "state.pt")
    assert _same(loaded["clients"], states) and _same(loaded["server"], server_state)
    pytest.importorskip("flwr")
    from fedlap_privacy.fl.flower.codec import decode_state, encode_state

    assert _same(decode_state(*encode_state(states)), states)
