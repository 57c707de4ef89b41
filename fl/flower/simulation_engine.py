"""``fedlap-privacy train --engine flower-simulation``: the Flower App on Flower's Simulation
Engine (virtual SuperNodes on Ray).

Contract: :func:`run_simulation_engine` runs (or resumes) one training with the same
ServerApp work (:func:`.server_app.serve`: the simulator's round loop, ledger, checkpoints,
with :class:`.grid_clients.FlowerClients` asking the clients) and the same ClientApp
(:func:`.client_app.make_client_app`: policy, node ledger, one client round) as ``--engine
flower``, but the SuperNodes are virtual: one per client (partition-id k of N), run by
Flower's Simulation Engine (its public ``flwr.simulation.run_simulation``) on a pool of Ray
actors, each actor holding :class:`SimulationResources` (CPUs and GPUs per client), on this
machine or on the Ray cluster at ``address``. Each virtual node gets its own state folder
(its ledger) in the run folder (``flower-nodes/node-k``, kept across launches, so a resumed
run's nodes count every round they answered; on a cluster the run folder must be on a file
system every Ray node shares, else the nodes refuse) and the node policy file, as a local
SuperNode does, through a Flower mod before the ClientApp's handlers. The run folder is
locked from before it is read until the run ends; the ServerApp works under that lock (its
token). A failed run raises :class:`.grid_clients.FlowerError` with the server's one line.
Needs ``flwr[simulation]`` (Ray): ``pip install '.[simulation]'`` in a clone of
fedlap-privacy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from fedlap_privacy.errors import ConfigError, FedlapError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.events import Callback
from fedlap_privacy.fl.flower.client_app import make_client_app
from fedlap_privacy.fl.flower.grid_clients import FlowerError
from fedlap_privacy.fl.flower.node_ledger import NODE_STATE, mark_state_root
from fedlap_privacy.fl.flower.policy import NodePolicy
from fedlap_privacy.fl.flower.run_config import run_config_of
from fedlap_privacy.fl.flower.runner import FlowerResult, prepare_run
from fedlap_privacy.fl.flower.server_app import STATUS, serve
from fedlap_privacy.fl.run.run_files import load_history, lock_run
from fedlap_privacy.fl.run.run_records import RunSummary

__all__ = ["SimulationResources", "check_ray_address", "discovery_wait", "node_config_mod",
           "ray_init_args", "resolve_ray_address", "run_simulation_engine"]

#: seconds to wait for a TCP answer at ``--ray-address`` before Ray is asked (Ray itself
#: retries an address where nothing answers for minutes, printing a warning every 30 s)
ADDRESS_TIMEOUT = 10.0
#: the fewest CPUs and the smallest GPU share a virtual SuperNode may hold
MIN_CLIENT_CPUS = 0.1
MIN_CLIENT_GPUS = 0.01
#: the start of every HTTP/2 connection (RFC 9113, 3.4) and an empty SETTINGS frame: a Ray
#: GCS or Ray Client server (gRPC) answers with a SETTINGS frame of its own
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_H2_SETTINGS = 4


@dataclass(frozen=True)
class SimulationResources:
    """What each virtual SuperNode's ClientApp holds while it runs, and where Ray runs.

    ``cpus`` and ``gpus`` per client (Ray resources: an actor pool of
    ``total CPUs // cpus`` actors runs the clients side by side; fractional GPUs share a
    GPU); ``address``: an existing Ray cluster (``auto``, ``HOST:6379``,
    ``ray://HOST:10001``), None: a Ray instance started on this machine for the run."""

    cpus: float = 1.0
    gpus: float = 0.0
    address: str | None = None

    def validate(self) -> SimulationResources:
        """Refuse, in one line, resources Ray or Flower would take badly: a value that is not
        a finite number (``nan`` passes every comparison), fewer than :data:`MIN_CLIENT_CPUS`
        CPUs (Flower starts total CPUs / ``cpus`` Ray actors, each a Python process holding
        torch: ``1e-9`` would ask for billions), or a GPU share below
        :data:`MIN_CLIENT_GPUS` other than 0."""
        for flag, value in (("--client-cpus", self.cpus), ("--client-gpus", self.gpus)):
            if not math.isfinite(value):
                raise ConfigError(f"{flag} {value}: expected a finite number")
        if self.cpus < MIN_CLIENT_CPUS:
            raise ConfigError(
                f"--client-cpus {self.cpus:g}: each virtual SuperNode needs at least "
                f"{MIN_CLIENT_CPUS:g} CPU (Ray runs CPUs / --client-cpus client processes "
                "side by side, each holding torch)")
        if self.gpus < 0 or 0 < self.gpus < MIN_CLIENT_GPUS:
            raise ConfigError(f"--client-gpus {self.gpus:g}: expected 0 (the CPU) or a GPU "
                              f"share of at least {MIN_CLIENT_GPUS:g}")
        return self

    def backend_config(self) -> dict[str, Any]:
        """Flower's ``backend_config`` for the Ray backend. Without ``address`` Ray is asked
        for a new instance (``local``): never the cluster that ``RAY_ADDRESS`` or a
        ``ray_current_cluster`` file in the temporary folder names, which someone else
        may have written."""
        init: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": False,
                                "address": self.address or "local"}
        return {"client_resources": {"num_cpus": self.cpus, "num_gpus": self.gpus},
                "init_args": init}

    def pool_size(self, nodes: list[dict[str, Any]]) -> int:
        """How many clients of these resources the Ray nodes ``nodes`` (``ray.nodes()``:
        each alive node's ``Resources``) hold side by side, counted node by node as Flower
        sizes its actor pool: ``CPU // cpus`` on each node, capped by ``GPU // gpus`` where
        a client holds a GPU share (a node without GPUs then holds none); a node that left
        the cluster (no resources) holds none."""
        total = 0
        for node in nodes:
            have = node.get("Resources") or {}
            if not node.get("Alive", True) or not have:
                continue
            fits = int(float(have.get("CPU", 0)) / self.cpus)
            if self.gpus > 0:
                fits = min(fits, int(float(have.get("GPU", 0)) / self.gpus))
            total += fits
        return total

    @property
    def node_device(self) -> str:
        """The device of each virtual node: the CPU unless it holds a share of a GPU."""
        return "auto" if self.gpus > 0 else "cpu"


