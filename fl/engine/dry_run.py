"""``--dry-run``: what a ``train`` or ``compare`` run would do, without doing it.

A dry run validates the configuration and the dataset files, resolves everything the run
resolves at its start (preset, FedLAP-DP's schedule, sigma planned for a target, each
compare cell's budget) and returns a plan: per run the method, rounds, sigma, the epsilon it
will have spent after its rounds and against whom (the ledger's own composition, every
client taking part in every round: the worst case the run's target check uses), the data it
reads and an estimate of its time on this machine.

What it reads: the dataset files, to validate them and split the labels over the clients
(client sizes set the sampling rate, hence sigma and epsilon), exactly as the run does; it
computes nothing from the images. It never downloads, never writes or locks ``--out``.
A built-in dataset not yet downloaded is planned on its standard sizes and class counts
(:func:`fedlap_privacy.data.datasets.standard_stand_in`), and the plan names the files the run
would fetch. Every problem the run would meet at its start (a folder that holds a run,
missing files without ``--download``) is collected in the plan, not raised at the first.

The time estimate (:func:`time_steps`) never touches a private record and never trains a
whole round: the run's model and method are built on RANDOM data of the dataset's shape and
sizes (balanced labels, so the split has the real one's structure), and a few client steps
are timed the way the run trains them (the packed or vectorised cohort of up to
:data:`TIMED_COHORT` clients at once, else :data:`TIMED_LOOP` clients one by one), at one
and at three accesses per client-round after an untimed warm-up; the server's aggregation of
those replies and an evaluation of :data:`TIMED_EVAL` test records are timed once. The run's
time is extrapolated linearly: to its accesses per round, its expected clients per round
(the aggregation too), its test records and its rounds. An estimate (docs/performance.md
says how far off it was): a cohort packs more clients per call in the run than in the
timing (the estimate errs high there), FedLAP's trust region may end a round's loops early,
ALI-DPFL adapts tau (the estimate uses its first tau), checkpoints are not timed, and other
jobs sharing the machine change it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedlap_privacy.compute.threads import follow_load
from fedlap_privacy.data.dataset_files import Download, missing_downloads
from fedlap_privacy.data.datasets import Dataset, dataset_root, load_dataset, standard_stand_in
from fedlap_privacy.errors import ConfigError, MissingDataError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.config_resolve import cross_device_defaults
from fedlap_privacy.fl.run.privacy import (
    build_ledger,
    privacy_statement,
    privacy_warnings,
    with_planned_sigma,
)
from fedlap_privacy.fl.run.run_files import (
    check_new_run_dir,
    holds_run,
    load_history,
    load_private,
    load_release,
)
from fedlap_privacy.fl.run.run_records import PrivacyStatement
from fedlap_privacy.state.checkpoint import CHECKPOINT, PRIVATE
from fedlap_privacy.vocabulary import NoiseKind, Notion

__all__ = [
    "TIMED_COHORT", "TIMED_EVAL", "TIMED_LOOP", "ComparePlan", "DataPlan", "RoundTiming",
    "RunPlan", "TrainPlan", "plan_compare", "plan_run", "plan_train", "read_data",
    "time_steps",
]

#: the noise of the timing rounds: it does not change their time, and it is large enough
#: that ALI-DPFL's own budget (its target) leaves room for the two timing rounds
_TIMING_SIGMA = 50.0
#: the most clients a dry run trains at once to time a cohort's steps (packed, vectorised)
TIMED_COHORT = 16
#: the clients a dry run times one by one (the loop: a client's cost does not depend on
#: how many others train in the round)
TIMED_LOOP = 2
#: the test records a dry run evaluates (the rest extrapolated)
TIMED_EVAL = 512
#: the accesses per client-round of the two timed calls (after a warm-up at the first)
TIMED_ACCESSES = (1, 3)


@dataclass(frozen=True)
class DataPlan:
    """The data a run reads: shapes and sizes only."""

    dataset: str
    source: str  # the folder of the files, or "scikit-learn (bundled)"
    shape: tuple[int, ...]  # one record: channels, height, width, or features
    num_classes: int
    train_records: int
    test_records: int
    client_sizes: tuple[int, ...]
    seconds: float  # time to read and split them
    # the files are missing (why, in one line): planned on the dataset's standard sizes
    missing: str | None = None

    def describe(self) -> str:
        sizes = self.client_sizes
        record = ("x".join(map(str, self.shape)) if len(self.shape) > 1
                  else f"{self.shape[0]} features")
        source = (f"{self.source} (not there yet: its standard sizes and class counts)"
                  if self.missing else self.source)
        return (f"{self.dataset} from {source}: {self.train_records:,} training / "
                f"{self.test_records:,} test records of {record}, {self.num_classes} "
                f"classes; {len(sizes)} clients of {min(sizes):,}-{max(sizes):,} records")


@dataclass(frozen=True)
class RoundTiming:
    """A method's client steps timed on random data: ``setup`` (model, method, ledger) once,
    ``per_access`` and ``fixed`` seconds of one client's round (``fixed + per_access x T``)
    and ``server`` seconds per round (aggregation of the expected cohort and evaluation),
    plus ``per_epoch`` for each epoch of FedLAP's server optimisation. ``steps``: the client
    steps (accesses) timed, warm-up included; ``cohort``: the clients timed, trained as
    ``mode`` (``packed``, ``vectorised`` or ``loop``)."""

    setup: float
    fixed: float
    per_access: float
    server: float
    per_epoch: float
    device: str
    steps: int = 0
    cohort: int = 0
    mode: str = "loop"

    def seconds(self, cfg: TrainConfig, rounds: int, accesses: int) -> float:
        """The estimated time of ``rounds`` rounds of ``cfg`` at ``accesses`` per client-round
        (T accounted: a client-level method's clients take ``local_steps`` steps in it)."""
        return self.setup + rounds * self.round_seconds(cfg, accesses)

    def round_seconds(self, cfg: TrainConfig, accesses: int) -> float:
        """The estimated time of one round of ``cfg`` at ``accesses`` per client-round."""
        clients = cfg.sampling.expected_cohort
        server = self.server + (self.per_epoch * cfg.server_epochs if cfg.is_fedlap else 0.0)
        steps = accesses if cfg.is_fedlap or cfg.notion != Notion.CLIENT else cfg.local_steps
        return clients * (self.fixed + self.per_access * steps) + server

    def describe(self) -> str:
        """How the estimate was made, in words."""
        how = "one by one" if self.mode == "loop" else f"at once ({self.mode} cohort)"
        return (f"an estimate from {self.steps} client steps of {self.cohort} client"
                f"{'s' if self.cohort != 1 else ''} trained {how} on random data of the "
                "dataset's shape, extrapolated to the run's clients, steps and rounds")


@dataclass(frozen=True)
class RunPlan:
    """One run: its resolved configuration and what it will spend."""

    config: TrainConfig
    sigma_planned: bool
    accesses_per_round: int  # T accounted per client-round (ALI-DPFL: its first tau)
    rounds_run: int  # rounds the run will train (fewer than configured: a target stops it)
    privacy: PrivacyStatement  # the statement after those rounds (fl.run.privacy.privacy_statement)
    stop: str | None  # why it stops before its rounds, when it does
    seconds: float | None  # estimated time on this machine (None: not timed)
    start_round: int = 1  # > 1: a resumed run
    timing: RoundTiming | None = None  # what the estimate was made from
    # the cross-device defaults the run got (fl.methods.schedule), as train's line says them
    defaults: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["config"] = self.config.to_dict()
        out["privacy"] = self.privacy.to_json()
        return out


@dataclass(frozen=True)
class TrainPlan:
    """``train --dry-run``: the data, the run, the folder it would write; the files it would
    download, the warnings it would print and the problems that would stop it (each one
    line: the run would be refused)."""

    data: DataPlan
    run: RunPlan
    out: str
    resume: bool
    downloads: tuple[Download, ...] = ()
    warnings: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"dry_run": True, "data": dataclasses.asdict(self.data), "run": self.run.to_json(),
                "out": self.out, "resume": self.resume,
                "downloads": [{"url": d.url, "target": str(d.target), "bytes": d.size}
                              for d in self.downloads],
                "warnings": list(self.warnings), "problems": list(self.problems)}


