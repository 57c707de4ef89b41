"""The ServerApp of a local deployment, started without importing anything.

Contract: ``python -m fedlap_privacy.fl.flower.serverapp_worker --runtime-api ADDRESS
--superlink-pid PID [--root-certificates CA]`` serves one ``flower-superlink --isolation
process`` as Flower 1.41's SuperExec serves a SuperLink in its default ``subprocess``
isolation, for ServerApp tasks only: it claims the SuperLink's next ServerApp task from its
Runtime API (``AcquireTask``: ``--poll`` seconds after a task, doubling up to a second while
idle) and runs it as ``flwr-serverapp --runtime-api-address ADDRESS --token TOKEN`` would
(Flower's own ``flwr_serverapp``: the same connection, FAB, ServerApp and run), in a child
forked from this process; it reaps its children and exits when the SuperLink's process is
gone. The child takes the machine's CPUs (``FEDLAP_WORKERS`` = 1,
:mod:`fedlap_privacy.compute.threads`): the server computes while the nodes wait.

Why: :class:`.deployment.LocalDeployment` forks this process from the node zygote
(:mod:`.node_zygote`), which imported Flower, torch and this package once; Flower's SuperExec
started a new ``flwr-serverapp`` that imported them again (about 5 CPU seconds, while the
nodes started on the same cores) and claimed tasks every 0.1 s for the whole run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

from flwr.supercore.constant import TaskType

from fedlap_privacy.compute.threads import WORKERS_ENV
from fedlap_privacy.fl.flower.clientapp_worker import (
    DEFAULT_POLL,
    alive,
    claim_tasks,
    runtime_client,
)
from fedlap_privacy.fl.flower.node_zygote import exit_with

__all__ = ["SERVER_ENV", "main", "serve", "serverapp_args"]

#: the ServerApp's environment over the nodes' (which the zygote has): one worker, so that its
#: torch threads take the machine's CPUs (following the load) while the nodes wait
SERVER_ENV = {WORKERS_ENV: "1"}


def serverapp_args(address: str, token: str, root_certificates: str | None) -> list[str]:
    """The command line ``flwr-serverapp`` gets from Flower's SuperExec for this task."""
    tls = ["--insecure"] if root_certificates is None else [
        "--root-certificates", root_certificates]
    return ["--runtime-api-address", address, "--token", token, *tls]


def _run_serverapp(args: list[str]) -> None:
    """In the forked child: Flower's ``flwr-serverapp`` with ``args``."""
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.update(SERVER_ENV)
    from flwr.superlink.cli.flwr_serverapp import flwr_serverapp

    sys.argv = ["flwr-serverapp", *args]
    flwr_serverapp()


def _reap(children: set[int]) -> None:
    for pid in list(children):
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                continue
        children.discard(pid)


def serve(address: str, superlink_pid: int, root_certificates: str | None = None,
          poll: float = DEFAULT_POLL) -> None:
    """Claim and run the SuperLink's ServerApp tasks until its process is gone (module
    docstring; :func:`.clientapp_worker.claim_tasks`)."""
    certificates = None if root_certificates is None else Path(root_certificates).read_bytes()
    children: set[int] = set()

    def keep_going() -> bool:
        _reap(children)
        return alive(superlink_pid)

    def run(token: str) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            exit_with(lambda: _run_serverapp(serverapp_args(address, token, root_certificates)))
        children.add(pid)

    claim_tasks(runtime_client(address, "SuperExec", root_certificates=certificates),
                TaskType.SERVER_APP.value, keep_going, run, poll)


def main(argv: list[str] | None = None) -> None:
    """The command line of :func:`serve` (started by :class:`.deployment.LocalDeployment`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-api", required=True, help="the SuperLink's HOST:PORT")
    parser.add_argument("--superlink-pid", type=int, required=True)
    parser.add_argument("--root-certificates", default=None, help="the SuperLink's CA (TLS)")
    parser.add_argument("--poll", type=float, default=DEFAULT_POLL)
    args = parser.parse_args(argv)
    try:
        serve(args.runtime_api, args.superlink_pid, args.root_certificates, args.poll)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