def node_config_mod(state_root: str, device: str, policy_file: str | None,
                    state_token: str | None = None
                    ) -> Callable[[Message, Context, Callable[[Message, Context], Message]],
                                  Message]:
    """A Flower mod giving virtual node k what ``flower-supernode --node-config`` gives a
    local SuperNode: its state folder ``state_root/node-k`` (its ledger), its device and
    the node policy file; with ``state_token``, the token the node checks ``state_root``
    holds (:func:`~.node_ledger.check_state_root`) before it answers."""

    def mod(msg: Message, context: Context,
            call_next: Callable[[Message, Context], Message]) -> Message:
        k = int(context.node_config["partition-id"])
        extra: dict[str, Any] = {"state-dir": f"{state_root}/node-{k}", "device": device}
        if policy_file:
            extra["policy-file"] = policy_file
        if state_token:
            extra["state-token"] = state_token
        context.node_config.update(extra)
        return call_next(msg, context)

    return mod


def check_ray_address(address: str, timeout: float = ADDRESS_TIMEOUT) -> None:
    """Refuse, in one line, an ``--ray-address`` that is not ``auto``/``local``,
    ``HOST:PORT`` or ``ray://HOST:PORT``, or where nothing answers as a Ray cluster within
    about ``timeout`` seconds: no TCP connection (a typo, a cluster that is down), or no
    gRPC answer (a service that is not Ray; Ray's GCS and its client server speak gRPC, so
    they answer the HTTP/2 connection preface, RFC 9113 3.4, with a SETTINGS frame). Ray
    itself retries such an address for minutes. With ``RAY_USE_TLS`` set only the TCP
    connection is checked. ``auto`` is resolved before (:func:`resolve_ray_address`)."""
    import socket

    if address in ("auto", "local"):
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in hostport:
        raise ConfigError(f"--ray-address {address}: expected auto, HOST:PORT or "
                          "ray://HOST:PORT (e.g. 10.0.0.5:6379 or ray://10.0.0.5:10001)")
    tls = os.environ.get("RAY_USE_TLS", "0").lower() not in ("", "0", "false")
    try:
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except OSError as exc:
        raise FlowerError(f"the Ray cluster at {address} did not answer: {exc}") from None
    header = b""
    with conn:
        if tls:
            return
        with contextlib.suppress(OSError):  # a reset or a timeout: no answer
            conn.sendall(_H2_PREFACE)
            end = time.monotonic() + timeout
            while len(header) < 9 and time.monotonic() < end:
                conn.settimeout(max(end - time.monotonic(), 0.01))
                chunk = conn.recv(9 - len(header))
                if not chunk:
                    break
                header += chunk
    if len(header) < 9 or header[3] != _H2_SETTINGS:
        raise FlowerError(f"the service at {address} is not a Ray cluster (no gRPC answer "
                          f"within {timeout:g} s)")