@dataclass(frozen=True)
class ComparePlan:
    """``compare --dry-run``: every run of the comparison (``done``: already complete in
    ``out``, so the comparison only reads it)."""

    data: DataPlan
    runs: tuple[tuple[str, float | None, int, RunPlan, bool], ...]  # method, eps, seed, plan, done
    out: str

    @property
    def seconds(self) -> float | None:
        times = [p.seconds for _, _, _, p, done in self.runs if not done]
        return None if None in times else float(sum(t for t in times if t is not None))

    def to_json(self) -> dict[str, Any]:
        return {
            "dry_run": True, "data": dataclasses.asdict(self.data), "out": self.out,
            "seconds": self.seconds,
            "runs": [{"method": m, "eps": e, "seed": s, "done": done, **p.to_json()}
                     for m, e, s, p, done in self.runs],
        }


def read_data(cfg: TrainConfig, split_seed: int | None = None, *, missing_ok: bool = False
              ) -> tuple[TrainConfig, DataPlan, Dataset]:
    """Read and validate ``cfg``'s dataset (never downloading; a user's records as
    ``--data`` reads them) and split it as the run does: on ``split_seed`` (a resumed run's),
    else on ``cfg.split_seed`` or a fresh secret draw, as a new run's split is drawn.
    Returns ``cfg`` as the run has it (a natural partition sets its number of clients).
    ``missing_ok``: a built-in dataset whose files are missing is split on its standard
    sizes instead (the plan's ``missing`` says so)."""
    from fedlap_privacy.fl.engine.simulation import client_parts
    from fedlap_privacy.fl.run.randomness import run_split_seed
    from fedlap_privacy.fl.run.user_runs import prepare_data

    start = time.perf_counter()
    seed = run_split_seed(cfg, split_seed)
    if cfg.data is not None:
        cfg, data = prepare_data(cfg, seed)
        source = cfg.data
    else:
        missing = None
        try:
            data = load_dataset(cfg.dataset, cfg.data_dir)
        except MissingDataError as exc:
            if not missing_ok:
                raise
            data, missing = standard_stand_in(cfg.dataset), str(exc)
        source = ("scikit-learn (bundled)" if cfg.dataset == "digits"
                  else str(dataset_root(cfg.dataset, cfg.data_dir)))
    sizes = tuple(len(p) for p in client_parts(cfg, data, seed))
    plan = DataPlan(cfg.dataset, source, tuple(int(v) for v in data.x_train.shape[1:]),
                    data.num_classes, len(data.y_train), len(data.y_test), sizes,
                    time.perf_counter() - start, None if cfg.data is not None else missing)
    return cfg, plan, data


