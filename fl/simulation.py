"""The in-process driver: rounds, client selection, evaluation, ledger, checkpoints.

One call of :func:`train` runs a whole federated training (or resumes one) with the client
and server steps of the method (:mod:`fedlap_privacy.fl.methods`), the same ones the Flower
driver calls.
Randomness (:mod:`~fedlap_privacy.fl.randomness`): the seed fixes the initial weights; the
split seed (secret unless ``split_seed`` is set) fixes the split, the validation hold-out
and the client subsets; the DP randomness (selection, batches, noise) is secret, drawn from
the operating system, unless the run asked for ``reproducible_noise`` (then it is derived
from (seed, round, client), bit-for-bit reproducible and not private).

Files (:mod:`~fedlap_privacy.fl.run_files`): the releasable ``ckpt.pt`` and the private
``private.pt``, committed together as one pair before round 1 and after every round. The
scores on the validation hold-out (private records) go to ``private.pt`` only; ``ckpt.pt``
and ``metrics.jsonl`` hold the metrics on public data. One writer per run: :func:`train`
and :func:`resume` hold the run folder's lock (:mod:`fedlap_privacy.run_lock`) from before
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
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlap_privacy.atomic import write_text_atomic
from fedlap_privacy.data import (
    Dataset,
    content_hash,
    holdout_indices,
    load_dataset,
    split_clients,
    subsample_parts,
)
from fedlap_privacy.errors import CheckpointError, ConfigError
from fedlap_privacy.fl.canaries import CanarySet, flat_weights
from fedlap_privacy.fl.client_sampling import select_clients
from fedlap_privacy.fl.cohort import vectorise_refusal
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.dp import dirac_canaries
from fedlap_privacy.fl.methods import Reply, RoundInfo, build_method
from fedlap_privacy.fl.packed_cohort import pack_refusal
from fedlap_privacy.fl.privacy import (
    build_ledger,
    privacy_block,
    privacy_warnings,
    with_planned_sigma,
)
from fedlap_privacy.fl.progress import LONG_ROUND_S, RoundClock, reporting
from fedlap_privacy.fl.randomness import (
    SERVER_KEY,
    dp_generator,
    run_split_seed,
    seeded_generator,
)
from fedlap_privacy.fl.released_metrics import released_history
from fedlap_privacy.fl.run_files import (
    CHECKPOINT,
    METRICS,
    PENDING,
    check_new_run_dir,
    commit_run_files,
    load_private,
    load_release,
    lock_run,
    public_config,
    settle_run_files,
)
from fedlap_privacy.fl.stop import STOPPED, stop_requested
from fedlap_privacy.fl.user_runs import check_user_run, prepare_data, run_model, with_data
from fedlap_privacy.ledger import PrivacyLedger, ledger_digest, selection_withheld
from fedlap_privacy.models import ModelConfig
from fedlap_privacy.run_lock import LOCK_FILE, RunLock
from fedlap_privacy.run_state import ModelRelease, PrivateRunState, ValidationScore
from fedlap_privacy.threads import follow_load
from fedlap_privacy.user_data import HELD_OUT_NOTE

__all__ = [
    "CHECKPOINT", "METRICS", "AskClients", "TrainResult", "client_parts", "local_clients",
    "resolve_device", "restored_config", "resume", "train", "validation_indices",
]

Callback = Callable[[str, dict[str, Any]], None]
#: how a round reaches its selected clients: (run, round, chosen, info, callback) -> replies.
#: :func:`local_clients` runs them in this process; ``flower_app`` sends Flower messages.
AskClients = Callable[["_Run", int, list[int], RoundInfo, Callback], list[Reply]]


@dataclass
class TrainResult:
    summary: dict[str, Any]
    history: list[dict[str, Any]]
    ledger: PrivacyLedger
    model: nn.Module


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but CUDA is not available")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}") from None


def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch: int = 1024) -> tuple[float, float]:
    """(accuracy, mean loss) on a labelled set."""
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(y), batch):
            out = model(x[i : i + batch])
            loss += float(F.cross_entropy(out, y[i : i + batch], reduction="sum"))
            correct += int((out.argmax(1) == y[i : i + batch]).sum())
    model.train()
    return correct / len(y), loss / len(y)


def _to(state: Any, device: torch.device | str) -> Any:
    """A method state (nested dicts/lists of tensors and plain values) moved to ``device``."""
    if isinstance(state, Tensor):
        return state.detach().to(device)
    if isinstance(state, dict):
        return {k: _to(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [_to(v, device) for v in state]
    return state


def _split_seed(cfg: TrainConfig, split_seed: int | None, natural: bool = False) -> int:
    """``cfg.split_seed`` when set, else the run's (secret) ``split_seed``; a split that
    draws nothing (the non-IID split or a user's ``natural`` partition, nothing held out or
    cut) needs neither."""
    seed = cfg.split_seed if cfg.split_seed is not None else split_seed
    if seed is not None:
        return seed
    if ((natural or cfg.split == "noniid") and not cfg.validation_records
            and cfg.client_records is None):
        return 0  # unused: this split is a function of the labels alone
    raise ConfigError("the split of this run is drawn from its split seed, which is secret: "
                      "pass the run's split seed (private.pt) or set split_seed")


def validation_indices(cfg: TrainConfig, data: Dataset, split_seed: int | None = None
                       ) -> np.ndarray:
    """The training records held out as the run's validation split (``validation_records``
    of them, drawn from the split seed: ``cfg.split_seed`` or the run's secret
    ``split_seed``; none when 0). No client holds them."""
    if cfg.validation_records == 0:
        return np.empty(0, dtype=np.int64)
    return holdout_indices(len(data.y_train), cfg.validation_records,
                           _split_seed(cfg, split_seed))


def client_parts(cfg: TrainConfig, data: Dataset, split_seed: int | None = None
                 ) -> list[np.ndarray]:
    """The run's split of the training records over its clients (docs/algorithms.md#splits):
    the records left after the validation split, each client cut to ``client_records`` when
    set; all drawn from the split seed (``cfg.split_seed``, else the run's secret
    ``split_seed``), never from the seed of the initial weights; the same in every driver,
    on every node. A user's natural partition (:mod:`~fedlap_privacy.fl.user_runs`) is kept:
    only the hold-out and the cuts are drawn."""
    seed = _split_seed(cfg, split_seed, natural=data.partition is not None)
    keep = np.setdiff1d(np.arange(len(data.y_train)), validation_indices(cfg, data, seed))
    if data.partition is not None:
        kept = np.zeros(len(data.y_train), dtype=bool)
        kept[keep] = True  # one mask, not a search per client: thousands of clients scale
        parts = [p[kept[p]] for p in data.partition]
    else:
        parts = [keep[p] for p in split_clients(
            data.y_train[keep], cfg.clients, cfg.split, cfg.dirichlet_alpha, seed,
            data.num_classes,
        )]
    _refuse_empty_clients(cfg, parts)
    return _cut(cfg, parts, seed)


def _refuse_empty_clients(cfg: TrainConfig, parts: list[np.ndarray]) -> None:
    """One line for a client left without records (a natural partition's empty client, or
    one emptied by the validation hold-out), in every driver before any step."""
    empty = next((k for k, p in enumerate(parts) if p.size == 0), None)
    if empty is None:
        return
    if cfg.validation_records:
        raise ConfigError(f"client {empty} holds no records once the {cfg.validation_records}"
                          " validation records are held out: hold out fewer")
    count = sum(p.size == 0 for p in parts)
    raise ConfigError(f"client {empty} holds no records ({count} of {len(parts)} clients are "
                      "empty): every client needs at least one")


def _cut(cfg: TrainConfig, parts: list[np.ndarray], seed: int) -> list[np.ndarray]:
    """Each part cut to ``client_records`` when set (drawn from the split seed ``seed``)."""
    if cfg.client_records is None:
        return parts
    return subsample_parts(parts, cfg.client_records, seed)


def default_model_config(cfg: TrainConfig, data: Dataset) -> ModelConfig:
    """The ConvNet (docs/algorithms.md#convnet); 8x8 inputs default to 32 channels and 2 blocks
    (see TrainConfig)."""
    small = data.image_size <= 8
    return ModelConfig(
        data.in_channels, data.image_size, data.num_classes,
        cfg.width or (32 if small else 128), cfg.depth or (2 if small else 3),
    )


def local_clients(
    run: _Run, m: int, chosen: list[int], info: RoundInfo, callback: Callback
) -> list[Reply]:
    """The in-process driver: the selected clients' steps on their own partitions, the
    cohort at once where the method and the model allow (``cohort_training``,
    :mod:`~fedlap_privacy.fl.cohort`), else each in turn."""
    if run.vectorised and chosen:
        if run.cfg.noise != "seeded":
            follow_load()
        gens = [dp_generator(run.cfg, run.device, m, k + 1) for k in chosen]
        clock = RoundClock(m, len(chosen))

        def cohort_step(t: int, total: int) -> None:
            callback("client_step", clock.cohort_step(t, total))

        with reporting(cohort_step):
            replies = run.method.cohort_client(
                run.model, run.x_train, run.y_train, [run.client_index[k] for k in chosen],
                info, gens, packed=run.cohort_mode == "packed")
        for k in chosen:
            callback("client_done", {"round": m, "client": k})
        return replies
    replies = []
    clock = RoundClock(m, len(chosen))
    for position, k in enumerate(chosen):
        if run.cfg.noise != "seeded":  # a seeded run keeps its threads: bit-for-bit rounding
            follow_load()
        x, y = run.client_records(k)
        gen = dp_generator(run.cfg, run.device, m, k + 1)

        def step(t: int, total: int, position: int = position, k: int = k) -> None:
            callback("client_step", clock.step(position, k, t, total))

        with run.canary_context(k, m, len(y)), reporting(step):
            cx, cy = run.with_canaries(k, x, y)
            reply = run.method.client(run.model, cx, cy, run.client_state[k], info, gen)
        replies.append(dataclasses.replace(reply, num_examples=len(y)))  # N_k without canaries
        callback("client_done", {"round": m, "client": k})
    return replies


class _Run:
    """State of one training run (built fresh or from a checkpoint). ``split_seed``: the
    seed of the split when ``cfg`` sets none (None: a fresh secret one, as
    :func:`~fedlap_privacy.fl.randomness.run_split_seed` draws it)."""

    def __init__(
        self, cfg: TrainConfig, device: torch.device, out: Path | None,
        ask_clients: AskClients = local_clients, data: Dataset | None = None,
        split_seed: int | None = None,
    ) -> None:
        self.split_seed = run_split_seed(cfg, split_seed)
        if data is None and cfg.data is not None:  # a user's records (fl.user_runs)
            cfg, data = prepare_data(cfg, self.split_seed)
        self.cfg, self.device, self.out = cfg, device, out
        self.ask_clients = ask_clients
        self.data: Dataset = load_dataset(cfg.dataset, cfg.data_dir) if data is None else data
        self.parts = client_parts(cfg, self.data, self.split_seed)
        self.sizes = [len(p) for p in self.parts]
        self.sigma_planned = cfg.private and cfg.sigma is None
        self.cfg = cfg = with_planned_sigma(cfg, self.sizes)
        self.ledger = build_ledger(cfg, self.sizes)
        self.x_test = torch.from_numpy(self.data.x_test).to(device)
        self.y_test = torch.from_numpy(self.data.y_test).to(device)
        held = torch.from_numpy(validation_indices(cfg, self.data, self.split_seed))
        self.x_val = torch.from_numpy(self.data.x_train)[held].to(device)
        self.y_val = torch.from_numpy(self.data.y_train)[held].to(device)
        torch.manual_seed(cfg.seed)
        built = run_model(cfg, self.data.input_shape, self.data.num_classes)
        self.model_config, self.model_factory = built.model_config, built.factory
        self.model = built.model.to(device)
        self.method = build_method(cfg, device)
        self.server_state = self.method.init_server_state(self.model, self.ledger)
        self.client_state: list[dict[str, Any]] = [{} for _ in range(cfg.clients)]
        self.history: list[dict[str, Any]] = []
        self.validation: list[ValidationScore] = []
        self.round = 0
        self.canaries = None if cfg.canaries == 0 else CanarySet.create(
            cfg, self.model, self.data.x_train.shape[1:],
            [torch.from_numpy(self.data.y_train[p]) for p in self.parts],
        )
        if ask_clients is local_clients:
            _ = self.cohort_mode  # vectorised or packed where it cannot: refused now

    def time_one_access(self) -> float | None:
        """Seconds one access of a client step takes on this machine: the method's short step
        (:meth:`~fedlap_privacy.fl.methods.Method.probe_config`) timed over the accesses it
        makes, on random records of the mean client size (no private record is touched,
        nothing is accounted; the global random state is left as it was), after one untimed
        warm-up (the first call loads kernels and grows the heap). None: not timed."""
        probe_cfg = self.method.probe_config()
        if probe_cfg is None:
            return None
        cfg, accesses = probe_cfg
        probe = build_method(cfg, self.device)
        size = max(int(np.mean(self.sizes)), cfg.batch_size, 1)
        with torch.random.fork_rng(devices=[]):
            x = torch.randn((size, *self.data.input_shape), device=self.device)
            y = torch.arange(size, device=self.device) % self.data.num_classes
            info = probe.round_info(1, self.server_state)
            gen = seeded_generator(self.device, 0)
            probe.client(self.model, x, y, {}, info, gen)  # warm-up
            start = time.perf_counter()
            probe.client(self.model, x, y, {}, info, gen)
            return (time.perf_counter() - start) / accesses

    # ---------------------------------------------------------------- canaries
    def canary_context(self, k: int, m: int, n_k: int) -> contextlib.AbstractContextManager:
        """Client k's white-box canaries in its DP steps of round m (a no-op otherwise)."""
        if self.canaries is None or self.canaries.kind != "white-box":
            return contextlib.nullcontext()
        rate = self.cfg.batch_size / n_k
        return dirac_canaries(self.canaries.dirac_step(self.cfg, k, rate, m, self.device))

    def with_canaries(self, k: int, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """Client k's records with its included black-box canary records appended."""
        extra = None if self.canaries is None else self.canaries.client_records(k)
        if extra is None or len(extra[1]) == 0:
            return x, y
        return torch.cat([x, extra[0].to(x)]), torch.cat([y, extra[1].to(y)])

    @cached_property
    def x_train(self) -> Tensor:
        """The training records on the device (on the CPU the dataset's own memory, not a
        copy); built on first use (a Flower server never uses them)."""
        return torch.from_numpy(self.data.x_train).to(self.device)

    @cached_property
    def y_train(self) -> Tensor:
        return torch.from_numpy(self.data.y_train).to(self.device)

    @cached_property
    def client_index(self) -> list[Tensor]:
        """Each client's records as indices into :attr:`x_train` (memory grows with the
        records, not with clients x records or clients x model)."""
        return [torch.from_numpy(p).to(self.device) for p in self.parts]

    def client_records(self, k: int) -> tuple[Tensor, Tensor]:
        """Client k's records, gathered for its step (freed after it)."""
        index = self.client_index[k]
        return self.x_train[index], self.y_train[index]

    @cached_property
    def cohort_mode(self) -> str:
        """How the cohort trains (``cohort_training``): ``loop``, ``vectorised`` (vmap) or
        ``packed``. ``auto`` packs on the CPU where the model packs (there the packed cohort
        keeps the loop's fused kernels and measured fastest of the three: docs/train.md,
        "Cross-device scale"), else trains the loop; on an
        accelerator it vectorises where the model allows. Under ``reproducible_noise``,
        ``auto`` trains the loop: the one-by-one clients of the Flower engine, bit for bit.
        ``vectorised`` or ``packed`` where it cannot is refused (one line)."""
        mode = self.cfg.cohort_training
        if mode == "loop" or (mode == "auto" and self.cfg.reproducible_noise):
            return "loop"
        why = None
        if not self.method.vectorises():
            why = f"{self.cfg.method} trains its clients one by one"
        elif self.canaries is not None:
            why = "canaries are inserted client by client"
        else:
            why = vectorise_refusal(self.model)
        on_cpu = self.device.type == "cpu"
        if why is None and (mode == "packed" or (mode == "auto" and on_cpu)):
            why = pack_refusal(self.model)
        if why is not None and mode != "auto":
            raise ConfigError(f"cohort_training {mode}: {why}; use auto or loop")
        if why is not None:
            return "loop"
        return ("packed" if on_cpu else "vectorised") if mode == "auto" else mode

    @property
    def vectorised(self) -> bool:
        """Whether the cohort trains at once (:attr:`cohort_mode` is not the loop)."""
        return self.cohort_mode != "loop"

    @cached_property
    def saved_indices(self) -> list[Tensor]:
        """The clients' index tensors as ``private.pt`` holds them: views of ONE tensor, so
        the file stores one array however many clients there are (10,000 separate tensors
        made every commit of the pair take seconds)."""
        flat = torch.from_numpy(np.concatenate(self.parts) if self.parts else
                                np.empty(0, dtype=np.int64))
        return list(torch.split(flat, self.sizes))

    @cached_property
    def fingerprints(self) -> dict[str, Any]:
        """Content hashes of the training data and of each client's partition."""
        d = self.data
        return {
            "data": content_hash(d.x_train, d.y_train),
            "partitions": [content_hash(p, d.x_train[p], d.y_train[p]) for p in self.parts],
        }

    # ---------------------------------------------------------------- persistence
    @property
    def withholds_selection(self) -> bool:
        """Whether the release withholds who was selected (:mod:`fedlap_privacy.ledger`)."""
        return selection_withheld(self.ledger.threat_model)

    def released_history(self) -> list[dict[str, Any]]:
        """The per-round metrics ``ckpt.pt`` and ``metrics.jsonl`` release
        (:mod:`~fedlap_privacy.fl.released_metrics`)."""
        return released_history(self.history, self.ledger.threat_model,
                                self.method.public_extras)

    def release(self) -> ModelRelease:
        """``ckpt.pt``: what may be shared (:mod:`fedlap_privacy.run_state`); the ledger and
        the metrics without the selection where the threat model assumes it hidden."""
        cfg = self.cfg
        return ModelRelease(
            model_state={k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            model_config=self.model_config, dataset=cfg.dataset, method=cfg.method,
            privacy=self.privacy(), ledger=[e.to_dict() for e in self.ledger.released_entries()],
            config=public_config(cfg), round=self.round, history=self.released_history(),
            model_factory=None if self.model_factory is None else self.model_factory.to_dict(),
        )

    def privacy(self) -> dict[str, Any]:
        """The run's privacy statement; a user's data without a test set adds what its
        evaluation on held-out private records releases (fedlap_privacy.user_data)."""
        block = privacy_block(self.cfg, self.ledger)
        if self.data.held_out:
            block["public"] = [*block["public"], HELD_OUT_NOTE]
        return block

    def private_state(self) -> PrivateRunState:
        """``private.pt``: what never leaves the run's owner. Its ledger fingerprint is the
        released ledger's (the one ``audit`` replays); where that withholds the selection,
        the full entries and metrics are kept here for ``--resume``."""
        withheld = self.withholds_selection
        return PrivateRunState(
            config=self.cfg.to_dict(),
            client_indices=self.saved_indices,
            fingerprints=self.fingerprints,
            ledger_digest=ledger_digest(self.ledger.released_entries()),
            ledger=self.ledger.to_list() if withheld else [],
            history=list(self.history) if withheld else [],
            sigma_planned=self.sigma_planned, round=self.round,
            client_state=_to(self.client_state, "cpu"),
            server_state=_to(self.server_state, "cpu"),
            canaries=None if self.canaries is None else self.canaries.to_state(),
            split_seed=self.split_seed, validation=[v.to_dict() for v in self.validation],
        )

    def restore(self, ckpt: ModelRelease, private: PrivateRunState) -> None:
        """Continue from saved files, refusing any that do not belong to this very run."""
        if private.fingerprints != self.fingerprints:
            saved = private.fingerprints
            what = "training data" if saved.get("data") != self.fingerprints["data"] else (
                "split of the records over the clients")
            raise CheckpointError(f"the {what} changed since the run started: --resume "
                                  "continues the same run on the same data only")
        if ckpt.round != private.round:
            raise CheckpointError("ckpt.pt and private.pt are from different rounds")
        self.ledger.load(ckpt.ledger, private.ledger_digest)
        if private.ledger:  # the full entries of a release that withholds the selection
            self.ledger.load(private.ledger)
            if ledger_digest(self.ledger.released_entries()) != private.ledger_digest:
                raise CheckpointError("the ledger in private.pt does not match the released "
                                      "one (entries removed or edited)")
        try:
            self.model.load_state_dict(ckpt.model_state)
        except RuntimeError as exc:
            first = (str(exc).strip().splitlines() or ["?"])[0][:160]
            raise CheckpointError(f"ckpt.pt does not fit the run's model ({first})") from None
        self.round = ckpt.round
        self.history = list(private.history or ckpt.history)
        self.validation = private.validation_scores
        self.sigma_planned = private.sigma_planned
        self.client_state = _to(private.client_state, self.device)
        self.server_state = _to(private.server_state, self.device)
        saved = private.canaries
        if (saved is None) != (self.canaries is None):
            raise CheckpointError("the run's canaries are missing from its private state")
        self.canaries = None if saved is None else CanarySet.from_state(saved)

    def save(self) -> None:
        """Commit ``private.pt`` and ``ckpt.pt`` as one pair, then the metrics; then the
        round under way is in the committed ledger and its marker goes."""
        if self.out is None:
            return
        commit_run_files(self.out, self.release(), self.private_state())
        write_text_atomic(self.out / METRICS,
                          "".join(json.dumps(h) + "\n" for h in self.released_history()))
        (self.out / PENDING).unlink(missing_ok=True)

    def mark_pending(self, round_: int, local_steps: int, chosen: list[int]) -> None:
        """Before private data is touched: the round, its T and the selected clients."""
        if self.out is not None:
            marker = {"round": round_, "local_steps": local_steps, "participants": chosen}
            write_text_atomic(self.out / PENDING, json.dumps(marker))

    def enter_interrupted(self) -> None:
        """Enter the round a ``round.pending`` marker names (worst case: its full T, every
        client selected when the marker does not say) and save."""
        assert self.out is not None
        try:
            pending = json.loads((self.out / PENDING).read_text())
            round_, steps = int(pending["round"]), int(pending["local_steps"])
            chosen = [int(k) for k in pending.get("participants", range(self.cfg.clients))]
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"{self.out / PENDING} is unreadable: the interrupted round "
                                  "cannot be counted") from None
        if round_ <= self.round:  # committed with its round; the crash came before the unlink
            (self.out / PENDING).unlink()
            return
        if round_ != self.round + 1:
            raise CheckpointError(f"{PENDING} names round {round_}, the run is at {self.round}")
        self.ledger.record(round_, steps, chosen, "interrupted", local_steps=steps)
        self.save()

    # ---------------------------------------------------------------- one round
    def run_round(
        self, m: int, local_steps: int, chosen: list[int], callback: Callback
    ) -> tuple[dict[str, Any], ValidationScore | None]:
        """Round m: its released metrics (public data only) and its score on the validation
        hold-out (None without one), which stays in ``private.pt``."""
        cfg, t0 = self.cfg, time.perf_counter()
        info = self.method.round_info(m, self.server_state)
        replies = self.ask_clients(self, m, chosen, info, callback)
        extra: dict[str, Any] = {}
        canary_clients = self.canaries is not None and self.canaries.kind == "clients"
        if replies or self.method.aggregate_without_replies:
            server_gen = dp_generator(cfg, self.device, m, SERVER_KEY)
            before = flat_weights(self.model) if canary_clients else None
            sent = replies
            if canary_clients:
                assert self.canaries is not None
                sent = replies + self.canaries.canary_replies(cfg, self.model, m)
            extra = self.method.aggregate(self.model, sent, self.server_state, info, server_gen)
            if before is not None and self.canaries is not None:
                self.canaries.observe_round(before, flat_weights(self.model))
        accesses = max((r.accesses for r in replies), default=0)
        entry = self.ledger.record(m, accesses, chosen, local_steps=local_steps)
        acc, loss = evaluate(self.model, self.x_test, self.y_test)
        validation = None
        if len(self.y_val):
            validation = ValidationScore(m, *evaluate(self.model, self.x_val, self.y_val))
        upload = [r.upload_bytes for r in replies]
        return {
            "round": m, "test_accuracy": acc, "test_loss": loss,
            "epsilon": entry.epsilon, "delta": entry.delta, "rounds_spent": entry.rounds_spent,
            "accesses": accesses, "local_steps": entry.local_steps, "clients": len(chosen),
            "replies": len(replies),
            "lr": info.lr, "upload_bytes": float(np.mean(upload)) if upload else 0.0,
            **extra, "seconds": time.perf_counter() - t0,
        }, validation


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
) -> TrainResult:
    """Start a new federated training; see the module docstring.

    Refuses an output path that is a file, a link or a folder that already holds a run
    (continue that one with :func:`resume`). ``ask_clients`` is the driver of the client
    steps (in-process by default; the Flower ServerApp passes its own). Every setting is
    validated before any data is read; the run is saved before round 1, so a crash in any
    round leaves a run :func:`resume` continues. ``data`` replaces the configured dataset
    (e.g. a subset of it, for reference models): the run's split, fingerprints and ledger
    are those of ``data``; resume such a run with the same ``data``. ``data`` a path: a
    user's own ``.npz`` records (:mod:`fedlap_privacy.user_data`), as ``--data`` takes them.
    ``split_seed``: the secret seed of the split when ``cfg.split_seed`` is None (``compare``
    shares one over its runs, the Flower server draws it before discovery); None: a fresh
    secret. The run folder's lock (:mod:`fedlap_privacy.run_lock`; the folder is created) is
    taken before any data is read and held until the run returns; ``lock``: the caller holds
    it already. ``estimate``: time one step before round 1 and send the round's estimated
    time to ``callback`` (the ``estimate`` event, :func:`_estimate`).
    """
    out = Path(out_dir) if out_dir is not None else None
    if isinstance(data, str | Path):
        cfg, data = with_data(cfg, data), None
    cfg.validate()
    if cfg.canaries and ask_clients is not local_clients:
        raise ConfigError("canaries are inserted by the in-process driver only: train them "
                          "with --engine simulation")
    if out is None:
        return _execute(_Run(cfg, resolve_device(device), None, ask_clients, data), callback,
                        estimate)
    if data is None:
        check_user_run(cfg)  # a user's layout and model: refused before the folder exists
    created = lock is None and not out.exists()
    with _holding(out, lock, new=True):
        check_new_run_dir(out)
        settle_run_files(out)  # a first commit that never finished leaves staged files
        try:
            run = _Run(cfg, resolve_device(device), out, ask_clients, data, split_seed)
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
) -> TrainResult:
    """Continue the run in ``out_dir`` (optionally to a new total of ``rounds``).

    Refuses (one line) a run whose data, split or ledger do not match its private state. A
    round that was interrupted after touching private data is entered in the ledger first.
    ``data``: the dataset the run was started with, when :func:`train` was given one. The
    run folder's lock is taken before the run is read and held until the run returns
    (``lock``: the caller holds it already).
    """
    out = Path(out_dir)
    with _holding(out, lock, new=False):
        settle_run_files(out)
        private = load_private(out)
        ckpt = load_release(out)
        cfg, split_seed = restored_config(private)
        if rounds is not None:
            cfg.rounds = rounds
        cfg.validate()
        run = _Run(cfg, resolve_device(device), out, ask_clients, data, split_seed)
        run.restore(ckpt, private)
        if (out / PENDING).exists():
            run.enter_interrupted()
        return _execute(run, callback)


