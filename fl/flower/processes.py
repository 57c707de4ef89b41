"""Starting and stopping the processes of a local deployment, each by its own id.

Contract: :func:`stop` ends a process this package started and every process it started in
turn (TERM, then KILL after a grace period), signalling a pid only while it is the process
seen at the start (same start time: a reused pid is left alone). Linux ``/proc`` only.
:func:`stopped_by_signals` turns SIGTERM and SIGHUP into an exception, so that the clean-up
of every ``with`` and ``finally`` on the way out runs (a process killed by the default
action runs none, and its children, each in a session of its own, live on);
:func:`signals_held` keeps SIGINT, SIGTERM and SIGHUP waiting while the processes are
stopped, so that a second Ctrl-C cannot cut the clean-up short. A command killed outright
(SIGKILL) runs no clean-up at all: :func:`die_with_parent` has Linux send SIGTERM to each
process it started directly (the SuperLink, ``flwr run``) when it dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Protocol

from fedlap_privacy.fl.engine.stop import StopRequested

__all__ = ["Process", "die_with_parent", "family", "free_port", "kill_family", "signals_held",
           "stop", "stop_all", "stop_descendants", "stopped_by_signals"]

#: the signals that end a run: a job scheduler's or ``kill``'s SIGTERM, a closed terminal's
#: SIGHUP (Ctrl-C's SIGINT already raises KeyboardInterrupt)
_ENDING = (signal.SIGTERM, signal.SIGHUP)


class Process(Protocol):
    """A started process as :class:`subprocess.Popen` shows it."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


#: prctl's option: the signal a process gets when the thread that started it dies
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that asks Linux (``prctl``
    ``PR_SET_PDEATHSIG``) to send ``sig`` to the child when the thread that starts it dies,
    SIGKILL included; a parent already gone when the child starts gets ``sig`` at once.
    None where there is no such call (not Linux). The deployment starts and stops its
    processes on one thread, which lives as long as the run. Between fork and exec the hook
    makes three system calls and nothing else (``prctl`` is looked up before the fork), so
    a lock another thread held at the fork is never waited on."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return set_signal


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process from /proc, or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def family(pid: int) -> list[tuple[int, int]]:
    """``pid`` and every descendant as (pid, start time)."""
    table: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        stat = _stat(int(entry.name))
        if stat is not None and stat[0] != "Z":
            table[int(entry.name)] = (stat[1], stat[2])
    if pid not in table:
        return []
    found, frontier = [(pid, table[pid][1])], [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, started) in table.items():
            if ppid == parent:
                found.append((child, started))
                frontier.append(child)
    return found


def _alive(pid: int, started: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and stat[2] == started


def _signal(members: list[tuple[int, int]], sig: int) -> None:
    for pid, started in members:
        if _alive(pid, started):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def kill_family(proc: Process) -> None:
    """SIGKILL ``proc`` and everything it started, at once (a machine dying)."""
    if proc.poll() is None:
        _signal(family(proc.pid), signal.SIGKILL)
    proc.wait(timeout=10)


def stop(proc: Process, grace: float = 5.0) -> None:
    """Stop ``proc`` and every process it started (each by its id): TERM, then KILL."""
    stop_all([proc], grace)


def stop_all(procs: list[Process], grace: float = 5.0) -> None:
    """:func:`stop` every process of ``procs`` at once: TERM to all their families (in the
    order given), then KILL to what is left after ``grace`` seconds; the grace runs once for
    all of them, not once each."""
    running = [proc for proc in procs if proc.poll() is None]  # an exited (reaped) one's
    # pid may already be another process's
    members = [member for proc in running for member in family(proc.pid)]
    _signal(members, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(_alive(*member) for member in members):
        for proc in running:
            proc.poll()  # reap our own children, so they do not linger as zombies
        time.sleep(0.05)
    _signal(members, signal.SIGKILL)
    for proc in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)


def stop_descendants(grace: float = 5.0) -> None:
    """Stop every process this one started, and theirs: TERM, then KILL what is left after
    ``grace`` seconds; its own children are reaped as they exit."""
    members = [member for member in family(os.getpid()) if member[0] != os.getpid()]
    _signal(members, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(_alive(*member) for member in members):
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        time.sleep(0.05)
    _signal(members, signal.SIGKILL)


@contextlib.contextmanager
def stopped_by_signals(what: str) -> Iterator[None]:
    """Within the block (entered from the main thread; elsewhere it changes nothing),
    SIGTERM and SIGHUP raise :class:`~fedlap_privacy.fl.engine.stop.StopRequested` (once;
    the same signal again while the block unwinds is ignored), naming ``what`` was
    stopped; the previous handlers are restored on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise StopRequested(f"{what} stopped by {signal.Signals(signum).name}; every "
                                "process it started was stopped; resume to continue")

    previous = {sig: signal.signal(sig, handler) for sig in _ENDING}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP held back (delivered on exit) within the block, in the
    calling thread."""
    held = {signal.SIGINT, *_ENDING}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
