"""The node zygote: forked node processes get their own randomness, session, output and exit
code, and the zygote runs nothing but the node modules."""

from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip("flwr")

from fedlap_privacy.fl.flower.node_zygote import Zygote, ZygoteError

pytestmark = pytest.mark.flower


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    work = tmp_path_factory.mktemp("zygote")
    with open(work / "zygote.log", "wb") as log:
        z = Zygote(dict(os.environ), work, log)
        yield z, work
        z.close()
        z.proc.wait(timeout=30)


def test_forked_nodes_draw_their_own_randomness(zygote):
    """Two children of one zygote must not share a generator state: a node's local noise or
    augmentation predictable from another node's would be the same draw. Without the reseed
    in the child, numpy's and torch's draws are equal across forks."""
    z, work = zygote
    procs = [z.spawn("fedlap_privacy.fl.flower.node_zygote", [], work / f"probe{i}.log")
             for i in range(2)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    first, second = (json.loads((work / f"probe{i}.log").read_text()) for i in range(2))
    assert first["pid"] == procs[0].pid and second["pid"] == procs[1].pid
    for name in ("random", "numpy", "torch"):
        assert first[name] != second[name], name


def test_exit_code_session_and_output_are_the_childs(zygote):
    """A node that fails reports its own exit code (argparse's 2) and writes into its own log;
    it runs in its own session, so stopping the launcher's group leaves it to processes.py."""
    z, work = zygote
    proc = z.spawn("fedlap_privacy.fl.flower.clientapp_worker", ["--bogus"], work / "bad.log")
    sid = None
    for _ in range(50):  # the child calls setsid() first thing
        try:
            sid = os.getsid(proc.pid)
        except ProcessLookupError:
            break
        if sid == proc.pid:
            break
        time.sleep(0.01)
    assert proc.wait(timeout=60) == 2
    assert "--runtime-api" in (work / "bad.log").read_text()
    assert sid in (None, proc.pid)  # None: it had already exited


def test_only_node_modules_run(zygote):
    """A request naming any other module (a path to code, a standard-library module) is
    refused, and the zygote goes on serving."""
    z, work = zygote
    for module in ("os", "runpy", "fedlap_privacy.cli.main"):
        with pytest.raises(ZygoteError, match="not a node process"):
            z.spawn(module, [], work / "x.log")
    assert not (work / "x.log").exists()
    proc = z.spawn("fedlap_privacy.fl.flower.node_zygote", [], work / "after.log")
    assert proc.wait(timeout=60) == 0


def test_children_are_stopped_when_the_launcher_is_gone(tmp_path):
    """A launcher killed outright (SIGKILL: it stops nothing itself) closes the zygote's
    input: the zygote stops every node process still running, then exits, so no node
    outlives its run. The node here is a SuperNode waiting for a SuperLink that never
    comes."""
    from fedlap_privacy.fl.flower.processes import free_port

    with open(tmp_path / "zygote.log", "wb") as log:
        z = Zygote(dict(os.environ), tmp_path, log)
        node = z.spawn("fedlap_privacy.fl.flower.local_supernode",
                       ["--superlink", f"127.0.0.1:{free_port()}", "--insecure",
                        "--port", str(free_port()), "--isolation", "process"],
                       tmp_path / "node.log")
        time.sleep(1.0)
        assert node.poll() is None  # still waiting for its SuperLink
        z.close()  # what the launcher's death does
        assert z.proc.wait(timeout=30) is not None
    stat = f"/proc/{node.pid}/stat"
    assert not os.path.exists(stat) or open(stat).read().rsplit(")", 1)[1].split()[0] == "Z"