def _synthetic(data: Dataset, seed: int = 0) -> Dataset:
    """Random records of ``data``'s shapes and sizes, balanced labels: nothing of its content."""
    rng = np.random.default_rng(seed)
    n, n_test = len(data.y_train), len(data.y_test)
    shape = data.x_train.shape[1:]
    return Dataset(
        data.name, rng.standard_normal((n, *shape), dtype=np.float32),
        rng.permutation(np.arange(n) % data.num_classes).astype(np.int64),
        rng.standard_normal((n_test, *shape), dtype=np.float32),
        (np.arange(n_test) % data.num_classes).astype(np.int64),
        data.num_classes, data.mean, data.std, data.partition,
    )


def _timing_knobs(cfg: TrainConfig, step: int) -> dict[str, Any]:
    """The keys of a timed call of ``step`` accesses per client-round (and FedLAP: ``2 x
    step`` server epochs)."""
    if cfg.is_fedlap:
        return {"reinits": 1, "max_loops": 1, "real_batches": step, "server_epochs": 2 * step}
    return {"local_steps": step}


def _warm_up() -> None:
    """Imports torch makes on first use (the optimisers pull in torch._dynamo: seconds),
    so that the first timed call does not pay them."""
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def time_steps(cfg: TrainConfig, data: Dataset, device: str = "auto") -> RoundTiming:
    """Time a few client steps of ``cfg``'s method on random data shaped like ``data``, as the
    run trains its cohort, and one aggregation and evaluation (module docstring); nothing
    is written, no round is run, nothing is accounted."""
    import torch

    from fedlap_privacy.fl.engine.simulation import resolve_device
    from fedlap_privacy.fl.engine.training_run import TrainingRun, evaluate
    from fedlap_privacy.fl.methods.interface import build_method
    from fedlap_privacy.fl.run.randomness import SERVER_KEY, seeded_generator

    _warm_up()
    start = time.perf_counter()
    base = dataclasses.replace(
        cfg, rounds=1, sigma=_TIMING_SIGMA, data_dir=None,
        target_eps=cfg.target_eps if cfg.spec.target_is_budget else None).validate()
    with torch.random.fork_rng(devices=[]):
        run = TrainingRun(base, resolve_device(device), None, data=_synthetic(data))
        setup = time.perf_counter() - start
        expected = max(cfg.sampling.expected_cohort, 1.0)
        limit = TIMED_COHORT if run.vectorised else TIMED_LOOP
        count = max(1, min(cfg.clients, limit, round(expected)))
        chosen = sorted(np.random.default_rng(0).choice(cfg.clients, count, replace=False))
        calls = []
        for step in (TIMED_ACCESSES[0], *TIMED_ACCESSES):  # a warm-up, then the two timed
            timed = dataclasses.replace(base, **_timing_knobs(cfg, step))
            method = build_method(timed, run.device)
            info = method.round_info(1, run.server_state)
            gens = [seeded_generator(run.device, k) for k in chosen]
            if cfg.noise != NoiseKind.SEEDED:  # the threads the run's clients get
                follow_load()
            begin = time.perf_counter()
            if run.vectorised:
                replies = method.cohort_client(
                    run.model, run.x_train, run.y_train, [run.client_index[k] for k in chosen],
                    info, gens, packed=run.cohort_mode == "packed")
            else:
                replies = [method.client(run.model, *run.client_records(k), {}, info, gen)
                           for k, gen in zip(chosen, gens, strict=True)]
            clients_s = time.perf_counter() - begin
            begin = time.perf_counter()
            method.aggregate(run.model, replies, run.server_state, info,
                             seeded_generator(run.device, SERVER_KEY))
            calls.append((clients_s, time.perf_counter() - begin))
        evaluate(run.model, run.x_test[:64], run.y_test[:64])  # warm-up
        n_eval = min(TIMED_EVAL, len(run.y_test))
        begin = time.perf_counter()
        evaluate(run.model, run.x_test[:n_eval], run.y_test[:n_eval])
        evaluated = (time.perf_counter() - begin) / max(n_eval, 1) * (
            len(run.y_test) + len(run.y_val))
    (_, _), (one, server_one), (three, server_three) = calls
    spread = TIMED_ACCESSES[1] - TIMED_ACCESSES[0]
    per_access = max(three - one, 0.0) / spread / count
    fixed = max(one / count - per_access * TIMED_ACCESSES[0], 0.0)
    scale = expected / count  # the aggregation grows with the replies
    if cfg.is_fedlap:  # 2 and 6 server epochs
        per_epoch = max(server_three - server_one, 0.0) / (2 * spread) * scale
        server = max(server_one * scale - 2 * TIMED_ACCESSES[0] * per_epoch, 0.0) + evaluated
    else:
        per_epoch, server = 0.0, (server_one + server_three) / 2 * scale + evaluated
    steps = count * (2 * TIMED_ACCESSES[0] + TIMED_ACCESSES[1])
    return RoundTiming(setup, fixed, per_access, server, per_epoch, str(run.device), steps,
                       count, run.cohort_mode)


