"""The in-process driver: rounds, client selection, evaluation, ledger, checkpoints.

One call of :func:`train` runs a whole federated training (or resumes one) with the client
and server steps of the method (:mod:`fedlap_privacy.fl.methods.interface`), the same ones the
Flower driver calls. The run's state, one round and its commit are
:class:`~fedlap_privacy.fl.engine.training_run.TrainingRun`; the split of the records,
:mod:`~fedlap_privacy.fl.engine.run_split`; what a run returns and writes as JSON (its summary, its
rounds, its privacy statement), :mod:`~fedlap_privacy.fl.run.run_records`.
Randomness (:mod:`~fedlap_privacy.fl.run.randomness`): the seed fixes the initial weights; the
split seed (secret unless ``split_seed`` is set) fixes the split, the validation hold-out
and the client subsets; the DP randomness (selection, batches, noise) is secret, drawn from
the operating system, unless the run asked for ``reproducible_noise`` (then it is derived
from (seed, round, client), bit-for-bit reproducible and not private).

Files (:mod:`~fedlap_privacy.fl.run.run_files`): the releasable ``ckpt.pt`` and the private
``private.pt``, committed together as one pair before round 1 and after every round. The
scores on the validation hold-out (private records) go to ``private.pt`` only; ``ckpt.pt``
and ``metrics.jsonl`` hold the metrics on public data. One writer per run: :func:`train`
and :func:`resume` hold the run folder's lock (:mod:`fedlap_privacy.state.run_lock`) from before
anything of the run is read until they return, so a second process on the same folder is
refused instead of composing its own ledger from the same checkpoint. Privacy bookkeeping:
after the clients of a round are selected and before they touch private data, a marker
``round.pending`` records the round, its accounted T and the selected clients; the
checkpoint written after the round removes it. A run resumed after a crash finds the marker
and enters the interrupted round in the ledger (worst case, all the accesses it was
accounted for), so privacy spent is never lost; completed rounds are never counted twice (a
marker of a round the committed ledger already holds, left by a crash just after the
commit, is dropped).
A resumed run must be the same run: the data, the split and the ledger are checked against
the private state's content hashes and ledger fingerprint.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from fedlap_privacy.data.datasets import Dataset
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.config_resolve import resolve_given
from fedlap_privacy.fl.engine.client_sampling import select_clients
from fedlap_privacy.fl.engine.events import (
    Callback,
    RoundEnded,
    RoundEstimate,
    RoundStarted,
    RunStarted,
    RunWarning,
)
from fedlap_privacy.fl.engine.progress import LONG_ROUND_S
from fedlap_privacy.fl.engine.run_split import client_parts, validation_indices
from fedlap_privacy.fl.engine.stop import STOPPED, stop_requested
from fedlap_privacy.fl.engine.terminal_progress import progress_callback
from fedlap_privacy.fl.engine.training_run import (
    AskClients,
    TrainingRun,
    default_model_config,
    evaluate,
    local_clients,
    resolve_device,
)
from fedlap_privacy.fl.run.privacy import privacy_warnings
from fedlap_privacy.fl.run.randomness import run_split_seed
from fedlap_privacy.fl.run.run_files import (
    CHECKPOINT,
    METRICS,
    PENDING,
    check_new_run_dir,
    load_private,
    load_release,
    lock_run,
    settle_run_files,
)
from fedlap_privacy.fl.run.run_records import RoundRecord, RunSummary
from fedlap_privacy.fl.run.user_runs import check_user_run, with_data
from fedlap_privacy.model_factory import named_factory
from fedlap_privacy.state.checkpoint import PRIVATE
from fedlap_privacy.state.ledger import PrivacyLedger
from fedlap_privacy.state.run_lock import LOCK_FILE, RunLock
from fedlap_privacy.state.run_state import PrivateRunState
from fedlap_privacy.vocabulary import Notion

__all__ = [
    "CHECKPOINT", "METRICS", "PENDING", "AskClients", "Callback", "TrainResult",
    "client_parts", "default_model_config", "evaluate", "local_clients", "resolve_device",
    "restored_config", "resume", "train", "validation_indices",
]


@dataclass
class TrainResult:
    """What :func:`train` and :func:`resume` return: the run's summary, its per-round
    metrics (the full ones: the owner's view), its ledger and its trained model."""

    summary: RunSummary
    history: list[RoundRecord]
    ledger: PrivacyLedger
    model: nn.Module


@contextlib.contextmanager
def _holding(out: Path, lock: RunLock | None, new: bool) -> Iterator[None]:
    """The run folder's lock for the block: the caller's ``lock`` (which must be out's), or
    one taken here and released at the end."""
    if lock is not None:
        if not lock.covers(out):
            raise ConfigError(f"the lock given holds {lock.folder}, not the run folder {out}")
        yield
        return
    with lock_run(out, new=new):
        yield


def train(
    cfg: TrainConfig,
    out_dir: str | Path | None = None,
    device: str = "auto",
    callback: Callback | None = None,
    ask_clients: AskClients = local_clients,
    data: Dataset | str | Path | None = None,
    split_seed: int | None = None,
    *,
    lock: RunLock | None = None,
    estimate: bool = False,
    schedule: str = "auto",
    progress: bool | None = False,
) -> TrainResult:
    """Start a new federated training; see the module docstring.

    Refuses an output path that is a file, a link or a folder that already holds a run
    (continue that one with :func:`resume`). ``ask_clients`` is the driver of the client
    steps (in-process by default; the Flower ServerApp passes its own). Every setting is
    validated before any data is read; the run is saved before round 1, so a crash in any
    round leaves a run :func:`resume` continues. ``data`` replaces the configured dataset
    (e.g. a subset of it, for reference models): the run's split, fingerprints and ledger
    are those of ``data``; resume such a run with the same ``data``. ``data`` a path: a
    user's own ``.npz`` records (:mod:`fedlap_privacy.data.user_data`), as ``--data`` takes them.
    ``split_seed``: the secret seed of the split when ``cfg.split_seed`` is None (``compare``
    shares one over its runs, the Flower server draws it before discovery); None: a fresh
    secret. The run folder's lock (:mod:`fedlap_privacy.state.run_lock`; the folder is created) is
    taken before any data is read and held until the run returns; ``lock``: the caller holds
    it already. ``estimate``: time one step before round 1 and send the round's estimated
    time to ``callback`` (the ``estimate`` event, :func:`_estimate`). ``progress``: without a
    ``callback``, a line per round on stderr (:mod:`~fedlap_privacy.fl.engine.terminal_progress`):
    True; None: when stderr is a terminal (the default of :func:`fedlap_privacy.fl.train`);
    False (the drivers' default): silent.

    ``cfg`` takes the CLI's path (:func:`~fedlap_privacy.fl.config_resolve.resolve_given`):
    the keys it was not given are decided as ``train`` decides the flags a user did not type
    (FedLAP-DP's ``schedule``, ``auto`` or named as ``--schedule`` names it; the cross-device
    defaults; sigma planned for a target); the keys it was given win. With ``data`` a
    :class:`Dataset`, ``cfg`` runs as it is (the rules size clients by the configured
    dataset, which that data replaces).
    """
    out = Path(out_dir) if out_dir is not None else None
    callback = progress_callback(progress, callback)
    if isinstance(data, str | Path):
        cfg, data = with_data(cfg, data), None
    cfg = cfg.validate() if data is not None else resolve_given(cfg, schedule)
    if cfg.canaries and ask_clients is not local_clients:
        raise ConfigError("canaries are inserted by the in-process driver only: train them "
                          "with --engine simulation")
    if out is None:
        return _execute(TrainingRun(cfg, resolve_device(device), None, ask_clients, data), callback,
                        estimate)
    if data is None:
        check_user_run(cfg)  # a user's layout and model: refused before the folder exists
    created = lock is None and not out.exists()
    with _holding(out, lock, new=True):
        check_new_run_dir(out)
        settle_run_files(out)  # a first commit that never finished leaves staged files
        try:
            run = TrainingRun(cfg, resolve_device(device), out, ask_clients, data, split_seed)
        except Exception:  # refused before round 1 (a target out of reach, an empty client)
            if created:
                _forget_folder(out)
            raise
        run.save()
        return _execute(run, callback, estimate)


def _forget_folder(out: Path) -> None:
    """Remove the run folder this call created for a run refused before anything of it was
    written: its lock file, then the folder if nothing else is in it."""
    with contextlib.suppress(OSError):
        (out / LOCK_FILE).unlink()
        out.rmdir()


def resume(
    out_dir: str | Path,
    rounds: int | None = None,
    device: str = "auto",
    callback: Callback | None = None,
    ask_clients: AskClients = local_clients,
    data: Dataset | None = None,
    *,
    lock: RunLock | None = None,
    model: str | None = None,
    progress: bool | None = False,
) -> TrainResult:
    """Continue the run in ``out_dir`` (optionally to a new total of ``rounds``).

    Refuses (one line) a run whose data, split or ledger do not match its private state. A
    round that was interrupted after touching private data is entered in the ledger first.
    ``data``: the dataset the run was started with, when :func:`train` was given one. The
    run folder's lock is taken before the run is read and held until the run returns
    (``lock``: the caller holds it already). ``model``: the model factory the caller names
    (``train --resume --model``); a run whose model a user's factory built is resumed only
    when it is the recorded one (:func:`restored_config`). ``progress``: as :func:`train`'s.
    """
    out = Path(out_dir)
    callback = progress_callback(progress, callback)
    with _holding(out, lock, new=False):
        settle_run_files(out)
        private = load_private(out)
        ckpt = load_release(out)
        cfg, split_seed = restored_config(private, model, str(out / PRIVATE))
        if rounds is not None:
            cfg.rounds = rounds
        cfg.validate()
        run = TrainingRun(cfg, resolve_device(device), out, ask_clients, data, split_seed)
        run.restore(ckpt, private)
        if (out / PENDING).exists():
            run.enter_interrupted()
        return _execute(run, callback)


def restored_config(private: PrivateRunState, model: str | None = None,
                    where: str = PRIVATE) -> tuple[TrainConfig, int]:
    """The configuration and split seed of a saved run. A run saved before split seeds drew
    its split from ``seed``, which its released weights reveal: its configuration gets
    ``split_seed = seed``, so its guarantee declares the membership public.

    The recorded model factory is data (read from ``where``), never imported on its own: a
    user's factory is refused in one line showing it unless ``model``, the spec the caller
    names, is exactly the recorded one; a package factory passes
    (:func:`fedlap_privacy.model_factory.named_factory`)."""
    cfg = TrainConfig.from_recorded(private.config)
    if cfg.model is not None:
        named_factory(cfg.model, model, where, "--model", exact=True)
    if private.split_seed is None:
        cfg = dataclasses.replace(cfg, split_seed=cfg.seed)
    return cfg, run_split_seed(cfg, private.split_seed)


def _estimate(run: TrainingRun, callback: Callback) -> None:
    """The :class:`RoundEstimate` event before round 1: one access timed (the mean over a
    short step), times T accesses per client, times the clients expected in a round."""
    access_s = run.time_one_access()
    if access_s is None:
        return
    cfg = run.cfg
    clients = max(cfg.sampling.expected_cohort, 1.0)
    round_s = access_s * cfg.accesses_per_round * clients
    callback(RoundEstimate(access_s, cfg.accesses_per_round, clients, round_s,
                           round_s * cfg.rounds, round_s > LONG_ROUND_S))


def _execute(run: TrainingRun, callback: Callback | None, estimate: bool = False) -> TrainResult:
    """Run the remaining rounds of ``run``; checkpoints after every round."""
    cfg, out = run.cfg, run.out
    callback = callback or (lambda event: None)
    callback(RunStarted(cfg, run.round + 1))
    secure = run.secure
    planned = None if secure is None else secure.planned_epsilon(cfg.rounds, cfg.delta)
    for warning in privacy_warnings(cfg, run.sizes, planned) + (
            [] if secure is None else secure.warnings()):
        callback(RunWarning(warning))
    if estimate and run.round == 0 and run.ask_clients is local_clients and not run.vectorised:
        _estimate(run, callback)
    stopped = "completed"
    while run.round < cfg.rounds:
        m = run.round + 1
        steps = run.method.accounted_steps(run.server_state)
        reason = run.method.stop_reason(run.server_state)
        if (reason is None and cfg.target_eps is not None
                and run.ledger.notion != Notion.NONE):
            if run.ledger.projected_epsilon(steps) > cfg.target_eps:
                reason = f"target epsilon {cfg.target_eps} would be exceeded in round {m}"
        if reason is None and stop_requested():
            reason = STOPPED
        if reason is not None:
            stopped = reason
            break
        callback(RoundStarted(m))
        chosen = select_clients(cfg, m)
        run.mark_pending(m, steps, chosen)
        metrics, validation = run.run_round(m, steps, chosen, callback)
        run.history.append(metrics)
        if validation is not None:
            run.validation.append(validation)
        run.round = m
        run.save()
        callback(RoundEnded(metrics, validation))
    if out is not None:
        from fedlap_privacy.fl.run.plots import plot_history

        plot_history(run.history, out)
    return TrainResult(_summary(run, stopped), run.history, run.ledger, run.model)


def _summary(run: TrainingRun, stopped: str) -> RunSummary:
    """The summary of ``run``, which stopped for ``stopped``."""
    cfg = run.cfg
    replies = sum(h.replies or 0 for h in run.history)
    total = sum((h.upload_bytes or 0.0) * (h.replies or 0) for h in run.history)
    return RunSummary(
        method=cfg.method,
        dataset=cfg.dataset,
        rounds_run=run.round,
        test_accuracy=run.history[-1].test_accuracy if run.history else None,
        privacy=run.privacy(),
        sigma_planned=run.sigma_planned,
        upload_bytes_mean=total / replies if replies else None,
        upload_bytes_total=total,
        stopped=stopped,
        out=None if run.out is None else str(run.out),
        # the owner's view (from private.pt): never written into ckpt.pt or metrics.jsonl
        validation_accuracy=run.validation[-1].accuracy if run.validation else None,
        has_validation=bool(cfg.validation_records),
    )
