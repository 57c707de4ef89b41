"""A process the deployment starts dies with the command that started it, even when that
command is killed outright (SIGKILL runs no clean-up): the attacker's replay is a SuperLink
left listening, holding the run's state, after its owner was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fedlap_privacy.fl.flower.processes import die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG is Linux's")

# the command: start a long sleeper as the deployment starts the SuperLink, print its pid,
# then wait to be killed
LAUNCHER = """
import subprocess, sys, time
from fedlap_privacy.fl.flower.processes import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         start_new_session=True, preexec_fn=die_with_parent())
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_started_process_dies_when_its_starter_is_sigkilled():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE,
                                text=True)
    assert launcher.stdout is not None
    child = int(launcher.stdout.readline())
    try:
        assert _alive(child)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the started process outlived its SIGKILLed starter"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_the_hook_exists_on_linux():
    assert callable(die_with_parent())
