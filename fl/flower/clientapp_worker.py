"""A long-lived ClientApp process beside a SuperNode in Flower's ``process`` isolation.

Contract: ``python -m fedlap_privacy.fl.flower.clientapp_worker --runtime-api ADDRESS
--supernode-pid PID`` serves one ``flower-supernode --isolation process``: it claims the
node's next ClientApp task from the SuperNode's Runtime API (``AcquireTask``: ``--poll``
seconds after a task, doubling up to a second while idle), pulls its message and the node's
context, runs this package's ClientApp (:mod:`.client_app`) in this process, pushes the
reply and the updated context (the node-local state) and waits for the next task; it exits
when the SuperNode's process is
gone. The messages, the context and the ClientApp are those of Flower's own per-task
``flwr-clientapp``, which Flower 1.41 starts as a new process for every message (its
subprocess isolation, through ``flower-superexec``): what this process saves, every round
and every node, is a Python start-up, the imports of torch and this package, the FAB's
installation and the node's data read again (:func:`.partition.load_partition` keeps the
simulated split of the last run in memory). It runs this package's ClientApp only: a run
whose Flower App names another ``clientapp`` gets an error reply, as a ClientApp that cannot
be loaded does. A ClientApp that raises gets Flower's error reply (the server fails the
round with its reason); the process stays up for the next task. On SIGTERM an idle process
exits at once (``os._exit``: no task in flight, nothing to write; the interpreter's own
clean-up of torch took seconds on a loaded machine), a busy one as a Python program does.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable

from flwr.app import Message
from flwr.app.error import Error
from flwr.common.config import get_fab_config
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # type: ignore[attr-defined]
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
from flwr.supercore.interceptors.http.runtime_token import RuntimeTokenHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import (
    pull_task_input,
    push_message,
    push_task_output,
)

from fedlap_privacy.fl.flower.client_app import client_app
from fedlap_privacy.fl.flower.run_config import CLIENT_APP_REF

__all__ = ["alive", "claim_tasks", "main", "run_task", "runtime_client", "serve"]

#: seconds between two claims of a task right after a task; doubled while the node stays
#: idle, up to :data:`MAX_POLL` (a SuperNode itself pulls from the SuperLink every 3 s)
DEFAULT_POLL = 0.1
MAX_POLL = 1.0


def runtime_client(address: str, component: str, token: str | None = None,
                   root_certificates: bytes | None = None) -> RuntimeHttpClient:
    """A client of a Runtime API (a SuperNode's, or a SuperLink's with ``root_certificates``
    for TLS) as Flower's own ``component`` makes it."""
    interceptors = [RuntimeVersionHttpInterceptor(component_name=component)]
    if token is not None:
        interceptors.append(RuntimeTokenHttpInterceptor(token))  # type: ignore[arg-type]
    return RuntimeHttpClient.from_server_address(
        server_address=address, insecure=root_certificates is None,
        root_certificates=root_certificates, interceptors=interceptors,
        retry_invoker=make_simple_http_retry_invoker())


def _app_of(fab_content: bytes) -> str:
    """The ``clientapp`` the run's Flower App names."""
    config = get_fab_config(fab_content)
    return str(config["tool"]["flwr"]["app"]["components"]["clientapp"])


def run_task(address: str, token: str) -> str:
    """Run the task of ``token`` as ``flwr-clientapp`` would, in this process; returns its
    final status (``completed`` or ``failed``)."""
    client = runtime_client(address, "flwr-clientapp", token)
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = reply = context = None
    status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
    try:
        message, context, _run, fab = pull_task_input(client)
        named = _app_of(fab.content)
        if named != CLIENT_APP_REF:
            reply = Message(Error(code=ErrorCode.LOAD_CLIENT_APP_EXCEPTION, reason=(
                f"this SuperNode's ClientApp process runs {CLIENT_APP_REF} only, the run "
                f"names {named}")), reply_to=message)
            details = "another ClientApp"
        else:
            reply = client_app(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
    except Exception as exc:  # as flwr-clientapp: an error reply, the node goes on
        details = f"{type(exc)}:<'{exc}'>"
        print(f"[fedlap-privacy] ClientApp raised: {details}", file=sys.stderr, flush=True)
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details),
                            reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
            push_task_output(client, context, status, details)
        finally:
            heartbeat.stop()
            client.close()
    return str(status)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: whether a task is running in this process (SIGTERM: exit at once when not)
_BUSY = [False]


def _on_term(*_: object) -> None:
    if not _BUSY[0]:
        os._exit(0)
    sys.exit(0)


def claim_tasks(acquirer: RuntimeHttpClient, task_type: str, keep_going: Callable[[], bool],
                run: Callable[[str], object], poll: float = DEFAULT_POLL) -> None:
    """Claim tasks of ``task_type`` from a Runtime API and ``run(token)`` each, while
    ``keep_going()``; ``poll`` seconds after a task, doubling up to :data:`MAX_POLL` while
    idle (each claim is an HTTP request: on a shared machine a fixed fast poll costs CPU)."""
    request = AcquireTaskRequest(supported_task_types=[task_type])
    wait = poll
    try:
        while keep_going():
            try:
                res = acquirer.AcquireTask(request)
            except Exception:  # the Runtime API is not up yet, or going away
                time.sleep(max(wait, 0.2))
                continue
            if res.HasField("task") and res.token:
                run(res.token)
                wait = poll
            else:
                time.sleep(wait)
                wait = min(2 * wait, max(MAX_POLL, poll))
    finally:
        acquirer.close()


def serve(address: str, supernode_pid: int | None = None, poll: float = DEFAULT_POLL) -> None:
    """Claim and run the SuperNode's ClientApp tasks until its process is gone
    (:func:`claim_tasks`)."""

    def run(token: str) -> None:
        _BUSY[0] = True
        try:
            run_task(address, token)
        finally:
            _BUSY[0] = False

    claim_tasks(runtime_client(address, "SuperExec"), TaskType.CLIENT_APP.value,
                lambda: supernode_pid is None or alive(supernode_pid), run, poll)


def main(argv: list[str] | None = None) -> None:
    """The command line of :func:`serve` (started by :class:`.deployment.LocalDeployment`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-api", required=True, help="the SuperNode's HOST:PORT")
    parser.add_argument("--supernode-pid", type=int, default=None)
    parser.add_argument("--poll", type=float, default=DEFAULT_POLL)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    try:
        serve(args.runtime_api, args.supernode_pid, args.poll)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