def resolve_ray_address(address: str) -> str:
    """The cluster ``--ray-address`` names, with ``auto`` resolved here rather than by Ray,
    which would also take a ``ray_current_cluster`` file that another user wrote into Ray's
    temporary folder (``/tmp/ray`` is writable by everyone) or the GCS process of another
    user's Ray that it finds in the process list: ``RAY_ADDRESS`` where the user set it,
    else the address in ``$RAY_TMPDIR``/``$TMPDIR``/``/tmp`` + ``/ray/ray_current_cluster``
    where that file is this user's (or root's) and nobody else can write it (opened without
    following a link, checked on its descriptor: a replaced file is someone else's), else
    refused in one line. Any other address is returned as given."""
    import stat

    if address != "auto":
        return address
    named = os.environ.get("RAY_ADDRESS", "")
    if named and named != "auto":
        return named
    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    path = os.path.join(base, "ray", "ray_current_cluster")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"--ray-address auto: no Ray cluster started here ({path}: "
                          f"{exc.strerror}); name it with --ray-address HOST:PORT") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if (not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.geteuid(), 0)
                or st.st_mode & 0o022):
            raise ConfigError(f"--ray-address auto: {path} was written by another user (or "
                              "others may write it); name the cluster with --ray-address "
                              "HOST:PORT")
        found = f.read(256).decode("ascii", errors="replace").strip()
    if found in ("", "auto", "local"):
        raise ConfigError(f"--ray-address auto: {path} names no cluster")
    return found


def discovery_wait(clients: int) -> float:
    """Seconds the ServerApp waits for every virtual node's answer at discovery: the actors'
    start-up (each imports torch and this package) and one query per client through them.
    Virtual nodes are never missing, so the wait only bounds a broken actor pool."""
    return 600.0 + 1.0 * clients


@contextlib.contextmanager
def _quiet_flower() -> Iterator[None]:
    """Flower's INFO lines (one per message: thousands) and its notice that the Python entry
    point is deprecated (``flwr run`` is its successor, a separate process per run) off
    while the engine runs; its errors still show."""
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _server(run_config: dict[str, Any], log: Callable[[str], None],
            progress: Callback) -> ServerApp:
    """The ServerApp of :func:`.server_app.serve` with ``run_config`` as its run config
    (the Simulation Engine's Python entry point carries none)."""
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        ctx = Context(run_id=context.run_id, node_id=context.node_id,
                      node_config=context.node_config, state=context.state,
                      run_config=dict(run_config))
        serve(grid, ctx, log, progress)

    return app


def run_simulation_engine(
    cfg: TrainConfig | None,
    out_dir: str | Path,
    device: str = "auto",
    callback: Callback | None = None,
    *,
    resources: SimulationResources | None = None,
    allow_client_failures: bool = False,
    round_timeout: float = 0.0,
    resume_run: bool = False,
    rounds: int | None = None,
    node_policy: str | Path | None = None,
    model: str | None = None,
) -> FlowerResult:
    """Train on Flower's Simulation Engine (``train --engine flower-simulation``); see the
    module docstring. ``device``: the server's; ``callback`` receives the simulator's
    events (``start``, ``round_end``, ``client_done``) from the ServerApp. ``model``: on
    resume, the model factory the caller names, which must be the run's (``train --resume
    --model``; :func:`~fedlap_privacy.fl.flower.runner.prepare_run`)."""
    try:
        from flwr.simulation import run_simulation
    except ImportError:  # pragma: no cover - flwr without its simulation extra
        raise FlowerError("--engine flower-simulation needs Flower's Simulation Engine: pip "
                          "install '.[simulation]' in a clone of fedlap-privacy") from None
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise FlowerError("--engine flower-simulation needs Ray: pip install "
                          "'.[simulation]' in a clone of fedlap-privacy")
    resources = (resources or SimulationResources()).validate()
    out = Path(out_dir).expanduser().resolve()
    if not resume_run and cfg is not None:
        cfg.validate()
    callback = callback or (lambda event: None)
    policy = None if node_policy is None else str(Path(node_policy).expanduser().resolve())
    if policy is not None:  # refuse a bad file now
        NodePolicy.from_node_config({"policy-file": policy})
    with _ray(resources), lock_run(out, new=not resume_run) as lock:
        cfg = prepare_run(cfg, out, resume_run, model)
        (out / STATUS).unlink(missing_ok=True)
        run_config = run_config_of(
            cfg, out=str(out), device=device, round_timeout=float(round_timeout),
            allow_client_failures=allow_client_failures, resume=resume_run,
            run_lock=lock.token, node_wait=discovery_wait(cfg.clients))
        if resume_run:
            run_config["rounds"] = 0 if rounds is None else int(rounds)
        with tempfile.TemporaryDirectory(prefix="fedlap-flower-sim-") as tmp:
            log_path = Path(tmp) / "server.log"
            with open(log_path, "a") as log_file:

                def log(line: str) -> None:
                    log_file.write(line + "\n")
                    log_file.flush()

                # the nodes' ledgers: in the run folder, wherever Ray runs a node (a
                # resumed run's nodes find them); a node that does not see it refuses
                token = mark_state_root(out / NODE_STATE)
                client = make_client_app([node_config_mod(
                    str(out / NODE_STATE), resources.node_device, policy, token)])
                try:
                    run_simulation(server_app=_server(run_config, log, callback),
                                   client_app=client, num_supernodes=cfg.clients,
                                   backend_config=resources.backend_config())
                except Exception as exc:  # the ServerApp's failure is in STATUS, one line
                    if not (out / STATUS).exists():
                        if isinstance(exc, FedlapError):
                            raise
                        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                        raise FlowerError(f"the Flower simulation failed: {first}") from exc
            return _result(out, log_path)


