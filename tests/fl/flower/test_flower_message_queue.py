"""The Simulation Engine's single pass over waiting messages (:mod:`fl.flower.message_queue`):
the same messages reach the virtual nodes as with Flower's own per-node walk, each message
checked once per pass rather than once per node."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from queue import Queue

import pytest

pytest.importorskip("flwr")

from fedlap_privacy.fl.flower.message_queue import (
    deliver_once,
    deliver_waiting,
    one_pass_delivery,
)


@dataclass
class _Meta:
    dst_node_id: int
    expired: bool = False
    delivered_at: str = ""


@dataclass
class _Msg:
    metadata: _Meta


class _State:
    """What the pass reads of Flower's InMemoryLinkState; counts the checks it asks for."""

    def __init__(self, msgs: dict[str, _Msg]) -> None:
        self.lock = threading.RLock()
        self.message_ins_store = msgs
        self.checked = 0

    def _check_stored_messages(self, ids: set[str]) -> None:
        with self.lock:
            self.checked += len(ids)
            for i in ids:
                if self.message_ins_store[i].metadata.expired:
                    del self.message_ins_store[i]


def test_one_pass_queues_one_waiting_message_per_node_and_checks_each_once():
    msgs = {"a": _Msg(_Meta(1)), "b": _Msg(_Meta(2)), "c": _Msg(_Meta(1)),
            "d": _Msg(_Meta(3, expired=True)), "e": _Msg(_Meta(4, delivered_at="t")),
            "f": _Msg(_Meta(99))}  # 99: not a virtual node of this run
    state, queue = _State(msgs), Queue()
    assert deliver_once(state, queue, {1, 2, 3, 4}) == 2
    assert [queue.get_nowait() for _ in range(2)] == [msgs["a"], msgs["b"]]
    assert state.checked == 6  # each of the 6 stored messages once, not once per node
    assert "d" not in state.message_ins_store  # expired: dropped, never delivered
    assert msgs["a"].metadata.delivered_at and msgs["b"].metadata.delivered_at
    assert msgs["c"].metadata.delivered_at == ""  # node 1's second message: next pass
    assert deliver_once(state, queue, {1, 2, 3, 4}) == 1 and queue.get_nowait() is msgs["c"]
    assert deliver_once(state, queue, {1, 2, 3, 4}) == 0 and queue.empty()


def test_the_loop_stops_and_a_state_without_the_fields_gets_flowers_own():
    state, queue, stop = _State({"a": _Msg(_Meta(7))}), Queue(), threading.Event()
    worker = threading.Thread(target=deliver_waiting, args=(state, queue, {7: 0}, stop))
    worker.start()
    assert queue.get(timeout=5).metadata.dst_node_id == 7
    stop.set()
    worker.join(timeout=5)
    assert not worker.is_alive()

    calls = []
    with one_pass_delivery():
        from fedlap_privacy.fl.flower import message_queue

        message_queue._FLOWER[:] = [lambda *args: calls.append(args)]
        deliver_waiting(object(), queue, {7: 0}, stop)
    assert len(calls) == 1


def test_flower_1_41_is_patched_while_open_and_restored_after():
    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    original = vce_api.add_messages_to_queue
    with one_pass_delivery():
        assert vce_api.add_messages_to_queue is deliver_waiting
    assert vce_api.add_messages_to_queue is original
    # the fields the pass reads are Flower's own (a Flower without them keeps its own walk)
    assert callable(InMemoryLinkState._check_stored_messages)
    import inspect

    init = inspect.getsource(InMemoryLinkState.__init__)
    assert "self.message_ins_store" in init and "self.lock" in init