#: how a plan times a configuration (None: :func:`time_steps`)
Timer = Callable[[TrainConfig, Dataset, str], RoundTiming]


def plan_run(cfg: TrainConfig, sizes: Sequence[int], timing: RoundTiming | None,
             start_round: int = 1, ledger_entries: list[dict[str, Any]] | None = None,
             sigma_planned: bool | None = None, data: Dataset | None = None) -> RunPlan:
    """The plan of ``cfg`` on clients of ``sizes``: sigma planned as the run plans it, then
    its rounds entered in a fresh ledger (after ``ledger_entries``, a resumed run's), each
    with every client selected, stopping where the run's target check would stop it. Over
    secure aggregation the mechanism is the run's for its model on ``data`` (each round
    priced at min_survivors shares)."""
    planned = with_planned_sigma(cfg, list(sizes))
    secure = None
    if planned.secure_aggregation is not None and data is not None:
        import torch

        from fedlap_privacy.fl.run.user_runs import run_model
        from fedlap_privacy.fl.secure_sum.training import SecurePlan, with_planned_noise

        with torch.random.fork_rng(devices=[]):
            model = run_model(planned, data.input_shape, data.num_classes).model
        size = sum(p.numel() for p in model.parameters())
        planned = with_planned_noise(planned, size)
        secure = SecurePlan.of(planned, size)
    ledger = build_ledger(planned, list(sizes), secure)
    if ledger_entries:
        ledger.load(ledger_entries)
    steps = planned.spec.first_steps(planned)
    everyone = list(range(planned.clients))
    stop, rounds_run = None, 0
    gaussian_or_local = ledger.notion != Notion.NONE
    for m in range(start_round, planned.rounds + 1):
        if planned.target_eps is not None and gaussian_or_local and (
                ledger.projected_epsilon(steps) > planned.target_eps):
            stop = f"target epsilon {planned.target_eps:g} would be exceeded in round {m}"
            break
        ledger.record(m, steps, everyone, local_steps=steps, secure=None if secure is None else
                      secure.record(len(everyone), secure.min_survivors, released=True))
        rounds_run += 1
    seconds = None if timing is None else timing.seconds(planned, rounds_run, steps)
    scale = cross_device_defaults(planned.to_dict())
    return RunPlan(
        config=planned,
        sigma_planned=(planned.sigma != cfg.sigma) if sigma_planned is None else sigma_planned,
        accesses_per_round=steps, rounds_run=rounds_run,
        privacy=privacy_statement(planned, ledger, None if secure is None else secure.describe()),
        stop=stop, seconds=seconds,
        start_round=start_round, timing=timing,
        defaults=None if scale is None else scale.describe(planned),
    )


