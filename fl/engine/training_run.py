"""One training run in memory: its data split, model, method, ledger and canaries; one round
of it (:meth:`TrainingRun.run_round`); and what it commits to its folder (``ckpt.pt``,
``private.pt``, ``metrics.jsonl``, ``round.pending``; :mod:`~fedlap_privacy.fl.run.run_files`).
:mod:`~fedlap_privacy.fl.engine.simulation` drives it round by round; the module docstring there
says what is random, what is private and how a crash is accounted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlap_privacy.compute.mapped_tensors import mapped_empty
from fedlap_privacy.compute.threads import follow_load
from fedlap_privacy.data.datasets import Dataset, content_hash, load_dataset, partition_hash
from fedlap_privacy.data.user_data import HELD_OUT_NOTE
from fedlap_privacy.errors import CheckpointError, ConfigError
from fedlap_privacy.fl.auditing.canaries import CanarySet, flat_weights
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.cohort import vectorise_refusal
from fedlap_privacy.fl.engine.events import Callback, ClientDone
from fedlap_privacy.fl.engine.packed_cohort import pack_refusal
from fedlap_privacy.fl.engine.progress import RoundClock, reporting
from fedlap_privacy.fl.engine.run_split import client_parts, validation_indices
from fedlap_privacy.fl.methods.dp import dirac_canaries
from fedlap_privacy.fl.methods.interface import Reply, RoundInfo, build_method
from fedlap_privacy.fl.run.privacy import build_ledger, privacy_statement, with_planned_sigma
from fedlap_privacy.fl.run.randomness import (
    SERVER_KEY,
    dp_generator,
    run_split_seed,
    seeded_generator,
)
from fedlap_privacy.fl.run.released_metrics import released_history
from fedlap_privacy.fl.run.run_files import METRICS, PENDING, commit_run_files, public_config
from fedlap_privacy.fl.run.run_records import PrivacyStatement, RoundRecord
from fedlap_privacy.fl.run.user_runs import prepare_data, run_model
from fedlap_privacy.fl.secure_sum.training import (
    MaskedRound,
    SecurePlan,
    finish_round,
    secure_sum_round,
    with_planned_noise,
)
from fedlap_privacy.models import ModelConfig
from fedlap_privacy.state.atomic import write_text_atomic
from fedlap_privacy.state.ledger import ledger_digest, selection_withheld
from fedlap_privacy.state.run_state import ModelRelease, PrivateRunState, ValidationScore
from fedlap_privacy.state.secure_rounds import NOISE_MISSING, REFUSED, SecureRound
from fedlap_privacy.vocabulary import CanaryKind, NoiseKind

__all__ = [
    "AskClients", "Callback", "TrainingRun", "default_model_config", "evaluate",
    "local_clients", "resolve_device",
]

#: how a round reaches its selected clients: (run, round, chosen, info, callback) -> replies.
#: :func:`local_clients` runs them in this process; ``flower_app`` sends Flower messages.
AskClients = Callable[["TrainingRun", int, list[int], RoundInfo, Callback], list[Reply]]


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


def default_model_config(cfg: TrainConfig, data: Dataset) -> ModelConfig:
    """The ConvNet (docs/algorithms.md#convnet); 8x8 inputs default to 32 channels and 2 blocks
    (see TrainConfig)."""
    small = data.image_size <= 8
    return ModelConfig(
        data.in_channels, data.image_size, data.num_classes,
        cfg.width or (32 if small else 128), cfg.depth or (2 if small else 3),
    )


def local_clients(
    run: TrainingRun, m: int, chosen: list[int], info: RoundInfo, callback: Callback
) -> list[Reply]:
    """The in-process driver: the selected clients' steps on their own partitions, the
    cohort at once where the method and the model allow (``cohort_training``,
    :mod:`~fedlap_privacy.fl.engine.cohort`), else each in turn."""
    if run.vectorised and chosen:
        if run.cfg.noise != NoiseKind.SEEDED:
            follow_load()
        gens = [dp_generator(run.cfg, run.device, m, k + 1) for k in chosen]
        clock = RoundClock(m, len(chosen))

        def cohort_step(t: int, total: int) -> None:
            callback(clock.cohort_step(t, total))

        with reporting(cohort_step):
            replies = run.method.cohort_client(
                run.model, run.x_train, run.y_train, [run.client_index[k] for k in chosen],
                info, gens, packed=run.cohort_mode == "packed")
        for k in chosen:
            callback(ClientDone(m, k))
        return replies
    replies = []
    clock = RoundClock(m, len(chosen))
    for position, k in enumerate(chosen):
        if run.cfg.noise != NoiseKind.SEEDED:  # a seeded run keeps its threads (bit for bit)
            follow_load()
        x, y = run.client_records(k)
        gen = dp_generator(run.cfg, run.device, m, k + 1)

        def step(t: int, total: int, position: int = position, k: int = k) -> None:
            callback(clock.step(position, k, t, total))

        with run.canary_context(k, m, len(y)), reporting(step):
            cx, cy = run.with_canaries(k, x, y)
            reply = run.method.client(run.model, cx, cy, run.client_state[k], info, gen)
        replies.append(dataclasses.replace(reply, num_examples=len(y)))  # N_k without canaries
        del x, y, cx, cy  # freed before the next client's records are gathered, not after
        callback(ClientDone(m, k))
    return replies


class TrainingRun:
    """State of one training run (built fresh or from a checkpoint). ``split_seed``: the
    seed of the split when ``cfg`` sets none (None: a fresh secret one, as
    :func:`~fedlap_privacy.fl.run.randomness.run_split_seed` draws it)."""

    def __init__(
        self, cfg: TrainConfig, device: torch.device, out: Path | None,
        ask_clients: AskClients = local_clients, data: Dataset | None = None,
        split_seed: int | None = None,
    ) -> None:
        self.split_seed = run_split_seed(cfg, split_seed)
        if data is None and cfg.data is not None:  # a user's records (fl.run.user_runs)
            cfg, data = prepare_data(cfg, self.split_seed)
        self.cfg, self.device, self.out = cfg, device, out
        self.ask_clients = ask_clients
        self.data: Dataset = load_dataset(cfg.dataset, cfg.data_dir) if data is None else data
        self.parts = client_parts(cfg, self.data, self.split_seed)
        self.sizes = [len(p) for p in self.parts]
        self.sigma_planned = cfg.private and cfg.sigma is None
        self.cfg = cfg = with_planned_sigma(cfg, self.sizes)
        self.x_test = torch.from_numpy(self.data.x_test).to(device)
        self.y_test = torch.from_numpy(self.data.y_test).to(device)
        held = torch.from_numpy(validation_indices(cfg, self.data, self.split_seed))
        self.x_val = torch.from_numpy(self.data.x_train)[held].to(device)
        self.y_val = torch.from_numpy(self.data.y_train)[held].to(device)
        torch.manual_seed(cfg.seed)
        built = run_model(cfg, self.data.input_shape, self.data.num_classes)
        self.model_config, self.model_factory = built.model_config, built.factory
        self.model = built.model.to(device)
        self.secure: SecurePlan | None = None
        #: a round's masked uploads, when a remote driver's clients masked their own
        self.masked_round: MaskedRound | None = None
        if cfg.secure_aggregation is not None:
            size = sum(p.numel() for p in self.model.parameters())
            self.cfg = cfg = with_planned_noise(cfg, size)
            self.secure = SecurePlan.of(cfg, size)
        self.ledger = build_ledger(cfg, self.sizes, self.secure)
        self.method = build_method(cfg, device)
        self.server_state = self.method.init_server_state(self.model, self.ledger)
        self.client_state: list[dict[str, Any]] = [{} for _ in range(cfg.clients)]
        self.history: list[RoundRecord] = []
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
        (:meth:`~fedlap_privacy.fl.methods.interface.Method.probe_config`) timed over the accesses
        it makes, on random records of the mean client size (no private record is touched,
        nothing is accounted; the global random state is left as it was), after one untimed
        warm-up (the first call loads kernels and grows the heap). None: not timed. On the
        CPU the records are in their own mapping (:mod:`fedlap_privacy.compute.mapped_tensors`),
        given back when the timing ends."""
        probe_cfg = self.method.probe_config()
        if probe_cfg is None:
            return None
        cfg, accesses = probe_cfg
        probe = build_method(cfg, self.device)
        size = max(int(np.mean(self.sizes)), cfg.batch_size, 1)
        with torch.random.fork_rng(devices=[]):
            x = (mapped_empty((size, *self.data.input_shape)) if self.device.type == "cpu"
                 else torch.empty((size, *self.data.input_shape), device=self.device))
            x.normal_()
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
        if self.canaries is None or self.canaries.kind != CanaryKind.WHITE_BOX:
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
        """Client k's records, gathered for its step (freed after it: on the CPU, a large
        gather in its own mapping, :mod:`fedlap_privacy.compute.mapped_tensors`, so that each
        client's records are given back rather than kept beside the next client's)."""
        index = self.client_index[k]
        if self.device.type != "cpu":
            return self.x_train[index], self.y_train[index]
        x = mapped_empty((len(index), *self.x_train.shape[1:]), self.x_train.dtype)
        return torch.index_select(self.x_train, 0, index, out=x), self.y_train[index]

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
            "partitions": [partition_hash(p, d.x_train, d.y_train) for p in self.parts],
        }

    # ---------------------------------------------------------------- persistence
    @property
    def withholds_selection(self) -> bool:
        """Whether the release withholds who was selected (:mod:`fedlap_privacy.state.ledger`)."""
        return selection_withheld(self.ledger.threat_model)

    def released_history(self) -> list[RoundRecord]:
        """The per-round metrics ``ckpt.pt`` and ``metrics.jsonl`` release
        (:mod:`~fedlap_privacy.fl.run.released_metrics`)."""
        return released_history(self.history, self.ledger.threat_model,
                                self.method.public_extras)

    def release(self) -> ModelRelease:
        """``ckpt.pt``: what may be shared (:mod:`fedlap_privacy.state.run_state`); the ledger and
        the metrics without the selection where the threat model assumes it hidden."""
        cfg = self.cfg
        return ModelRelease(
            model_state={k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            model_config=self.model_config, dataset=cfg.dataset, method=cfg.method,
            privacy=self.privacy().to_json(),
            ledger=[e.to_dict() for e in self.ledger.released_entries()],
            config=public_config(cfg), round=self.round,
            history=[h.to_json() for h in self.released_history()],
            model_factory=None if self.model_factory is None else self.model_factory.to_dict(),
        )

    def privacy(self) -> PrivacyStatement:
        """The run's privacy statement; a user's data without a test set adds what its
        evaluation on held-out private records releases (fedlap_privacy.data.user_data)."""
        statement = privacy_statement(self.cfg, self.ledger,
                                      None if self.secure is None else self.secure.describe())
        if self.data.held_out:
            statement = dataclasses.replace(statement, public=(*statement.public, HELD_OUT_NOTE))
        return statement

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
            history=[h.to_json() for h in self.history] if withheld else [],
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
        self.history = [RoundRecord.from_json(h, "a round in the saved run")
                        for h in private.history or ckpt.history]
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
                          "".join(json.dumps(h.to_json()) + "\n" for h in self.released_history()))
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
        secure = None if self.secure is None else self.secure.record(  # the fewest shares
            len(chosen), self.secure.min_survivors, released=True)
        self.ledger.record(round_, steps, chosen, "interrupted", local_steps=steps, secure=secure)
        self.save()

    # ---------------------------------------------------------------- one round
    def _secure_step(self, sent: list[Reply], planned: int
                     ) -> tuple[dict[str, Any], SecureRound]:
        """Over secure aggregation: the clients' clipped updates summed by
        :func:`~fedlap_privacy.fl.secure_sum.training.secure_sum_round` (``planned`` set up,
        ``sent`` answered), the server's step on the decoded sum; the round's record."""
        assert self.secure is not None
        masked, self.masked_round = self.masked_round, None
        if masked is not None:  # the clients masked their own uploads (a Flower driver)
            outcome = finish_round(self.secure, masked.spec, masked.server, masked.reveal,
                                   masked.planned)
        else:
            names = [n for n, _ in self.model.named_parameters()]
            updates = [torch.cat([r.payload[n].detach().double().flatten() for n in names])
                       .cpu().numpy() for r in sent]
            outcome = secure_sum_round(self.secure, updates, planned)
        extra: dict[str, Any] = {"expected_clients": self.cfg.sampling.expected_cohort,
                                 "clip": self.cfg.clip, "secure_received": len(sent)}
        if outcome.total is None:
            extra["secure_refused"] = outcome.refused
        else:
            self.method.step_on_sum(self.model, torch.from_numpy(outcome.total))
        return extra, outcome.record

    def run_round(
        self, m: int, local_steps: int, chosen: list[int], callback: Callback
    ) -> tuple[RoundRecord, ValidationScore | None]:
        """Round m: its released metrics (public data only) and its score on the validation
        hold-out (None without one), which stays in ``private.pt``."""
        cfg, t0 = self.cfg, time.perf_counter()
        info = self.method.round_info(m, self.server_state)
        replies = self.ask_clients(self, m, chosen, info, callback)
        extra: dict[str, Any] = {}
        canary_clients = self.canaries is not None and self.canaries.kind == CanaryKind.CLIENTS
        secure, status = None, "completed"
        if replies or self.method.aggregate_without_replies:
            server_gen = dp_generator(cfg, self.device, m, SERVER_KEY)
            before = flat_weights(self.model) if canary_clients else None
            sent, canary_sent = replies, []
            if canary_clients:
                assert self.canaries is not None
                canary_sent = self.canaries.canary_replies(cfg, self.model, m)
                sent = replies + canary_sent
            if self.secure is None:
                extra = self.method.aggregate(self.model, sent, self.server_state, info,
                                              server_gen)
            else:
                extra, secure = self._secure_step(sent, len(chosen) + len(canary_sent))
                status = ("completed" if "secure_refused" not in extra
                          else NOISE_MISSING if secure.released else REFUSED)
            if before is not None and self.canaries is not None and status == "completed":
                self.canaries.observe_round(before, flat_weights(self.model))
        accesses = max((r.accesses for r in replies), default=0)
        entry = self.ledger.record(m, accesses, chosen, status, local_steps, secure)
        epsilon = entry.epsilon
        if self.secure is not None:  # against the server, as the release states it
            shown = self.ledger.released() if self.withholds_selection else self.ledger
            epsilon = _finite_or_none(shown.server_epsilon())
        acc, loss = evaluate(self.model, self.x_test, self.y_test)
        validation = None
        if len(self.y_val):
            validation = ValidationScore(m, *evaluate(self.model, self.x_val, self.y_val))
        upload = [r.upload_bytes for r in replies] if self.secure is None else [
            self.secure.upload_bytes] * len(replies)
        return RoundRecord(
            round=m, test_accuracy=acc, test_loss=loss, epsilon=epsilon,
            delta=entry.delta, rounds_spent=entry.rounds_spent, local_steps=entry.local_steps,
            lr=info.lr, accesses=accesses, clients=len(chosen), replies=len(replies),
            upload_bytes=float(np.mean(upload)) if upload else 0.0,
            seconds=time.perf_counter() - t0, extras=extra,
        ), validation


def _finite_or_none(eps: float) -> float | None:
    return None if eps == float("inf") else eps
