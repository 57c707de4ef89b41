"""The in-process driver: rounds, client selection, evaluation, ledger, checkpoints.

One call of :func:`train` runs a whole federated training (or resumes one) with the client
and server functions of :mod:`fedlap_privacy.fl.fedlap` and :mod:`fedlap_privacy.fl.fedavg`.
Randomness comes from generators seeded by (seed, round, client), so a run is reproducible
on the CPU and a resumed run continues exactly where an uninterrupted one would be.

Privacy bookkeeping: before a round touches private data a marker file ``round.pending`` is
written; the checkpoint written after the round removes it. A run resumed after a crash
finds the marker and enters the interrupted round in the ledger (worst case, all its
accesses), so privacy spent is never lost; completed rounds are never counted twice.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
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
from fedlap_privacy.fl.fedavg import average_weights, local_training
from fedlap_privacy.fl.fedlap import (
    AugmentationDraw,
    SyntheticSet,
    client_approximation,
    init_synthetic,
    server_optimisation,
)
from fedlap_privacy.ledger import PrivacyLedger
from fedlap_privacy.models import ModelConfig, build_model

__all__ = ["CHECKPOINT", "METRICS", "TrainResult", "resolve_device", "resume", "train"]

CHECKPOINT = "ckpt.pt"
METRICS = "metrics.jsonl"
PENDING = "round.pending"

Callback = Callable[[str, dict[str, Any]], None]


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


def cosine_lr(lr0: float, round_: int, rounds: int) -> float:
    """SPEC 2.2: max(lr0 (1 + cos(pi (m-1)/(M-1)))/2, 1e-6)."""
    if rounds <= 1:
        return lr0
    return max(lr0 * (1 + math.cos(math.pi * (round_ - 1) / (rounds - 1))) / 2, 1e-6)


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


class _Run:
    """State of one training run (built fresh or from a checkpoint)."""

    def __init__(self, cfg: TrainConfig, device: torch.device, out: Path | None) -> None:
        self.cfg, self.device, self.out = cfg, device, out
        self.data: Dataset = load_dataset(cfg.dataset, cfg.data_dir)
        labels = self.data.y_train
        self.parts = split_clients(
            labels, cfg.clients, cfg.split, cfg.dirichlet_alpha, cfg.seed, self.data.num_classes
        )
        self.sizes = [len(p) for p in self.parts]
        if cfg.batch_size > min(self.sizes):
            raise ConfigError(
                f"batch size {cfg.batch_size} is larger than the smallest client "
                f"({min(self.sizes)} records)"
            )
        x = torch.from_numpy(self.data.x_train).to(device)
        y = torch.from_numpy(self.data.y_train).to(device)
        self.client_data = [(x[torch.from_numpy(p).to(device)], y[torch.from_numpy(p).to(device)])
                            for p in self.parts]
        self.x_test = torch.from_numpy(self.data.x_test).to(device)
        self.y_test = torch.from_numpy(self.data.y_test).to(device)
        small = self.data.image_size <= 8
        self.model_config = ModelConfig(
            self.data.in_channels, self.data.image_size, self.data.num_classes,
            cfg.width or (32 if small else 128), cfg.depth or (2 if small else 3),
        )
        torch.manual_seed(cfg.seed)
        self.model = build_model(self.model_config).to(device)
        self.schedule = None
        if cfg.private:
            self.schedule = FedLAPSchedule(
                batch_size=cfg.batch_size,
                client_size=min(self.sizes),
                local_steps=cfg.accesses_per_round,
                client_fraction=cfg.client_fraction,
            )
            if cfg.sigma is None:
                if cfg.target_eps is None:
                    raise ConfigError("a DP run needs --sigma, or --target-eps to plan it")
                cfg.sigma = plan_sigma(
                    self.schedule, cfg.rounds, cfg.target_eps, cfg.delta, cfg.accountant
                )
        self.ledger = PrivacyLedger(
            self.schedule, cfg.sigma if cfg.private else None,
            cfg.delta if cfg.private else None, cfg.accountant,
        )
        self.synthetic: list[SyntheticSet | None] = [None] * cfg.clients
        self.history: list[dict[str, Any]] = []
        self.round = 0

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
            "privacy": {
                "notion": self.ledger.notion,
                "epsilon": None if not cfg.private else self.ledger.epsilon,
                "delta": cfg.delta if cfg.private else None,
                "sigma": cfg.sigma if cfg.private else None,
                "accountant": cfg.accountant if cfg.private else None,
            },
            "ledger": self.ledger.to_list(),
            "config": cfg.to_dict(),
            "round": self.round,
            "history": self.history,
            "synthetic": [None if s is None else s.to_dict() for s in self.synthetic],
        }

    def restore(self, ckpt: dict[str, Any]) -> None:
        self.model.load_state_dict(ckpt["model_state"])
        self.ledger.load(ckpt["ledger"])
        self.round = int(ckpt["round"])
        self.history = list(ckpt["history"])
        self.synthetic = [
            None if s is None else SyntheticSet.from_dict(s, self.device) for s in ckpt["synthetic"]
        ]

    def save(self) -> None:
        if self.out is None:
            return
        save_checkpoint(self.out / CHECKPOINT, self.payload())
        lines = "".join(json.dumps(h) + "\n" for h in self.history)
        tmp = self.out / (METRICS + ".tmp")
        tmp.write_text(lines)
        os.replace(tmp, self.out / METRICS)
        (self.out / PENDING).unlink(missing_ok=True)

    def mark_pending(self, round_: int) -> None:
        if self.out is not None:
            tmp = self.out / (PENDING + ".tmp")
            tmp.write_text(json.dumps({"round": round_}))
            os.replace(tmp, self.out / PENDING)

    # ---------------------------------------------------------------- one round
    def run_round(self, m: int, callback: Callback) -> dict[str, Any]:
        cfg, t0 = self.cfg, time.perf_counter()
        select = _generator(torch.device("cpu"), cfg.seed, m, 0)
        chosen = [k for k in range(cfg.clients)
                  if float(torch.rand((), generator=select)) < cfg.client_fraction]
        lr = cosine_lr(cfg.lr_net, m, cfg.rounds) if cfg.is_fedlap else cfg.lr_local
        total = sum(self.sizes)
        accesses, states, sets, radii = 0, [], [], []
        augment = _augmentation(cfg) if cfg.is_fedlap else None
        for k in chosen:
            gen = _generator(self.device, cfg.seed, m, k + 1)
            x, y = self.client_data[k]
            if cfg.is_fedlap:
                syn = self.synthetic[k]
                if syn is None or cfg.reinit_each_round:
                    syn = init_synthetic(x, y, cfg.ipc, cfg.init, gen)
                update = client_approximation(self.model, x, y, syn, cfg, lr, gen, augment)
                self.synthetic[k] = update.synthetic
                sets.append(update.synthetic)
                radii.append(update.suggested_radius)
                used = update.accesses
            else:
                state, used = local_training(self.model, x, y, cfg, lr, gen)
                states.append(state)
            accesses = max(accesses, used)
            callback("client_done", {"round": m, "client": k})
        weights = [self.sizes[k] / total for k in chosen]
        server_steps, radius = 0, None
        if chosen and cfg.is_fedlap:
            radius = _server_radius(cfg, radii)
            server_steps = server_optimisation(
                self.model, sets, weights, radius, lr, cfg.server_epochs, cfg.server_batch,
                _generator(self.device, cfg.seed, m, 10**6), cfg.server_momentum, augment,
            )
        elif chosen:
            self.model.load_state_dict(average_weights(states, weights))
        entry = self.ledger.record(m, accesses, len(chosen))
        acc, loss = evaluate(self.model, self.x_test, self.y_test)
        return {
            "round": m, "test_accuracy": acc, "test_loss": loss,
            "epsilon": entry.epsilon, "delta": entry.delta, "rounds_spent": entry.rounds_spent,
            "accesses": accesses, "clients": len(chosen), "lr": lr,
            "server_steps": server_steps, "radius": radius,
            "seconds": time.perf_counter() - t0,
        }


def _server_radius(cfg: TrainConfig, suggested: list[float | None]) -> float | None:
    rule = cfg.radius_rule
    if rule == "iterations":
        return None
    values = [r for r in suggested if r is not None]
    if rule == "fixed" or not values:
        return cfg.radius
    return float({"min": np.min, "max": np.max, "median": np.median}[rule](values))


def _augmentation(cfg: TrainConfig) -> AugmentationDraw | None:
    """Differentiable siamese augmentation (SPEC 2.1), on in all of the authors' runs."""
    if not cfg.dsa:
        return None
    from fedlap_privacy.fl.augment import DSA

    return DSA().draw


