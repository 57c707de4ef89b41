"""``fedlap-privacy train --engine flower``: one training on a local Flower deployment.

Contract: :func:`run_on` runs (or resumes) one training on a started
:class:`~.deployment.LocalDeployment` with ``flwr run`` and returns the ServerApp's summary,
or raises :class:`FlowerError` with the server's one-line error (a node's refusal among
them: ``round 2 failed: client 1 refused round 2: sigma 0.5 below the node's minimum 1``);
:func:`run_flower` starts the deployment (every SuperNode with the node policy file, if
given), runs, and tears everything down, also on errors and Ctrl-C. Both hold the run
folder's lock (:mod:`fedlap_privacy.state.run_lock`) from before the folder is read, before any
SuperNode starts, until the run ends, and hand its token to the ServerApp (run-config key
``run-lock``), which works under it; a second run on the same folder is refused with one line.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.events import Callback, RoundEnded, RunStarted
from fedlap_privacy.fl.flower.deployment import LocalDeployment
from fedlap_privacy.fl.flower.grid_clients import FlowerError
from fedlap_privacy.fl.flower.node_ledger import NODE_STATE
from fedlap_privacy.fl.flower.policy import NodePolicy
from fedlap_privacy.fl.flower.processes import stop, stopped_by_signals
from fedlap_privacy.fl.flower.run_config import run_config_of, write_app
from fedlap_privacy.fl.flower.server_app import STATUS
from fedlap_privacy.fl.flower.timings import SERVER_MARKS, FlowerTimings
from fedlap_privacy.fl.run.run_files import (
    check_new_run_dir,
    load_history,
    load_run_config,
    lock_run,
)
from fedlap_privacy.fl.run.run_records import RoundRecord, RunSummary
from fedlap_privacy.fl.run.user_runs import prepare_data
from fedlap_privacy.model_factory import named_factory
from fedlap_privacy.state.checkpoint import PRIVATE
from fedlap_privacy.state.run_lock import RunLock

__all__ = ["FlowerResult", "prepare_run", "run_flower", "run_on"]


@dataclass
class FlowerResult:
    """What ``train --engine flower`` prints: the run's summary and per-round metrics;
    ``timings``: where the time went (:mod:`.timings`; :func:`run_flower` only)."""

    summary: RunSummary
    history: list[RoundRecord]
    timings: FlowerTimings | None = None


def prepare_run(cfg: TrainConfig | None, out: Path, resume_run: bool,
                model: str | None = None) -> TrainConfig:
    """The run's configuration; refuses what :func:`simulation.train` / ``resume`` refuse
    (a resumed run's recorded model factory unless ``model`` names it: never imported on
    its own, :func:`fedlap_privacy.model_factory.named_factory`)."""
    if resume_run:
        recorded = load_run_config(out)
        if recorded.model is not None:
            named_factory(recorded.model, model, str(out / PRIVATE), "--model", exact=True)
        return recorded
    if cfg is None:
        raise ConfigError("a new Flower run needs a configuration")
    cfg.validate()
    check_new_run_dir(out)
    return _local_paths(cfg)


def _local_paths(cfg: TrainConfig) -> TrainConfig:
    """A run on a user's records (``data``) with absolute paths, since the ServerApp and the
    SuperNodes run in the deployment's folder: ``data``, and a ``FILE.py:FUNC`` model (a node
    policy's ``allowed-models`` must list that absolute spec). The records and the model are
    checked now (:func:`fedlap_privacy.fl.run.user_runs.prepare_data`: one line, before any
    process starts); a natural partition fixes the number of clients, hence SuperNodes."""
    changes: dict[str, Any] = {}
    if cfg.data is not None:
        changes["data"] = str(Path(cfg.data).expanduser().resolve())
    if cfg.model is not None:
        where, _, name = cfg.model.rpartition(":")
        if where.endswith(".py"):
            changes["model"] = f"{Path(where).expanduser().resolve()}:{name}"
    if not changes:
        return cfg
    cfg = dataclasses.replace(cfg, **changes).validate()
    if cfg.data is not None:
        cfg, _ = prepare_data(cfg, 0)  # the seed draws held-out records only: not the count
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
    lock: RunLock | None = None,
    model: str | None = None,
) -> FlowerResult:
    """Run (or resume) one training on a started deployment with ``flwr run``; see
    :func:`run_flower`. ``on_poll`` is called about twice a second while the run runs.
    ``lock``: the run folder's lock, which the caller holds (else it is taken here).
    ``model``: on resume, the model factory the caller names (:func:`prepare_run`)."""
    out = Path(out_dir).expanduser().resolve()
    if lock is None:
        with lock_run(out, new=not resume_run) as held:
            return run_on(deployment, cfg, out, device, callback,
                          allow_client_failures=allow_client_failures,
                          round_timeout=round_timeout, resume_run=resume_run, rounds=rounds,
                          on_poll=on_poll, lock=held, model=model)
    if not lock.covers(out):
        raise ConfigError(f"the lock given holds {lock.folder}, not the run folder {out}")
    cfg = prepare_run(cfg, out, resume_run, model)
    if deployment.clients != cfg.clients:
        raise ConfigError(f"{deployment.clients} SuperNodes for a run of {cfg.clients} clients")
    callback = callback or (lambda event: None)
    (out / STATUS).unlink(missing_ok=True)
    run_config = run_config_of(
        cfg, out=str(out), device=device, round_timeout=float(round_timeout),
        allow_client_failures=allow_client_failures, resume=resume_run, run_lock=lock.token,
    )
    if resume_run:
        run_config["rounds"] = 0 if rounds is None else int(rounds)
    app = write_app(deployment.workdir / "app", cfg)
    seen = len(load_history(out)) if resume_run else 0
    callback(RunStarted(cfg, seen + 1))
    deployment.marks.flwr_run = time.time()
    runner = deployment.flwr_run(app, run_config)
    try:  # until `flwr run` ends, or the ServerApp's status is written (its last act)
        while runner.poll() is None and not (out / STATUS).exists():
            if on_poll is not None:
                on_poll(deployment)
            history = load_history(out)
            for metrics in history[seen:]:
                callback(RoundEnded(metrics))
            seen = max(seen, len(history))
            time.sleep(0.2)
    finally:
        stop(runner)
        deployment.marks.run_end = time.time()
    for metrics in load_history(out)[seen:]:
        callback(RoundEnded(metrics))
    status_path = out / STATUS
    if not status_path.exists():
        log = deployment.workdir / "flwr-run.log"
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        raise FlowerError("the Flower run ended without a result" +
                          (f": {lines[-1][:200]} (see {log})" if lines else ""))
    status = json.loads(status_path.read_text())
    if status["status"] != "completed":
        raise FlowerError(status["error"])
    summary = RunSummary.from_json(status.get("summary"), f"the summary in {status_path}")
    return FlowerResult(summary, load_history(out))


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
    node_policy: str | Path | None = None,
    threads: int | None = None,
    model: str | None = None,
) -> FlowerResult:
    """Train on a local Flower deployment (``fedlap-privacy train --engine flower``).

    Starts a SuperLink and ``clients`` SuperNodes (default: the run's clients) on
    127.0.0.1 in a temporary directory, runs the app with ``cfg`` as run config (or resumes
    the run in ``out_dir``; every SuperNode reads the policy file ``node_policy``, see
    :mod:`.policy`), reports progress to ``callback`` from metrics.jsonl (the
    simulator's events ``start`` and ``round_end``) and tears everything down, also on
    errors and Ctrl-C. Raises :class:`FlowerError` with the server's one-line message when
    the run fails; the checkpoint in ``out_dir`` has the simulator's format. SIGTERM and
    SIGHUP (from the main thread) stop the run at once, every process of the deployment
    with it, and raise :class:`~fedlap_privacy.fl.engine.stop.StopRequested`; the round
    under way stays charged, as the ledger entered it before training. ``threads``
    (``--threads``) sets every SuperNode's torch threads; by default each takes its share
    of the machine's CPUs (:mod:`fedlap_privacy.compute.threads`). ``model``: on resume, the
    model factory the caller names, which must be the run's (``train --resume --model``).
    """
    out = Path(out_dir).expanduser().resolve()
    if not resume_run and cfg is not None:
        cfg.validate()  # a bad configuration is refused before the folder is made
    with stopped_by_signals("the Flower run"), lock_run(out, new=not resume_run) as lock:
        cfg = prepare_run(cfg, out, resume_run, model)
        if node_policy is not None:  # refuse a bad file now
            NodePolicy.from_node_config({"policy-file": str(node_policy)})
        n = cfg.clients if clients is None else clients
        if n != cfg.clients:
            raise ConfigError(f"--clients {n} SuperNodes for a run of {cfg.clients} clients")
        before = len(load_history(out)) if resume_run else 0  # rounds of earlier launches
        with tempfile.TemporaryDirectory(prefix="fedlap-flower-") as tmp:
            with LocalDeployment(n, tmp, device, cfg.data_dir, node_policy,
                                 threads=threads, state_root=out / NODE_STATE) as deployment:
                result = run_on(
                    deployment, None if resume_run else cfg, out, device, callback,
                    allow_client_failures=allow_client_failures, round_timeout=round_timeout,
                    resume_run=resume_run, rounds=rounds, lock=lock, model=model,
                )
        result.timings = _timings(deployment, out, result.history[before:])
        return result


def _timings(deployment: LocalDeployment, out: Path,
             rounds: list[RoundRecord]) -> FlowerTimings | None:
    """The :class:`FlowerTimings` of a run whose ``rounds`` this launch ran, written into
    ``out`` (:data:`.timings.TIMINGS`); None where the ServerApp recorded no instants."""
    times = json.loads((out / STATUS).read_text()).get("times", {})
    if not all(key in times for key in SERVER_MARKS):
        return None
    timings = FlowerTimings.of(deployment.marks, times,
                               [float(h.seconds or 0.0) for h in rounds])
    timings.write(out)
    return timings