def plan_train(cfg: TrainConfig | None, out: Path, device: str = "auto", resume: bool = False,
               rounds: int | None = None, timer: Timer | None = None,
               model: str | None = None, download: bool = False) -> TrainPlan:
    """``train --dry-run``: a new run of ``cfg`` into ``out`` (a folder ``train`` would refuse
    is one of the plan's problems), or with ``resume`` the run already in ``out`` (its own
    settings, ``rounds`` as the new total), continued from its checkpoint and ledger; its
    model factory refused unless the user names it (``model``) as ``train --resume`` refuses
    it. A built-in dataset's missing files: with ``download`` the files the run would fetch,
    else a problem; planned on the dataset's standard sizes either way."""
    from fedlap_privacy.fl.engine.simulation import restored_config

    entries, start, planned_before, split_seed = None, 1, None, None
    problems: list[str] = []
    if resume:
        private = load_private(out)
        release = load_release(out)
        cfg, split_seed = restored_config(private, model, str(out / PRIVATE))
        if rounds is not None:
            cfg = dataclasses.replace(cfg, rounds=rounds)
        entries, start = release.ledger, private.round + 1
        planned_before = private.sigma_planned
        if len(load_history(out)) != private.round:
            raise ConfigError(f"{out}: metrics.jsonl does not match the checkpoint's round")
    else:
        if cfg is None:
            raise ConfigError("a new run needs its configuration")
        try:
            check_new_run_dir(out)
        except ConfigError as exc:
            problems.append(str(exc))
    cfg.validate()
    cfg, data_plan, data = read_data(cfg, split_seed, missing_ok=True)
    downloads: list[Download] = []
    if data_plan.missing is not None:
        downloads = missing_downloads(cfg.dataset, dataset_root(cfg.dataset, cfg.data_dir))
        if not download:
            size = sum(d.size for d in downloads)
            problems.append(f"{data_plan.missing} (about {size / 1e6:.0f} MB)" if size
                            else data_plan.missing)
    timing = (timer or time_steps)(cfg, data, device)
    run = plan_run(cfg, data_plan.client_sizes, timing, start, entries, planned_before, data)
    warnings = privacy_warnings(run.config, list(data_plan.client_sizes),
                                run.privacy.epsilon)
    return TrainPlan(data_plan, run, str(out), resume,
                     tuple(downloads) if download else (), tuple(warnings), tuple(problems))


def plan_compare(jobs: Sequence[Any], out: Path, device: str = "auto",
                 timer: Timer | None = None, *, split_seed: int | None = None) -> ComparePlan:
    """``compare --dry-run`` of :func:`fedlap_privacy.fl.engine.compare.plan_jobs`'s ``jobs`` on the
    comparison's ``split_seed``: each run's plan, one timing per method (sigma does not
    change a round's time), and which runs ``out`` holds complete already."""
    from fedlap_privacy.fl.engine.compare import run_dir

    if not jobs:
        raise ConfigError("compare has no run to plan")
    several = len({job.rounds for job in jobs}) > 1
    _, data_plan, data = read_data(jobs[0].config, split_seed)
    timings: dict[str, RoundTiming] = {}
    runs = []
    for job in jobs:
        key = job.method + repr(dataclasses.replace(
            job.config, sigma=None, target_eps=None, ldp_epsilon=None, seed=0, rounds=1))
        if key not in timings:
            timings[key] = (timer or time_steps)(job.config, data, device)
        folder = run_dir(out, job, several)
        history = load_history(folder) if holds_run(folder) else []
        done = len(history) >= job.rounds
        runs.append((job.method, job.eps, job.seed,
                     plan_run(job.config, data_plan.client_sizes, timings[key], data=data), done))
    return ComparePlan(data_plan, tuple(runs), str(out))


def cached_reference_models(run_dir: Path, count: int) -> int:
    """How many of ``audit --reference-models COUNT``'s models ``run_dir`` holds trained
    already (each missing one costs a full training of the run's configuration)."""
    from fedlap_privacy.fl.auditing.reference_models import reference_dirs

    return sum((folder / CHECKPOINT).is_file() for folder in reference_dirs(run_dir, count))
