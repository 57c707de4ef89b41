"""The in-process driver: rounds, client selection, evaluation, ledger, checkpoints.

One call of :func:`train` runs a whole federated training (or resumes one) with the client
and server steps of the method (:mod:`fedlap_privacy.fl.methods`), the same ones the Flower
driver calls.
Randomness comes from generators seeded by (seed, round, client), so a run is reproducible
on the CPU and a resumed run continues exactly where an uninterrupted one would be.

Privacy bookkeeping: before a round touches private data a marker file ``round.pending`` is
written; the checkpoint written after the round removes it. A run resumed after a crash
finds the marker and enters the interrupted round in the ledger (worst case, all the
accesses it was accounted for), so privacy spent is never lost; completed rounds are never
counted twice.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlap_privacy.accountant import FedLAPSchedule, plan_sigma
from fedlap_privacy.checkpoint import load_checkpoint, save_checkpoint
from fedlap_privacy.data import Dataset, load_dataset, split_clients
from fedlap_privacy.errors import CheckpointError, ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.methods import Reply, RoundInfo, build_method
from fedlap_privacy.ledger import PrivacyLedger
from fedlap_privacy.models import ModelConfig, build_model

__all__ = [
    "CHECKPOINT", "METRICS", "AskClients", "TrainResult", "local_clients", "resolve_device",
    "resume", "train",
]

CHECKPOINT = "ckpt.pt"
METRICS = "metrics.jsonl"
PENDING = "round.pending"

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


def _generator(device: torch.device, *keys: int) -> torch.Generator:
    seed = int(np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint64)[0] >> 1)
    return torch.Generator(device=device).manual_seed(seed)


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


def build_ledger(cfg: TrainConfig, client_sizes: list[int]) -> PrivacyLedger:
    """The ledger of the method's notion (SPEC 1.3, 1.5); plans sigma for a target if unset.

    Record level: the Theorem 5.8 schedule at the smallest client (the largest rate). Client
    level: one SGM over clients per round. Local: the per-weight epsilon per round.
    """
    notion = cfg.notion
    if notion == "local":
        return PrivacyLedger("local", round_epsilon=cfg.ldp_epsilon)
    if notion == "none":
        return PrivacyLedger("none")
    if notion == "client-level":
        schedule = FedLAPSchedule.client_level(cfg.clients, cfg.client_fraction)
    else:
        if cfg.batch_size > min(client_sizes):
            raise ConfigError(
                f"batch size {cfg.batch_size} is larger than the smallest client "
                f"({min(client_sizes)} records)"
            )
        schedule = FedLAPSchedule(
            batch_size=cfg.batch_size, client_size=min(client_sizes),
            local_steps=cfg.accesses_per_round, client_fraction=cfg.client_fraction,
        )
    if cfg.sigma is None:
        if cfg.target_eps is None:
            raise ConfigError("a DP run needs --sigma, or --target-eps to plan it")
        cfg.sigma = plan_sigma(schedule, cfg.rounds, cfg.target_eps, cfg.delta, cfg.accountant)
    return PrivacyLedger(notion, schedule, cfg.sigma, cfg.delta, cfg.accountant)


def privacy_block(cfg: TrainConfig, ledger: PrivacyLedger) -> dict[str, Any]:
    """What a checkpoint says of its privacy (read by ``audit``)."""
    eps = ledger.epsilon
    gaussian = cfg.private
    return {
        "notion": ledger.notion,
        "epsilon": None if eps == float("inf") else eps,
        "delta": cfg.delta if gaussian else None,
        "sigma": cfg.sigma if gaussian else None,
        "accountant": cfg.accountant if gaussian else None,
        "round_epsilon": ledger.round_epsilon,
    }


def client_parts(cfg: TrainConfig, data: Dataset) -> list[np.ndarray]:
    """The run's split of the training records over its clients (SPEC 2.4): the same in
    every driver, on every node."""
    return split_clients(
        data.y_train, cfg.clients, cfg.split, cfg.dirichlet_alpha, cfg.seed, data.num_classes
    )


def select_clients(cfg: TrainConfig, round_: int) -> list[int]:
    """Each client independently with probability ``client_fraction`` (the q1 of SPEC 1.3)."""
    select = _generator(torch.device("cpu"), cfg.seed, round_, 0)
    return [k for k in range(cfg.clients)
            if float(torch.rand((), generator=select)) < cfg.client_fraction]


def default_model_config(cfg: TrainConfig, data: Dataset) -> ModelConfig:
    """SPEC 2.4's ConvNet; 8x8 inputs default to 32 channels and 2 blocks (see TrainConfig)."""
    small = data.image_size <= 8
    return ModelConfig(
        data.in_channels, data.image_size, data.num_classes,
        cfg.width or (32 if small else 128), cfg.depth or (2 if small else 3),
    )