def ray_init_args(resources: SimulationResources, temp_dir: str | None) -> dict[str, Any]:
    """The arguments of ``ray.init`` for a run: the cluster the user named with
    ``--ray-address``, else (or with ``local``) a new Ray instance on this machine
    (``address="local"``: Ray then reads neither ``RAY_ADDRESS`` nor the
    ``ray_current_cluster`` file of its temporary folder, which any local user can write)
    whose sockets and session files live in ``temp_dir``, a folder private to this user."""
    args = {**resources.backend_config()["init_args"], "include_dashboard": False,
            "runtime_env": {"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}}}
    if resources.address in (None, "local") and temp_dir is not None:
        args["_temp_dir"] = temp_dir
    return args


@contextlib.contextmanager
def _ray(resources: SimulationResources) -> Iterator[None]:
    """Ray for one run: a new instance started on this machine in a private temporary
    folder (:func:`ray_init_args`), or the cluster at ``address`` joined, the cluster checked
    to hold at least one client of ``resources`` (one line otherwise, before the run folder
    is touched), and shut down (left) after the run, which stops the processes of a Ray
    started here and ends the run's actors: Flower (1.40 to 1.42) asks its actors to exit but they
    keep their CPUs until the job ends, so a second run on the same Ray job would find none
    free. A Ray that the caller started is left running."""
    import ray

    started_here = not ray.is_initialized()
    if started_here and resources.address not in (None, "local"):
        resources = dataclasses.replace(resources,
                                        address=resolve_ray_address(str(resources.address)))
    temp_dir = None
    with _quiet_flower(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Flower's deprecation notice, Ray's tips
        try:
            if started_here:  # the workers import as this process does
                if resources.address in (None, "local"):  # a short path: Ray's socket
                    # paths must fit in 107 characters
                    temp_dir = tempfile.mkdtemp(prefix="fedlap-ray-")
                else:
                    check_ray_address(resources.address)
                try:
                    with _own_sigterm():
                        ray.init(**ray_init_args(resources, temp_dir))
                except Exception as exc:  # e.g. no cluster at the address, a node too slow
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    where = ("Ray on this machine" if temp_dir is not None
                             else f"the Ray cluster at {resources.address}")
                    raise FlowerError(f"{where} did not start: {first[:200]}") from None
            if resources.pool_size(ray.nodes()) == 0:
                total = ray.cluster_resources()
                raise ConfigError(
                    f"no Ray node can hold a client with --client-cpus {resources.cpus:g} "
                    f"--client-gpus {resources.gpus:g} (the cluster has "
                    f"{total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs)")
            yield
        finally:
            if started_here and ray.is_initialized():
                with _own_sigterm():
                    ray.shutdown()
            if temp_dir is not None:
                shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def _own_sigterm() -> Iterator[None]:
    """The SIGTERM handler this process had, back after Ray's call: ``ray.init`` installs
    its own (Python's ``sys.exit`` and the core worker's, which aborts the process), which
    would turn ``train``'s stop between rounds (:func:`~fedlap_privacy.fl.engine.stop.
    stop_between_rounds`) into a crash in the middle of a round."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def _result(out: Path, log_path: Path) -> FlowerResult:
    """The run's summary from :data:`STATUS`, or its one-line error."""
    status_path = out / STATUS
    if not status_path.exists():
        lines = log_path.read_text(errors="replace").strip().splitlines()
        raise FlowerError("the Flower simulation ended without a result" +
                          (f": {lines[-1][:200]}" if lines else ""))
    status = json.loads(status_path.read_text())
    if status["status"] != "completed":
        raise FlowerError(status["error"])
    summary = RunSummary.from_json(status.get("summary"), f"the summary in {status_path}")
    return FlowerResult(summary, load_history(out))
