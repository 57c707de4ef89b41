"""``flower-supernode`` without its idle 3 s: the SuperNodes of a local deployment.

Contract: ``python -m fedlap_privacy.fl.flower.local_supernode ARGS`` is Flower 1.41's
``flower-supernode ARGS`` (the same command line, connection, authentication, node state,
isolation and ClientApp: Flower's own code runs), with two of its waits shortened. Flower
1.41's SuperNode loop (``flwr.supernode.start_client_internal``) asks the SuperLink for a
message and, when none is waiting, sleeps a fixed 3 s (no option or environment variable
changes it); after a message it checks for the ClientApp's reply every 0.5 s. On one machine
a round therefore began up to 3 s after the server sent it (the last of five idle nodes to
wake: 2.5 s on average) and ended up to 0.5 s after the last reply was ready. Here the idle
wait is :data:`FIRST_IDLE_S` after a message, doubling while the node stays idle up to
:data:`MAX_IDLE_S`, and the reply is looked for every :data:`REPLY_CHECK_S`. Only the
``time`` that module sees and its pull function are wrapped (:func:`patch`); where the
installed Flower's loop is not the one this was written for (:func:`loop_matches`), nothing
is changed and the node runs as ``flower-supernode`` does. On several machines start
``flower-supernode`` itself, or this module for the same shortened waits.
"""

from __future__ import annotations

import inspect
import sys
import time
from types import ModuleType
from typing import Any

__all__ = ["FIRST_IDLE_S", "MAX_IDLE_S", "REPLY_CHECK_S", "NodeClock", "loop_matches",
           "main", "patch"]

#: Flower 1.41's fixed waits in ``start_client_internal``: idle, and for a reply
FLOWER_IDLE_S = 3
FLOWER_REPLY_S = 0.5
#: the idle wait right after a message; doubled while idle, up to :data:`MAX_IDLE_S`
FIRST_IDLE_S = 0.1
MAX_IDLE_S = 1.0
#: seconds between two looks for the ClientApp's reply (in the node's own state)
REPLY_CHECK_S = 0.05


class NodeClock:
    """The ``time`` module as ``start_client_internal`` sees it: its 3 s idle sleep becomes
    a backoff from :data:`FIRST_IDLE_S` to :data:`MAX_IDLE_S` (reset by :meth:`reset` when a
    message arrives), its 0.5 s reply checks :data:`REPLY_CHECK_S`; everything else is
    ``time``'s."""

    def __init__(self, sleep: Any = time.sleep) -> None:
        self._sleep = sleep
        self.idle = FIRST_IDLE_S

    def reset(self) -> None:
        self.idle = FIRST_IDLE_S

    def sleep(self, seconds: float) -> None:
        if seconds == FLOWER_IDLE_S:
            self._sleep(self.idle)
            self.idle = min(2 * self.idle, MAX_IDLE_S)
        elif seconds == FLOWER_REPLY_S:
            self._sleep(REPLY_CHECK_S)
        else:
            self._sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def loop_matches(module: ModuleType) -> bool:
    """Whether ``module`` (``flwr.supernode.start_client_internal``) has the loop this module
    was written for: the idle ``time.sleep(3)``, the reply checks ``time.sleep(0.5)``, and
    its pull function."""
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return False
    return (f"time.sleep({FLOWER_IDLE_S})" in source and f"time.sleep({FLOWER_REPLY_S})" in source
            and callable(getattr(module, "_pull_and_store_message", None))
            and getattr(module, "time", None) is time)


def patch(module: ModuleType, clock: NodeClock | None = None) -> bool:
    """Give ``module`` the :class:`NodeClock` and reset its backoff on every message pulled;
    False (``module`` unchanged) where :func:`loop_matches` says no."""
    if not loop_matches(module):
        return False
    clock = clock or NodeClock()
    pull = module._pull_and_store_message

    def pull_and_store(*args: Any, **kwargs: Any) -> Any:
        run_id = pull(*args, **kwargs)
        if run_id is not None:
            clock.reset()
        return run_id

    module._pull_and_store_message = pull_and_store  # type: ignore[attr-defined]
    module.time = clock  # type: ignore[attr-defined]
    return True


def main() -> None:
    """``flower-supernode`` with :func:`patch` applied (module docstring)."""
    import flwr.supernode.start_client_internal as loop
    from flwr.supernode.cli import flower_supernode

    if not patch(loop):
        print("[fedlap-privacy] this Flower's SuperNode loop is not the one expected: the "
              "node waits as flower-supernode does", file=sys.stderr, flush=True)
    sys.argv[0] = "flower-supernode"
    sys.exit(flower_supernode())


if __name__ == "__main__":
    main()