def local_clients(
    run: _Run, m: int, chosen: list[int], info: RoundInfo, callback: Callback
) -> list[Reply]:
    """The in-process driver: each selected client's step on its own partition, in turn."""
    replies = []
    for k in chosen:
        x, y = run.client_data[k]
        gen = _generator(run.device, run.cfg.seed, m, k + 1)
        replies.append(run.method.client(run.model, x, y, run.client_state[k], info, gen))
        callback("client_done", {"round": m, "client": k})
    return replies


class _Run:
    """State of one training run (built fresh or from a checkpoint)."""

    def __init__(
        self, cfg: TrainConfig, device: torch.device, out: Path | None,
        ask_clients: AskClients = local_clients,
    ) -> None:
        self.cfg, self.device, self.out = cfg, device, out
        self.ask_clients = ask_clients
        self.data: Dataset = load_dataset(cfg.dataset, cfg.data_dir)
        self.parts = client_parts(cfg, self.data)
        self.sizes = [len(p) for p in self.parts]
        self.ledger = build_ledger(cfg, self.sizes)
        self.x_test = torch.from_numpy(self.data.x_test).to(device)
        self.y_test = torch.from_numpy(self.data.y_test).to(device)
        self.model_config = default_model_config(cfg, self.data)
        torch.manual_seed(cfg.seed)
        self.model = build_model(self.model_config).to(device)
        self.method = build_method(cfg, device)
        self.server_state = self.method.init_server_state(self.model, self.ledger)
        self.client_state: list[dict[str, Any]] = [{} for _ in range(cfg.clients)]
        self.history: list[dict[str, Any]] = []
        self.round = 0

    @cached_property
    def client_data(self) -> list[tuple[Tensor, Tensor]]:
        """Each client's records; built on first use (a Flower server never uses them)."""
        x = torch.from_numpy(self.data.x_train).to(self.device)
        y = torch.from_numpy(self.data.y_train).to(self.device)
        index = [torch.from_numpy(p).to(self.device) for p in self.parts]
        return [(x[i], y[i]) for i in index]

    # ---------------------------------------------------------------- persistence
    def payload(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "method": cfg.method,
            "model_state": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "model_config": self.model_config.to_dict(),
            "dataset": {"name": cfg.dataset, "data_dir": cfg.data_dir},
            "split": {
                "kind": cfg.split, "seed": cfg.seed, "alpha": cfg.dirichlet_alpha,
                "num_clients": cfg.clients,
                "client_indices": [torch.from_numpy(p) for p in self.parts],
            },
            "privacy": privacy_block(cfg, self.ledger),
            "ledger": self.ledger.to_list(),
            "config": cfg.to_dict(),
            "round": self.round,
            "history": self.history,
            "client_state": _to(self.client_state, "cpu"),
            "server_state": _to(self.server_state, "cpu"),
        }

    def restore(self, ckpt: dict[str, Any]) -> None:
        self.model.load_state_dict(ckpt["model_state"])
        self.ledger.load(ckpt["ledger"])
        self.round = int(ckpt["round"])
        self.history = list(ckpt["history"])
        self.client_state = _to(ckpt["client_state"], self.device)
        self.server_state = _to(ckpt["server_state"], self.device)

    def save(self) -> None:
        if self.out is None:
            return
        save_checkpoint(self.out / CHECKPOINT, self.payload())
        lines = "".join(json.dumps(h) + "\n" for h in self.history)
        tmp = self.out / (METRICS + ".tmp")
        tmp.write_text(lines)
        os.replace(tmp, self.out / METRICS)
        (self.out / PENDING).unlink(missing_ok=True)

    def mark_pending(self, round_: int, local_steps: int) -> None:
        """Before private data is touched: the round and the T it will be accounted for."""
        if self.out is not None:
            tmp = self.out / (PENDING + ".tmp")
            tmp.write_text(json.dumps({"round": round_, "local_steps": local_steps}))
            os.replace(tmp, self.out / PENDING)

    # ---------------------------------------------------------------- one round
    def run_round(self, m: int, local_steps: int, callback: Callback) -> dict[str, Any]:
        cfg, t0 = self.cfg, time.perf_counter()
        chosen = select_clients(cfg, m)
        info = self.method.round_info(m, self.server_state)
        replies = self.ask_clients(self, m, chosen, info, callback)
        extra: dict[str, Any] = {}
        if replies or self.method.aggregate_without_replies:
            server_gen = _generator(self.device, cfg.seed, m, 10**6)
            extra = self.method.aggregate(self.model, replies, self.server_state, info, server_gen)
        accesses = max((r.accesses for r in replies), default=0)
        entry = self.ledger.record(m, accesses, len(chosen), local_steps=local_steps)
        acc, loss = evaluate(self.model, self.x_test, self.y_test)
        upload = [r.upload_bytes for r in replies]
        return {
            "round": m, "test_accuracy": acc, "test_loss": loss,
            "epsilon": entry.epsilon, "delta": entry.delta, "rounds_spent": entry.rounds_spent,
            "accesses": accesses, "local_steps": entry.local_steps, "clients": len(chosen),
            "replies": len(replies),
            "lr": info.lr, "upload_bytes": float(np.mean(upload)) if upload else 0.0,
            **extra, "seconds": time.perf_counter() - t0,
        }