def train(
    cfg: TrainConfig,
    out_dir: str | Path | None = None,
    device: str = "auto",
    callback: Callback | None = None,
) -> TrainResult:
    """Start a new federated training; see the module docstring.

    Refuses an output directory that already holds a run (its ledger would be lost):
    continue that one with :func:`resume`.
    """
    out = Path(out_dir) if out_dir is not None else None
    if out is not None and ((out / CHECKPOINT).exists() or (out / PENDING).exists()):
        raise ConfigError(f"{out} already holds a run: continue it with --resume or pick --out")
    cfg.validate()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    return _execute(_Run(cfg, resolve_device(device), out), callback)


def resume(
    out_dir: str | Path,
    rounds: int | None = None,
    device: str = "auto",
    callback: Callback | None = None,
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
    run = _Run(cfg, resolve_device(device), out)
    run.restore(ckpt)
    if (out / PENDING).exists():
        interrupted = int(json.loads((out / PENDING).read_text())["round"])
        run.ledger.record(interrupted, cfg.accesses_per_round, cfg.clients, "interrupted")
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
        if cfg.target_eps is not None and cfg.private:
            if run.ledger.epsilon_after(run.ledger.rounds_spent + 1) > cfg.target_eps:
                stopped = f"target epsilon {cfg.target_eps} would be exceeded in round {m}"
                break
        callback("round_start", {"round": m})
        run.mark_pending(m)
        metrics = run.run_round(m, callback)
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
        "epsilon": run.ledger.epsilon if cfg.private else None,
        "delta": cfg.delta if cfg.private else None,
        "sigma": cfg.sigma if cfg.private else None,
        "notion": run.ledger.notion,
        "stopped": stopped,
        "out": None if out is None else str(out),
    }
    return TrainResult(summary, run.history, run.ledger, run.model)
