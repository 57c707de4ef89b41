"""The Simulation Engine's hand-over of the ServerApp's messages to its virtual nodes, in
one pass over the waiting messages instead of one pass per node.

Contract: :func:`one_pass_delivery` is a context manager that, while it is open, replaces
Flower 1.41's ``add_messages_to_queue`` (``flwr.server.superlink.fleet.vce.vce_api``: the
thread that moves each message the ServerApp pushed into the Simulation Engine's queue of
work for its Ray actors) by :func:`deliver_waiting`, with the same outcome: every message
still in Flower's link state, not delivered, not expired and addressed to a virtual node, is
marked delivered and queued, at most one per node per pass, a pass every 0.1 s. Flower's own
thread asks the link state once per virtual node and every such ask walks all the stored
messages (and checks each one's TTL and federation again): with N virtual nodes and M
messages waiting that is N * M checks every 0.1 s, quadratic at discovery (M = N: every node
is queried) and N * cohort in every round, all under the link state's lock and Python's GIL
that the ServerApp shares. This pass walks the M messages once and checks each once
(Flower's ``_check_stored_messages``: expired or out-of-federation messages are dropped, as
Flower's own pass drops them).

It relies on :class:`flwr.server.superlink.linkstate.InMemoryLinkState`'s ``lock``,
``message_ins_store`` and ``_check_stored_messages``; on another link state or a Flower
without them, Flower's own thread is left in place (same results, slower).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from queue import Queue
from typing import Any

__all__ = ["deliver_once", "deliver_waiting", "one_pass_delivery"]

_PASS = 0.1  # seconds between two passes (Flower's own interval)
_NEEDS = ("lock", "message_ins_store", "_check_stored_messages")


def _supported(state: Any) -> bool:
    return all(hasattr(state, name) for name in _NEEDS)


def deliver_once(state: Any, queue: Queue[Any], nodes: set[int]) -> int:
    """One pass: queue the waiting messages (at most one per node, in the order they were
    pushed), mark them delivered; returns how many were queued."""
    from flwr.supercore.date import now

    with state.lock:
        ids = list(state.message_ins_store)
        state._check_stored_messages(set(ids))  # drops expired / out-of-federation ones
        store = state.message_ins_store
        taken: list[Any] = []
        seen: set[int] = set()
        for msg_id in ids:
            msg = store.get(msg_id)
            if msg is None or msg.metadata.delivered_at != "":
                continue
            node = msg.metadata.dst_node_id
            if node in nodes and node not in seen:
                seen.add(node)
                taken.append(msg)
        delivered_at = now().isoformat()
        for msg in taken:
            msg.metadata.delivered_at = delivered_at
    for msg in taken:
        queue.put(msg)
    return len(taken)


def deliver_waiting(state: Any, queue: Queue[Any], nodes_mapping: dict[int, int],
                    f_stop: threading.Event) -> None:
    """Flower's ``add_messages_to_queue`` in one pass over the waiting messages (module
    docstring); Flower's own loop when ``state`` lacks what the pass reads."""
    if not _supported(state):
        _FLOWER[0](state, queue, nodes_mapping, f_stop)
        return
    nodes = set(nodes_mapping)
    while not f_stop.is_set():
        deliver_once(state, queue, nodes)
        f_stop.wait(_PASS)


#: Flower's own ``add_messages_to_queue`` while :func:`one_pass_delivery` is open
_FLOWER: list[Any] = []


@contextlib.contextmanager
def one_pass_delivery() -> Iterator[None]:
    """:func:`deliver_waiting` in place of Flower's ``add_messages_to_queue`` while open
    (module docstring); nothing is replaced where Flower has no such function."""
    try:
        from flwr.server.superlink.fleet.vce import vce_api
    except ImportError:  # pragma: no cover - another Flower layout
        yield
        return
    original = getattr(vce_api, "add_messages_to_queue", None)
    if original is None or original is deliver_waiting:  # pragma: no cover
        yield
        return
    _FLOWER[:] = [original]
    vce_api.add_messages_to_queue = deliver_waiting
    try:
        yield
    finally:
        vce_api.add_messages_to_queue = original