def restored_config(private: PrivateRunState) -> tuple[TrainConfig, int]:
    """The configuration and split seed of a saved run. A run saved before split seeds drew
    its split from ``seed``, which its released weights reveal: its configuration gets
    ``split_seed = seed``, so its guarantee declares the membership public."""
    cfg = TrainConfig.from_recorded(private.config)
    if private.split_seed is None:
        cfg = dataclasses.replace(cfg, split_seed=cfg.seed)
    return cfg, run_split_seed(cfg, private.split_seed)


def _estimate(run: _Run, callback: Callback) -> None:
    """The ``estimate`` event before round 1: one access timed (the mean over a short
    step), times T accesses per client, times the clients expected in a round; ``long``
    past LONG_ROUND_S."""
    access_s = run.time_one_access()
    if access_s is None:
        return
    cfg = run.cfg
    clients = max(cfg.sampling.expected_cohort, 1.0)
    round_s = access_s * cfg.accesses_per_round * clients
    callback("estimate", {"access_s": access_s, "accesses": cfg.accesses_per_round,
                          "clients": clients, "round_s": round_s, "run_s": round_s * cfg.rounds,
                          "long": round_s > LONG_ROUND_S})


def _execute(run: _Run, callback: Callback | None, estimate: bool = False) -> TrainResult:
    """Run the remaining rounds of ``run``; checkpoints after every round."""
    cfg, out = run.cfg, run.out
    callback = callback or (lambda event, info: None)
    callback("start", {"config": cfg.to_dict(), "sigma": cfg.sigma, "start_round": run.round + 1})
    for warning in privacy_warnings(cfg, run.sizes):
        callback("warning", {"message": warning})
    if estimate and run.round == 0 and run.ask_clients is local_clients and not run.vectorised:
        _estimate(run, callback)
    stopped = "completed"
    while run.round < cfg.rounds:
        m = run.round + 1
        steps = run.method.accounted_steps(run.server_state)
        reason = run.method.stop_reason(run.server_state)
        if reason is None and cfg.target_eps is not None and run.ledger.notion != "none":
            if run.ledger.projected_epsilon(steps) > cfg.target_eps:
                reason = f"target epsilon {cfg.target_eps} would be exceeded in round {m}"
        if reason is None and stop_requested():
            reason = STOPPED
        if reason is not None:
            stopped = reason
            break
        callback("round_start", {"round": m})
        chosen = select_clients(cfg, m)
        run.mark_pending(m, steps, chosen)
        metrics, validation = run.run_round(m, steps, chosen, callback)
        run.history.append(metrics)
        if validation is not None:
            run.validation.append(validation)
        run.round = m
        run.save()
        shown = {} if validation is None else validation.to_dict()
        callback("round_end", {**metrics, **shown})
    if out is not None:
        from fedlap_privacy.fl.plots import plot_history

        plot_history(run.history, out)
    last = run.history[-1] if run.history else {}
    scored = run.validation[-1].accuracy if run.validation else None
    replies = sum(h["replies"] for h in run.history)
    total = sum(h["upload_bytes"] * h["replies"] for h in run.history)
    summary = {
        "method": cfg.method,
        "dataset": cfg.dataset,
        "rounds_run": run.round,
        "test_accuracy": last.get("test_accuracy"),
        # the owner's view (from private.pt): never written into ckpt.pt or metrics.jsonl
        **({"validation_accuracy": scored} if cfg.validation_records else {}),
        **run.privacy(),
        "sigma_planned": run.sigma_planned,
        "upload_bytes_mean": total / replies if replies else None,
        "upload_bytes_total": total,
        "stopped": stopped,
        "out": None if out is None else str(out),
    }
    return TrainResult(summary, run.history, run.ledger, run.model)