def train(
    cfg: TrainConfig,
    out_dir: str | Path | None = None,
    device: str = "auto",
    callback: Callback | None = None,
    ask_clients: AskClients = local_clients,
) -> TrainResult:
    """Start a new federated training; see the module docstring.

    Refuses an output directory that already holds a run (its ledger would be lost):
    continue that one with :func:`resume`. ``ask_clients`` is the driver of the client
    steps (in-process by default; the Flower ServerApp passes its own).
    """
    out = Path(out_dir) if out_dir is not None else None
    if out is not None and ((out / CHECKPOINT).exists() or (out / PENDING).exists()):
        raise ConfigError(f"{out} already holds a run: continue it with --resume or pick --out")
    cfg.validate()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    return _execute(_Run(cfg, resolve_device(device), out, ask_clients), callback)


def resume(
    out_dir: str | Path,
    rounds: int | None = None,
    device: str = "auto",
    callback: Callback | None = None,
    ask_clients: AskClients = local_clients,
) -> TrainResult:
    """Continue the run in ``out_dir`` (optionally to a new total of ``rounds``).

    A round that was interrupted after touching private data is entered in the ledger first.
    """
    out = Path(out_dir)
    if not (out / CHECKPOINT).exists():
        raise CheckpointError(f"nothing to resume: no {CHECKPOINT} in {out}")
    ckpt = load_checkpoint(out / CHECKPOINT)
    cfg = TrainConfig.from_dict(ckpt["config"])
    if rounds is not None:
        cfg.rounds = rounds
    cfg.validate()
    run = _Run(cfg, resolve_device(device), out, ask_clients)
    run.restore(ckpt)
    if (out / PENDING).exists():
        pending = json.loads((out / PENDING).read_text())
        steps = int(pending.get("local_steps", cfg.accesses_per_round))
        run.ledger.record(
            int(pending["round"]), steps, cfg.clients, "interrupted", local_steps=steps
        )
        run.save()
    return _execute(run, callback)


def _execute(run: _Run, callback: Callback | None) -> TrainResult:
    """Run the remaining rounds of ``run``; checkpoints after every round."""
    cfg, out = run.cfg, run.out
    callback = callback or (lambda event, info: None)
    callback("start", {"config": cfg.to_dict(), "sigma": cfg.sigma, "start_round": run.round + 1})
    stopped = "completed"
    while run.round < cfg.rounds:
        m = run.round + 1
        steps = run.method.accounted_steps(run.server_state)
        reason = run.method.stop_reason(run.server_state)
        if reason is None and cfg.target_eps is not None and run.ledger.notion != "none":
            if run.ledger.projected_epsilon(steps) > cfg.target_eps:
                reason = f"target epsilon {cfg.target_eps} would be exceeded in round {m}"
        if reason is not None:
            stopped = reason
            break
        callback("round_start", {"round": m})
        run.mark_pending(m, steps)
        metrics = run.run_round(m, steps, callback)
        run.history.append(metrics)
        run.round = m
        run.save()
        callback("round_end", metrics)
    if out is not None:
        from fedlap_privacy.fl.plots import plot_history

        plot_history(run.history, out)
    last = run.history[-1] if run.history else {}
    summary = {
        "method": cfg.method,
        "dataset": cfg.dataset,
        "rounds_run": run.round,
        "test_accuracy": last.get("test_accuracy"),
        **privacy_block(cfg, run.ledger),
        "stopped": stopped,
        "out": None if out is None else str(out),
    }
    return TrainResult(summary, run.history, run.ledger, run.model)
