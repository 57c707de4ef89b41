"""The ServerApp: :func:`simulation.train` / :func:`simulation.resume` with Flower messages.

Contract: the ServerApp reads the run config (:mod:`.run_config`), finds the SuperNode of
every partition (:meth:`FlowerClients.discover`) and runs the in-process simulator with
:class:`FlowerClients` as its ``ask_clients``, through the simulator's public ``train`` and
``resume`` only: the simulator alone writes the ledger and the checkpoints. When it ends it
writes :data:`STATUS` into ``out``: ``{"status": "completed", "summary": ...}`` or
``{"status": "failed", "error": ONE LINE, "pending": bool}``. Before it reads anything of the
run it takes the run folder's lock (:mod:`fedlap_privacy.state.run_lock`), or works under the lock
of the ``train --engine flower`` that launched it (run-config key ``run-lock``, its token); a
folder another process holds is refused with one line, and nothing is written into it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedlap_privacy.compute.threads import apply_cpu_policy
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.config_resolve import resolve_given
from fedlap_privacy.fl.engine.events import Callback, RoundEnded, RunEvent, RunStarted
from fedlap_privacy.fl.engine.simulation import restored_config, resume, train
from fedlap_privacy.fl.flower.grid_clients import (
    FlowerClients,
    expected_partitions,
    instruction_config,
    model_shape,
    run_data,
)
from fedlap_privacy.fl.flower.run_config import config_from_run_config
from fedlap_privacy.fl.run.randomness import run_split_seed
from fedlap_privacy.fl.run.run_files import PENDING, load_private, lock_run
from fedlap_privacy.state.atomic import write_text_atomic
from fedlap_privacy.state.checkpoint import PRIVATE
from fedlap_privacy.state.run_lock import RunLock

__all__ = ["STATUS", "serve", "server_app"]

#: written by the ServerApp into the output directory when it ends: {"status", "summary"|"error"}
STATUS = "flower-status.json"

server_app = ServerApp()


def _write_status(out: Path, status: dict[str, Any]) -> None:
    write_text_atomic(out / STATUS, json.dumps(status))


def _log(line: str) -> None:
    print(f"[fedlap-privacy] {line}", flush=True)


def _progress(event: RunEvent) -> None:
    if isinstance(event, RoundEnded):
        r = event.record
        eps = "-" if r.epsilon is None else f"{r.epsilon:.4f}"
        _log(f"round {r.round}: test accuracy {r.test_accuracy:.4f}, epsilon {eps}, "
             f"{'-' if r.replies is None else r.replies}/"
             f"{'-' if r.clients is None else r.clients} clients answered")
    elif isinstance(event, RunStarted):
        _log(f"start at round {event.start_round}, sigma {event.config.sigma}")


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    """Run (or resume) the training of the run config; write :data:`STATUS` into ``out``.

    The ServerApp's own process: its CPU settings are an entry point's
    (:func:`fedlap_privacy.compute.threads.apply_cpu_policy`: the fused kernels, the allocator, and
    torch's threads following the load, since it computes while the nodes wait), as ONE
    worker: the machine's CPUs, not the nodes' share (``FEDLAP_WORKERS`` = N in the local
    deployment's environment, which Flower's ``flwr-serverapp`` inherits)."""
    apply_cpu_policy(workers=1)
    serve(grid, context)


def serve(grid: Grid, context: Context, log: Callable[[str], None] = _log,
          progress: Callback = _progress) -> None:
    """The ServerApp's work (module docstring): its lines to ``log``, the simulator's events
    to ``progress`` (the Simulation Engine, :mod:`.simulation_engine`, runs it in-process and
    passes the CLI's own)."""
    started = time.time()
    cfg, driver = config_from_run_config(dict(context.run_config))
    out = Path(str(driver["out"])).expanduser().resolve()
    try:  # the launcher's lock (its token), or one taken here
        lock = lock_run(out, new=not driver["resume"], inherit=str(driver["run-lock"]) or None)
    except Exception as exc:  # e.g. another process holds the folder: write nothing into it
        log(f"error: {(str(exc).strip().splitlines() or [type(exc).__name__])[0]}")
        raise
    with lock:
        _run(grid, context, cfg, driver, out, lock, log, progress, {"started": started})


def _run(grid: Grid, context: Context, cfg: TrainConfig, driver: dict[str, Any], out: Path,
         lock: RunLock, log: Callable[[str], None], progress: Callback,
         times: dict[str, float]) -> None:
    """The run of :func:`serve`, holding (or working under) ``lock``; ``times``: its
    instants (:data:`.timings.SERVER_MARKS`), written into :data:`STATUS`."""
    try:
        clients = FlowerClients(grid, float(driver["round-timeout"]),
                                bool(driver["allow-client-failures"]),
                                float(driver["node-wait"]), log)
        # the split seed (secret unless the config sets one) is needed before the run starts:
        # a simulated-split node recomputes its records from it at discovery
        named = cfg.model  # on resume: the model the launcher's run config consented to
        if driver["resume"]:
            cfg, split_seed = restored_config(load_private(out), named, str(out / PRIVATE))
        else:  # a run config that leaves keys out gets them decided as train decides them
            cfg = resolve_given(cfg)
            split_seed = run_split_seed(cfg)
        # a user's records (cfg.data): their natural partition fixes the clients
        sent, data = run_data(instruction_config(cfg, split_seed))
        clients.discover(sent, expected_partitions(sent, data=data), model_shape(data))
        times["discovered"] = time.time()
        if driver["resume"]:
            rounds = cfg.rounds if int(context.run_config.get("rounds", 0)) <= 0 else int(
                context.run_config["rounds"])
            result = resume(out, rounds, str(driver["device"]), progress, clients, lock=lock,
                            model=named)
        else:
            result = train(cfg, out, str(driver["device"]), progress, clients,
                           split_seed=split_seed, lock=lock)
    except Exception as exc:
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        _write_status(out, {"status": "failed", "error": message,
                            "pending": (out / PENDING).exists(), "times": times})
        raise
    times["finished"] = time.time()
    summary = result.summary.to_json()
    _write_status(out, {"status": "completed", "summary": summary, "times": times})
    log(f"done: {json.dumps(summary)}")
