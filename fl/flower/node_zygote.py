"""The node processes of a local deployment, forked from one that imported everything once.

Contract: ``python -m fedlap_privacy.fl.flower.node_zygote`` (the zygote) imports what a
SuperNode (:mod:`.local_supernode`), its ClientApp process (:mod:`.clientapp_worker`: torch,
Flower and this package) and the ServerApp (:mod:`.serverapp_worker`) import, then serves
requests on its standard input, one JSON object a line: ``{"id": N, "module": NAME, "args":
[...], "log": PATH}``, NAME one of :data:`ENTRY_POINTS` (nothing else is run). For each it
forks a child that starts its own session, writes its output to PATH, draws fresh randomness
(Python's, numpy's and torch's global generators; the DP noise is seeded from the operating
system on use anyway, :mod:`fedlap_privacy.fl.run.randomness`) and runs NAME's ``main()`` with
``args`` as ``python -m NAME ARGS`` would; it answers ``started N PID`` (or ``failed N
REASON``) on its standard output, reaps its children and reports each as ``exited PID CODE``.
When its standard input closes (the launcher is done, or died: killed, it stops nothing
itself) it stops every child still running and what they started (TERM, then KILL,
:func:`.processes.stop_descendants`), then exits.

Why: every process of a local deployment used to import Flower, torch and this package
itself: five SuperNodes and five ClientApp processes at once, about 40 CPU seconds of a
5-client run's start-up on 2 cores (docs/performance.md). Forked, they share the zygote's
imported modules copy-on-write; torch has run no parallel region in the zygote, so each
child starts its own threads (:mod:`fedlap_privacy.compute.threads`).

:class:`Zygote` is the launcher's side: it starts the zygote with the nodes' environment and
gives each child as a :class:`ForkedProcess` (``pid``, ``poll``, ``wait``, ``returncode``, as
:class:`subprocess.Popen` has them, for :mod:`.processes`).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, NoReturn

from fedlap_privacy.fl.flower.processes import stop_descendants

__all__ = ["ENTRY_POINTS", "ForkedProcess", "Zygote", "ZygoteError", "exit_with", "main"]

#: the modules a child may run (their ``main()``), and nothing else
ENTRY_POINTS = (
    "fedlap_privacy.fl.flower.node_zygote",  # probe(): a child reports its randomness
    "fedlap_privacy.fl.flower.local_supernode",
    "fedlap_privacy.fl.flower.clientapp_worker",
    "fedlap_privacy.fl.flower.serverapp_worker",
)
#: this module's name (``__name__`` is ``__main__`` in the zygote)
_SELF = ENTRY_POINTS[0]
#: modules a node or the ServerApp imports on its first task, imported by the zygote too
#: (torch imports its ``_dynamo``, with sympy, on a client round's first step: 1.6 s a
#: process)
_PRELOAD = ("sklearn.datasets", "torch._dynamo", "flwr.superlink.cli.flwr_serverapp",
            "fedlap_privacy.fl.flower.server_app", "fedlap_privacy.fl.methods.fedlap",
            "fedlap_privacy.fl.methods.fedavg", "fedlap_privacy.fl.methods.dp")
#: seconds the zygote's select waits before it looks for exited children again
_REAP_S = 0.2
#: seconds the children still running when the launcher is gone get to exit on SIGTERM
_ORPHAN_GRACE_S = 2.0


class ZygoteError(RuntimeError):
    """The zygote could not start a process (its reason, one line)."""


# ------------------------------------------------------------------------------ the zygote
def _entry(name: str) -> Any:
    import importlib

    module = importlib.import_module(name)
    return module.probe if name == _SELF else module.main


def _reseed() -> None:
    """Fresh global randomness in a child (Python's ``random`` is reseeded by fork itself)."""
    import numpy as np
    import torch

    np.random.seed()  # noqa: NPY002 - the legacy global generator is the one reseeded
    torch.seed()


def exit_with(main: Callable[[], object]) -> NoReturn:
    """Run ``main`` as the interpreter runs a program (its ``SystemExit`` code, else 0; a
    traceback and 1 on any other exception) and end this forked process with that code, at
    once (``os._exit``: the parent's clean-up is not the child's)."""
    code = 1
    try:
        main()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # as the interpreter would: the traceback into the log
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _child(name: str, args: list[str], log: str) -> None:
    """In the forked child: its own session, output and randomness; then ``name``'s entry."""
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    _reseed()
    sys.argv = [name, *args]
    _entry(name)()


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(f"exited {pid} {os.waitstatus_to_exitcode(status)}")


def _fork(request: dict[str, Any]) -> None:
    ident = int(request["id"])
    name, args, log = request["module"], request["args"], request["log"]
    if name not in ENTRY_POINTS or not isinstance(args, list) or not all(
            isinstance(a, str) for a in args) or not isinstance(log, str):
        _say(f"failed {ident} not a node process: {str(name)[:80]}")
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        exit_with(lambda: _child(name, args, log))
    _say(f"started {ident} {pid}")


def main() -> None:
    """The zygote (module docstring)."""
    import importlib

    from fedlap_privacy.compute.runtime_env import apply_runtime_defaults

    apply_runtime_defaults()  # before torch loads (the launcher's environment may lack it)
    for name in (*ENTRY_POINTS, *_PRELOAD):
        importlib.import_module(name)
    buffer = b""
    while True:
        readable, _, _ = select.select([0], [], [], _REAP_S)
        _reap()
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:  # the launcher closed our input (it is done, or died): no children
            stop_descendants(_ORPHAN_GRACE_S)  # are left running without it
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            try:
                request = json.loads(line)
                _fork(request)
            except (ValueError, KeyError, TypeError) as exc:
                _say(f"failed -1 bad request: {type(exc).__name__}")


def probe() -> None:
    """A child that prints its pid and one draw of each global generator, then exits (the
    tests' check that forked nodes do not share randomness)."""
    import random

    import numpy as np
    import torch

    draws = {"pid": os.getpid(), "random": random.random(),
             "numpy": float(np.random.random()),  # noqa: NPY002 - the global generator
             "torch": float(torch.rand(1))}
    print(json.dumps(draws), flush=True)


# --------------------------------------------------------------------------- the launcher
class ForkedProcess:
    """A child of the zygote, as :mod:`.processes` handles a :class:`subprocess.Popen`."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The launcher's side of the zygote: started with ``env`` in ``cwd``, its own output in
    ``log``; :meth:`spawn` forks a node process (waiting up to ``timeout`` s for the zygote's
    imports on the first call)."""

    def __init__(self, env: dict[str, str], cwd: Path, log: IO[bytes],
                 timeout: float = 180.0) -> None:
        self.timeout = timeout
        self.proc = subprocess.Popen([sys.executable, "-m", _SELF], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, env=env, cwd=cwd,
                                     start_new_session=True)
        self._lock = threading.Condition()
        self._started: dict[int, str] = {}  # request id -> "PID" or "failed REASON"
        self._exits: dict[int, int] = {}
        self._next = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            word, _, rest = raw.decode(errors="replace").strip().partition(" ")
            with self._lock:
                if word == "started":
                    ident, pid = rest.split()
                    self._started[int(ident)] = pid
                elif word == "failed":
                    ident, _, reason = rest.partition(" ")
                    self._started[int(ident)] = "failed " + reason
                elif word == "exited":
                    pid, code = rest.split()
                    self._exits[int(pid)] = int(code)
                self._lock.notify_all()
        with self._lock:
            self._lock.notify_all()

    def exit_code(self, pid: int) -> int | None:
        """The exit code of child ``pid`` once the zygote reaped it; -9 when the zygote is
        gone and the child too (no one left to say how it ended), else None."""
        with self._lock:
            if pid in self._exits:
                return self._exits[pid]
        if self.proc.poll() is not None and not Path(f"/proc/{pid}").exists():
            return -9
        return None

    def spawn(self, module: str, args: list[str], log: Path) -> ForkedProcess:
        """Fork ``python -m module ARGS`` from the zygote, its output into ``log``."""
        assert self.proc.stdin is not None
        with self._lock:
            ident, self._next = self._next, self._next + 1
        request = {"id": ident, "module": module, "args": args, "log": str(log)}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise ZygoteError("the node zygote exited") from None
        end = time.monotonic() + self.timeout
        with self._lock:
            while ident not in self._started:
                left = end - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    raise ZygoteError("the node zygote did not start a node process"
                                      + ("" if self._reader.is_alive() else ": it exited"))
                self._lock.wait(min(left, 1.0))
            answer = self._started.pop(ident)
        if answer.startswith("failed"):
            raise ZygoteError(answer)
        return ForkedProcess(self, int(answer), [module, *args])

    def close(self) -> None:
        """No more children: the zygote exits (its children run on until stopped)."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()


if __name__ == "__main__":
    main()
