"""One interface for every training method, shared by both drivers (in-process and Flower).

A round m of any method is the same conversation:

1. the server sends each selected client the global weights and :class:`RoundInfo` (the
   round, its learning rate, and the method's public ``extras``, e.g. SCAFFOLD's control
   variate or ALI-DPFL's tau);
2. the client runs :meth:`Method.client` on its private data and its node-local ``state``
   (kept across rounds by the driver: the synthetic set, a control variate) and answers
   with a :class:`Reply` — what travels back, the accesses to private data it made, its
   size N_k (public metadata) and public scalars;
3. the server folds the replies into the global model with :meth:`Method.aggregate`.

The driver (``simulation.py``, ``flower_app.py``) owns everything else: client selection,
generators, the privacy ledger (it enters :meth:`Method.accounted_steps` per round),
evaluation and checkpoints. Method states are dicts of tensors and plain values, so a
checkpoint or a Flower record holds them without pickling code.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.methods.method_table import method_spec
from fedlap_privacy.state.ledger import PrivacyLedger

__all__ = ["Method", "Reply", "RoundInfo", "build_method", "weights_of"]

State = dict[str, Any]


@dataclass
class RoundInfo:
    """What the server broadcasts beside the weights (all public)."""

    round: int
    rounds: int
    lr: float
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reply:
    """A client's answer for one round."""

    payload: dict[str, Tensor]  # what travels to the server
    accesses: int  # accesses to private data made (SGM releases)
    num_examples: int  # N_k, public metadata used for N_k / N weights
    stats: dict[str, float] = field(default_factory=dict)  # public scalars

    @property
    def upload_bytes(self) -> int:
        """Bytes the client uploads: its payload tensors plus 8 bytes per scalar."""
        tensors = sum(t.numel() * t.element_size() for t in self.payload.values())
        return tensors + 8 * len(self.stats)


def weights_of(replies: list[Reply]) -> list[float]:
    """N_k / N over the replying clients (docs/algorithms.md#fedavg)."""
    total = sum(r.num_examples for r in replies)
    return [r.num_examples / total for r in replies]


class Method(ABC):
    """A federated method: client step, server step, and what it needs of the driver."""

    #: the server step runs even when no client was selected (a server-side noise release
    #: must happen whoever took part, as the sampled Gaussian mechanism assumes)
    aggregate_without_replies: ClassVar[bool] = False
    #: the server step's metrics that reveal nothing of who was selected (the noisy
    #: mechanism's own broadcasts, public constants): released where the selection is
    #: hidden (:mod:`fedlap_privacy.fl.run.released_metrics`); the others are withheld there
    public_extras: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device

    def init_server_state(self, model: nn.Module, ledger: PrivacyLedger) -> State:
        """The server's state before round 1 (the ledger tells the accounting it runs under)."""
        return {}

    def lr(self, round_: int) -> float:
        return self.cfg.lr_local

    def round_info(self, round_: int, server_state: State) -> RoundInfo:
        """The public broadcast of round ``round_`` (override ``extras`` to add to it)."""
        return RoundInfo(round_, self.cfg.rounds, self.lr(round_), self.extras(server_state))

    def extras(self, server_state: State) -> dict[str, Any]:
        return {}

    def accounted_steps(self, server_state: State) -> int:
        """T this round is accounted for in the ledger (worst-case accesses per client)."""
        return self.cfg.accesses_per_round

    def stop_reason(self, server_state: State) -> str | None:
        """Why the method stops before the next round (its own budget), or None."""
        return None

    @abstractmethod
    def client(
        self,
        model: nn.Module,
        x: Tensor,
        y: Tensor,
        state: State,
        info: RoundInfo,
        generator: torch.Generator,
    ) -> Reply:
        """One client round on its private data ``x, y``; may update its node-local ``state``."""

    def probe_config(self) -> tuple[TrainConfig, int] | None:
        """This method's configuration cut to a short client step, and the accesses to the
        data it makes, for timing the method on this machine before round 1
        (:mod:`~fedlap_privacy.fl.engine.progress`); None: the method is not timed."""
        return None

    def vectorises(self) -> bool:
        """Whether :meth:`cohort_client` trains a cohort at once (False: one by one)."""
        return False

    def cohort_client(
        self,
        model: nn.Module,
        x: Tensor,
        y: Tensor,
        indices: list[Tensor],
        info: RoundInfo,
        generators: list[torch.Generator],
        *,
        packed: bool = False,
    ) -> list[Reply]:
        """The client steps of a whole cohort at once, where the method can vectorise them
        (:mod:`fedlap_privacy.fl.engine.cohort`): client j holds records ``indices[j]`` of the
        training set ``x, y`` and draws from ``generators[j]``; the replies must equal
        :meth:`client`'s one by one up to rounding. ``packed``: the clients' ConvNets packed
        into one network (:mod:`fedlap_privacy.fl.engine.packed_cohort`), else ``vmap``. Called
        only when :meth:`vectorises`; only for methods without node-local state."""
        raise NotImplementedError(f"{self.cfg.method} trains its clients one by one")

    @abstractmethod
    def aggregate(
        self,
        model: nn.Module,
        replies: list[Reply],
        server_state: State,
        info: RoundInfo,
        generator: torch.Generator,
    ) -> dict[str, Any]:
        """Update ``model`` (and ``server_state``) in place; returns metrics for the round."""


def build_method(cfg: TrainConfig, device: torch.device) -> Method:
    """The method of ``cfg``, its class imported from the method table on use."""
    module, name = method_spec(cfg.method).implementation.split(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(cfg, device)
