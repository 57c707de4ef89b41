"""A local Flower deployment: a SuperLink and one SuperNode per partition on 127.0.0.1.

Contract: :class:`LocalDeployment` starts Flower's own commands as Flower documents them: a
``flower-superlink`` and, per partition k of N, a ``flower-supernode`` (its
``--node-config``: ``partition-id``, its state folder ``state_root/node-K`` holding the node
ledger and, when given, the node policy file), both in Flower's default ``subprocess``
isolation, in which each starts its own ``flower-superexec`` and that one a new
``flwr-serverapp`` or ``flwr-clientapp`` process per task; a run is ``flwr run``
(:meth:`LocalDeployment.flwr_run`). What is ours is the plumbing around them: free ports,
``FLWR_HOME`` in its working folder (the ``flwr`` connection :data:`LocalDeployment.
CONNECTION`), runtime dependency installation off, one log file per process, each node's
share of the CPUs, and every process it started stopped on exit (:mod:`.processes`), a node
killed or restarted on request (:meth:`LocalDeployment.kill_node`,
:meth:`LocalDeployment.start_node`). With :class:`Secure` the SuperLink serves TLS (the CA,
certificate and key given) and, when node keys are given, admits only SuperNodes whose
public key was registered with ``flwr supernode register`` (Flower's SuperNode
authentication: ECDSA keys in OpenSSH format). Nothing of Flower is imported here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fedlap_privacy.compute.runtime_env import apply_runtime_defaults
from fedlap_privacy.compute.threads import WORKERS_ENV
from fedlap_privacy.fl.flower.grid_clients import FlowerError
from fedlap_privacy.fl.flower.processes import (
    die_with_parent,
    free_port,
    kill_family,
    signals_held,
    stop_all,
)
from fedlap_privacy.fl.flower.run_config import toml_table
from fedlap_privacy.fl.flower.timings import LauncherMarks

__all__ = ["LocalDeployment", "Secure"]


@dataclass(frozen=True)
class Secure:
    """TLS files of the SuperLink and, optionally, each SuperNode's authentication key.

    ``node_keys[k]`` is partition k's private key (OpenSSH ECDSA); its public key is beside
    it with the suffix ``.pub``, and is registered with the SuperLink before the node starts.
    """

    ca_cert: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[Path, ...] = ()


#: seconds the processes get to exit on SIGTERM before SIGKILL when the deployment closes
#: (nothing of the run is left to write by then: the ServerApp wrote its status)
CLOSE_GRACE_S = 2.0


class LocalDeployment:
    """A SuperLink and N SuperNodes (partition-id k of N) on 127.0.0.1, torn down on exit.

    Each node's torch threads: ``threads`` when given, else its share of the CPUs
    (``FEDLAP_WORKERS`` = N, :mod:`fedlap_privacy.compute.threads`). Node k keeps its state
    (its ledger) in ``state_root/node-k`` (default: the working folder)."""

    CONNECTION = "fedlap-local"

    def __init__(self, clients: int, workdir: str | Path, device: str = "auto",
                 data_dir: str | None = None, policy_file: str | Path | None = None,
                 secure: Secure | None = None, threads: int | None = None,
                 state_root: str | Path | None = None) -> None:
        self.clients, self.device, self.data_dir = clients, device, data_dir
        self.policy_file = None if policy_file is None else Path(policy_file).resolve()
        self.secure = secure
        self.workdir = Path(workdir)
        self.state_root = self.workdir if state_root is None else Path(state_root)
        self.home = self.workdir / "home"
        self.port = 0
        self.superlink: subprocess.Popen[bytes] | None = None
        self.supernodes: list[subprocess.Popen[bytes]] = []
        self.extra_nodes: list[subprocess.Popen[bytes]] = []  # started with a log name
        self._logs: list[IO[bytes]] = []
        self.marks = LauncherMarks()  # when each phase ended (timings.py)
        bindir = str(Path(sys.executable).parent)
        self.env = {
            **os.environ, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            # Flower's processes start `flower-superexec`, `flwr-clientapp`, ... by name
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
            WORKERS_ENV: str(clients),  # the nodes share this machine's CPUs (threads.py)
        }
        apply_runtime_defaults(self.env)  # torch's allocator settings, before it loads
        if threads is not None:  # an explicit count wins over the share (threads.py)
            self.env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))

    def exe(self, name: str) -> str:
        """The path of a Flower command (beside this Python first)."""
        local = Path(sys.executable).parent / name
        found = str(local) if local.exists() else shutil.which(name)
        if found is None:
            raise FlowerError(f"{name} not found: pip install '.[flower]' in a clone of "
                              "fedlap-privacy")
        return found

    def spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        """Start ``args`` in its own session, output into ``workdir/log_name``; it gets
        SIGTERM if this process dies without stopping it (:func:`.processes.die_with_parent`)."""
        log = self._log(log_name)
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                cwd=self.workdir, start_new_session=True,
                                preexec_fn=die_with_parent())

    def _log(self, name: str) -> IO[bytes]:
        log = open(self.workdir / name, "wb")
        self._logs.append(log)
        return log

    def _tls_link_args(self) -> list[str]:
        s = self.secure
        if s is None:
            return ["--insecure"]
        args = ["--ssl-ca-certfile", str(s.ca_cert), "--ssl-certfile", str(s.server_cert),
                "--ssl-keyfile", str(s.server_key)]
        return args + (["--enable-supernode-auth"] if s.node_keys else [])

    def start(self, timeout: float = 60.0) -> LocalDeployment:
        """Start the SuperLink, wait until it serves, register node keys, start the nodes."""
        self.marks.begin = time.time()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        transport = ("insecure = true\n" if self.secure is None else
                     f"root-certificates = {json.dumps(str(self.secure.ca_cert))}\n")
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{self.CONNECTION}"\n\n[superlink.{self.CONNECTION}]\n'
            f'address = "127.0.0.1:{self.port}"\n' + transport
        )
        self.superlink = self.spawn(
            [self.exe("flower-superlink"), *self._tls_link_args(), "--host", "127.0.0.1",
             "--port", str(self.port), "--disable-runtime-dependency-installation"],
            "superlink.log",
        )
        self._wait_ready(timeout)
        self.marks.superlink = time.time()
        for key in self.secure.node_keys if self.secure else ():
            self.register(key.with_name(key.name + ".pub"))
        for k in range(self.clients):
            self.start_node(k)
        self.marks.supernodes = time.time()
        return self

    def register(self, public_key: Path) -> None:
        """``flwr supernode register PUBLIC_KEY``: admit the SuperNode holding that key."""
        done = subprocess.run([self.exe("flwr"), "supernode", "register", str(public_key),
                               self.CONNECTION], env=self.env, cwd=self.workdir,
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            lines = (done.stdout + done.stderr).strip().splitlines() or ["no output"]
            raise FlowerError(f"flwr supernode register {public_key.name} failed: {lines[-1]}")

    def node_config(self, k: int) -> str:
        """The ``--node-config`` of the SuperNode holding partition ``k``."""
        state = self.state_root / f"node-{k}"
        items = {"partition-id": k, "num-partitions": self.clients, "device": self.device,
                 "state-dir": str(state)}
        if self.data_dir:
            items["data-dir"] = self.data_dir
        if self.policy_file is not None:
            items["policy-file"] = str(self.policy_file)
        return " ".join(f"{key}={json.dumps(v)}" for key, v in items.items())

    def start_node(self, k: int, key: Path | None = None,
                   log_name: str | None = None) -> subprocess.Popen[bytes]:
        """Start (or restart) ``flower-supernode`` for partition ``k`` (with its key, if any;
        ``key`` overrides it: a node with another key is an unregistered node); with
        ``log_name`` it is an extra node, beside node k's own."""
        args = [self.exe("flower-supernode"), "--superlink", f"127.0.0.1:{self.port}",
                "--port", str(free_port()), "--node-config", self.node_config(k)]
        if self.secure is None:
            args.append("--insecure")
        else:
            args += ["--root-certificates", str(self.secure.ca_cert)]
            key = key or (self.secure.node_keys[k] if self.secure.node_keys else None)
            if key is not None:
                args += ["--auth-supernode-private-key", str(key)]
        proc = self.spawn(args, log_name or f"supernode-{k}.log")
        if log_name is not None:
            self.extra_nodes.append(proc)
        elif k < len(self.supernodes):
            self.supernodes[k] = proc
        else:
            self.supernodes.append(proc)
        return proc

    def kill_node(self, k: int) -> None:
        """SIGKILL SuperNode k and everything it started (its SuperExec, its ClientApp
        process), at once (a machine dying)."""
        kill_family(self.supernodes[k])

    def _wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        scheme = "http" if self.secure is None else "https"
        context = None if self.secure is None else ssl.create_default_context(
            cafile=str(self.secure.ca_cert))
        url = f"{scheme}://127.0.0.1:{self.port}/health"
        while time.monotonic() < end:
            assert self.superlink is not None
            if self.superlink.poll() is not None:
                raise FlowerError(f"flower-superlink exited: see {self.workdir / 'superlink.log'}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=1.0, context=context) as response:
                    if response.status == 200:
                        return
            time.sleep(0.3)
        raise FlowerError(f"flower-superlink did not start within {timeout:g} s")

    def flwr_run(self, app_dir: Path, run_config: dict[str, Any]) -> subprocess.Popen[bytes]:
        """``flwr run APP fedlap-local --stream --run-config FILE``; its output in the log."""
        overrides = self.workdir / "run-config.toml"
        overrides.write_text(toml_table(run_config))
        return self.spawn(
            [self.exe("flwr"), "run", str(app_dir), self.CONNECTION, "--stream",
             "--run-config", str(overrides)],
            "flwr-run.log",
        )

    def close(self) -> None:
        """Stop every process this deployment started, all at once (:func:`.processes.stop_all`:
        TERM, SuperNodes first, then KILL what is left after :data:`CLOSE_GRACE_S`)."""
        with signals_held():  # a second Ctrl-C or SIGTERM waits until all are stopped
            stop_all([*self.extra_nodes, *self.supernodes,
                      *([self.superlink] if self.superlink else [])], grace=CLOSE_GRACE_S)
        for log in self._logs:
            log.close()
        self._logs.clear()
        self.marks.closed = time.time()

    def __enter__(self) -> LocalDeployment:
        try:
            return self.start()
        except BaseException:  # a failed or interrupted start stops what it started
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
