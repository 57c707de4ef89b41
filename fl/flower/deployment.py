"""A local Flower deployment and ``fedlap-privacy train --engine flower``.

Contract: :class:`LocalDeployment` starts a SuperLink and one SuperNode per partition on
127.0.0.1 (free ports, ``FLWR_HOME`` in its working folder, nothing downloaded) and stops
every process it started on exit (:mod:`.processes`). :func:`run_on` runs (or resumes) one
training on it with ``flwr run`` and returns the ServerApp's summary, or raises
:class:`FlowerError` with the server's one-line error; :func:`run_flower` does both.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.flower.grid_clients import FlowerError
from fedlap_privacy.fl.flower.processes import free_port, kill_family, stop
from fedlap_privacy.fl.flower.run_config import run_config_of, toml_table, write_app
from fedlap_privacy.fl.flower.server_app import STATUS
from fedlap_privacy.fl.run_files import METRICS, check_new_run_dir, load_run_config
from fedlap_privacy.fl.simulation import Callback

__all__ = ["FlowerResult", "LocalDeployment", "run_flower", "run_on"]


class LocalDeployment:
    """A SuperLink and N SuperNodes (partition-id k of N) on 127.0.0.1, torn down on exit.

    Every process runs in its own session with its output in ``workdir``; ``FLWR_HOME`` is
    ``workdir/home`` (the connection ``fedlap-local`` points at the SuperLink). Runtime
    dependency installation is off.
    """

    CONNECTION = "fedlap-local"

    def __init__(self, clients: int, workdir: str | Path, device: str = "auto",
                 data_dir: str | None = None) -> None:
        self.clients, self.device, self.data_dir = clients, device, data_dir
        self.workdir = Path(workdir)
        self.home = self.workdir / "home"
        self.port = 0
        self.superlink: subprocess.Popen[bytes] | None = None
        self.supernodes: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        bindir = str(Path(sys.executable).parent)
        self.env = {
            **os.environ, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        }

    def exe(self, name: str) -> str:
        """The path of a Flower command (beside this Python first)."""
        local = Path(sys.executable).parent / name
        found = str(local) if local.exists() else shutil.which(name)
        if found is None:
            raise FlowerError(f"{name} not found: pip install 'fedlap-privacy[flower]'")
        return found

    def spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        """Start ``args`` in its own session, output into ``workdir/log_name``."""
        log = open(self.workdir / log_name, "wb")
        self._logs.append(log)
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                cwd=self.workdir, start_new_session=True)

    def start(self, timeout: float = 60.0) -> LocalDeployment:
        """Start the SuperLink, wait until it serves, then start the SuperNodes."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{self.CONNECTION}"\n\n[superlink.{self.CONNECTION}]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        self.superlink = self.spawn(
            [self.exe("flower-superlink"), "--insecure", "--host", "127.0.0.1",
             "--port", str(self.port), "--disable-runtime-dependency-installation"],
            "superlink.log",
        )
        self._wait_ready(timeout)
        for k in range(self.clients):
            self.start_node(k)
        return self

    def node_config(self, k: int) -> str:
        """The ``--node-config`` of the SuperNode holding partition ``k``."""
        node_config = (f"partition-id={k} num-partitions={self.clients} "
                       f"device={json.dumps(self.device)}")
        if self.data_dir:
            node_config += f" data-dir={json.dumps(self.data_dir)}"
        return node_config

    def start_node(self, k: int) -> subprocess.Popen[bytes]:
        """Start (or restart) the SuperNode holding partition ``k``."""
        proc = self.spawn(
            [self.exe("flower-supernode"), "--insecure", "--superlink",
             f"127.0.0.1:{self.port}", "--port", str(free_port()),
             "--node-config", self.node_config(k)],
            f"supernode-{k}.log",
        )
        if k < len(self.supernodes):
            self.supernodes[k] = proc
        else:
            self.supernodes.append(proc)
        return proc

    def kill_node(self, k: int) -> None:
        """SIGKILL SuperNode k and everything it started, at once (a machine dying)."""
        kill_family(self.supernodes[k])

    def _wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < end:
            assert self.superlink is not None
            if self.superlink.poll() is not None:
                raise FlowerError(f"flower-superlink exited: see {self.workdir / 'superlink.log'}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=1.0) as response:
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
        """Stop every process this deployment started (SuperNodes first)."""
        for proc in [*self.supernodes, *([self.superlink] if self.superlink else [])]:
            stop(proc)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class FlowerResult:
    """What ``train --engine flower`` prints: the run's summary and per-round metrics."""

    summary: dict[str, Any]
    history: list[dict[str, Any]]


def _read_history(out: Path) -> list[dict[str, Any]]:
    path = out / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _prepare(cfg: TrainConfig | None, out: Path, resume_run: bool) -> TrainConfig:
    """The run's configuration; refuses what :func:`simulation.train` / ``resume`` refuse."""
    if resume_run:
        return load_run_config(out)
    if cfg is None:
        raise ConfigError("a new Flower run needs a configuration")
    cfg.validate()
    check_new_run_dir(out)
    return cfg


def run_on(
    deployment: LocalDeployment,
    cfg: TrainConfig | None,
    out_dir: str | Path,
    device: str = "auto",
    callback: Callback | None = None,
    *,
    allow_client_failures: bool = False,
    round_timeout: float = 0.0,
    resume_run: bool = False,
    rounds: int | None = None,
    on_poll: Callable[[LocalDeployment], None] | None = None,
) -> FlowerResult:
    """Run (or resume) one training on a started deployment with ``flwr run``; see
    :func:`run_flower`. ``on_poll`` is called about twice a second while the run runs."""
    out = Path(out_dir).expanduser().resolve()
    cfg = _prepare(cfg, out, resume_run)
    if deployment.clients != cfg.clients:
        raise ConfigError(f"{deployment.clients} SuperNodes for a run of {cfg.clients} clients")
    callback = callback or (lambda event, info: None)
    out.mkdir(parents=True, exist_ok=True)
    (out / STATUS).unlink(missing_ok=True)
    run_config = run_config_of(
        cfg, out=str(out), device=device, round_timeout=float(round_timeout),
        allow_client_failures=allow_client_failures, resume=resume_run,
    )
    if resume_run:
        run_config["rounds"] = 0 if rounds is None else int(rounds)
    app = write_app(deployment.workdir / "app", cfg)
    seen = len(_read_history(out)) if resume_run else 0
    callback("start", {"config": cfg.to_dict(), "sigma": cfg.sigma, "start_round": seen + 1})
    runner = deployment.flwr_run(app, run_config)
    try:
        while runner.poll() is None:
            if on_poll is not None:
                on_poll(deployment)
            history = _read_history(out)
            for metrics in history[seen:]:
                callback("round_end", metrics)
            seen = max(seen, len(history))
            time.sleep(0.5)
    finally:
        stop(runner)
    for metrics in _read_history(out)[seen:]:
        callback("round_end", metrics)
    status_path = out / STATUS
    if not status_path.exists():
        log = deployment.workdir / "flwr-run.log"
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        raise FlowerError("the Flower run ended without a result" +
                          (f": {lines[-1][:200]} (see {log})" if lines else ""))
    status = json.loads(status_path.read_text())
    if status["status"] != "completed":
        raise FlowerError(status["error"])
    return FlowerResult(status["summary"], _read_history(out))


def run_flower(
    cfg: TrainConfig | None,
    out_dir: str | Path,
    clients: int | None = None,
    device: str = "auto",
    callback: Callback | None = None,
    *,
    allow_client_failures: bool = False,
    round_timeout: float = 0.0,
    resume_run: bool = False,
    rounds: int | None = None,
) -> FlowerResult:
    """Train on a local Flower deployment (``fedlap-privacy train --engine flower``).

    Starts a SuperLink and ``clients`` SuperNodes (default: the run's clients) on
    127.0.0.1 in a temporary directory, runs the app with ``cfg`` as run config (or resumes
    the run in ``out_dir``), reports progress to ``callback`` from metrics.jsonl (the
    simulator's events ``start`` and ``round_end``) and tears everything down, also on
    errors and Ctrl-C. Raises :class:`FlowerError` with the server's one-line message when
    the run fails; the checkpoint in ``out_dir`` has the simulator's format.
    """
    out = Path(out_dir).expanduser().resolve()
    cfg = _prepare(cfg, out, resume_run)
    n = cfg.clients if clients is None else clients
    if n != cfg.clients:
        raise ConfigError(f"--clients {n} SuperNodes for a run of {cfg.clients} clients")
    with tempfile.TemporaryDirectory(prefix="fedlap-flower-") as tmp:
        with LocalDeployment(n, tmp, device, cfg.data_dir) as deployment:
            return run_on(
                deployment, None if resume_run else cfg, out, device, callback,
                allow_client_failures=allow_client_failures, round_timeout=round_timeout,
                resume_run=resume_run, rounds=rounds,
            )
