"""FedLAP and FedLAP-DP: client local approximation and server global optimisation.

Client (paper Algorithm 3, docs/algorithms.md#fedlap-dp-client): learn a small synthetic set
S_k whose gradients match
the client's (DP) real-data gradients along trajectories that stay inside a trust region of
radius r around the global weights. Server (Eq. 14/16,
docs/algorithms.md#server-global-optimisation): train the global model on
the union of the synthetic sets, weighted by N_k/N, until the weights reach the radius.

Privacy: in FedLAP-DP the only access to private data is
:func:`fedlap_privacy.fl.methods.dp.dp_gradient` on a Poisson batch; everything after it (image
updates, local steps on S_k) is post-processing. A client-round makes at most ``reinits * max_loops
* real_batches`` such accesses, which is the T the accountant composes. Synthetic labels are fixed
and balanced over the classes the client holds (its class list and size N_k are public metadata, as
in the paper).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlap_privacy.compute.kernels import winograd
from fedlap_privacy.compute.second_order import (
    Blocks,
    supported_blocks,
    weight_grad,
    weight_grad_input_vjp,
)
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.phase_timer import phase
from fedlap_privacy.fl.engine.progress import report_step
from fedlap_privacy.fl.methods.augment import DSA, NO_AUGMENTATION, DrawnAugmentation
from fedlap_privacy.fl.methods.dp import batch_rate, dp_gradient, poisson_sample
from fedlap_privacy.fl.methods.interface import Method, Reply, RoundInfo, State, weights_of
from fedlap_privacy.fl.methods.matching import MatchTarget
from fedlap_privacy.fl.methods.trust_region import clone_params, distance, project_to_ball

__all__ = [
    "ClientUpdate",
    "FedLAP",
    "SyntheticSet",
    "client_approximation",
    "cosine_lr",
    "init_synthetic",
    "server_optimisation",
]

#: draws one augmentation (the same for real and synthetic batches) from a generator
AugmentationDraw = Callable[[torch.Generator], Callable[[Tensor], Tensor]]


@dataclass
class SyntheticSet:
    """A client's synthetic images with fixed, balanced labels (never optimised)."""

    images: Tensor  # (n, C, H, W)
    labels: Tensor  # (n,) int64

    def to_dict(self) -> dict[str, Tensor]:
        return {"images": self.images.detach().cpu(), "labels": self.labels.cpu()}

    @classmethod
    def from_dict(cls, d: dict[str, Tensor], device: torch.device) -> SyntheticSet:
        return cls(d["images"].to(device), d["labels"].to(device))


@dataclass
class ClientUpdate:
    synthetic: SyntheticSet
    accesses: int  # accesses to private data actually made (<= reinits*max_loops*real_batches)
    suggested_radius: float | None  # non-private FedLAP only


def init_synthetic(
    x: Tensor, y: Tensor, ipc: int, init: str, generator: torch.Generator
) -> SyntheticSet:
    """``ipc`` images per class the client holds: N(0,1) noise, or real images (non-private)."""
    classes = torch.unique(y)
    labels = classes.repeat_interleave(ipc)
    if init == "noise":
        shape = (labels.numel(), *x.shape[1:])
        images = torch.randn(shape, generator=generator, device=generator.device).to(x)
    else:
        picks = []
        for c in classes:
            idx = torch.nonzero(y == c).flatten()
            order = torch.randperm(idx.numel(), generator=generator, device=generator.device)
            picks.append(idx[order.to(idx.device)[:ipc]].repeat(math.ceil(ipc / idx.numel()))[:ipc])
        images = x[torch.cat(picks)].clone()
    return SyntheticSet(images, labels.to(x.device))


def _real_gradient(
    model: nn.Module, x: Tensor, y: Tensor, cfg: TrainConfig, generator: torch.Generator
) -> list[Tensor]:
    """g_real: the DP gradient (FedLAP-DP) or the plain mean gradient (FedLAP)."""
    if cfg.private:
        assert cfg.sigma is not None
        return dp_gradient(model, x, y, cfg.clip, cfg.sigma, cfg.batch_size, generator)
    loss = F.cross_entropy(model(x), y)
    return [g.detach() for g in torch.autograd.grad(loss, list(model.parameters()))]


def structurally_zero(model: nn.Module) -> list[bool]:
    """Per parameter: True where its gradient is zero for every input
    (docs/algorithms.md#matching-distance).

    A conv bias followed by a GroupNorm with one channel per group is removed by the
    normalisation, so its true gradient is identically zero; with DP its released gradient
    is pure noise, which must not be matched. Decided from the architecture, not the data.
    """
    flags: dict[int, bool] = {}
    modules = list(model.modules())
    for current, following in itertools.pairwise(modules):
        if (isinstance(current, nn.Conv2d) and current.bias is not None
                and isinstance(following, nn.GroupNorm)
                and following.num_groups == following.num_channels):
            flags[id(current.bias)] = True
    return [flags.get(id(p), False) for p in model.parameters()]


def _loss_grad(model: nn.Module, blocks: Blocks | None,
               x: Tensor, y: Tensor, weights: Tensor | None = None) -> list[Tensor]:
    """The gradient of the batch-mean cross-entropy (``sum_i w_i CE_i / sum_i w_i`` with
    ``weights``) with respect to ``model.parameters()``: written out for the ConvNet on the
    CPU (``blocks``, :func:`fedlap_privacy.compute.second_order.weight_grad`), by autograd
    elsewhere; the same up to rounding."""
    if blocks is not None:
        return weight_grad(model, blocks, x, y, weights)
    with torch.enable_grad():
        logits = model(x)
        if weights is None:
            loss = F.cross_entropy(logits, y)
        else:
            loss = (F.cross_entropy(logits, y, reduction="none") * weights).sum() / weights.sum()
        return list(torch.autograd.grad(loss, list(model.parameters())))


def _model_steps(
    model: nn.Module, syn: SyntheticSet, steps: int, lr: float, anchor: list[Tensor], radius: float
) -> bool:
    """``steps`` SGD steps on the synthetic set; True if the trust region was reached."""
    params = list(model.parameters())
    blocks = supported_blocks(model, syn.images)
    for _ in range(steps):
        grads = _loss_grad(model, blocks, syn.images, syn.labels)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.sub_(lr * g)
        if project_to_ball(model, anchor, radius):
            return True
    return False


def _matching_gradient(
    model: nn.Module, images: Tensor, labels: Tensor, aug: Callable[[Tensor], Tensor],
    target: MatchTarget, include: list[bool], blocks: Blocks | None,
) -> Tensor:
    """dL_dis/d images for one synthetic-image update (Eq. 9-10 through the augmentation).

    With ``blocks`` (:func:`fedlap_privacy.compute.second_order.supported_blocks`: the package's
    ConvNet on the CPU) and a DSA draw, the second-order pass is written out
    (:func:`fedlap_privacy.compute.second_order.weight_grad_input_vjp`), and so is the
    augmentation's (:meth:`~fedlap_privacy.fl.methods.augment.DrawnAugmentation.vjp`);
    elsewhere autograd differentiates its own backward graph (``create_graph=True``). Both
    compute the same gradient up to rounding.
    """
    if blocks is None or not isinstance(aug, DrawnAugmentation):
        leaf = images.detach().requires_grad_(True)
        params = list(model.parameters())
        matched = [p for p, keep in zip(params, include, strict=True) if keep]
        with torch.enable_grad():
            loss = F.cross_entropy(model(aug(leaf)), labels)
            g_syn = torch.autograd.grad(loss, matched, create_graph=True)
            return torch.autograd.grad(target.distance(g_syn), [leaf])[0]

    def adjoint(grads: list[Tensor]) -> list[Tensor | None]:
        u = iter(target.gradient([g for g, keep in zip(grads, include, strict=True) if keep]))
        return [next(u) if keep else None for keep in include]

    with torch.no_grad():
        images = images.detach()
        bar_x = weight_grad_input_vjp(model, blocks, aug(images), labels, adjoint)
        return aug.vjp(images, bar_x)


def client_approximation(
    global_model: nn.Module,
    x: Tensor,
    y: Tensor,
    syn: SyntheticSet,
    cfg: TrainConfig,
    lr_net: float,
    generator: torch.Generator,
    augment: AugmentationDraw | None,
) -> ClientUpdate:
    """Algorithm 3: refine ``syn`` so its gradients match the client's along trajectories.

    ``x, y`` is the client's private data (on the model's device). Returns the new synthetic
    set, the number of private-data accesses made, and (non-private only) the radius the
    client suggests.
    """
    anchor = clone_params(global_model)
    model = copy.deepcopy(global_model)
    params = list(model.parameters())
    images = syn.images.detach().clone().requires_grad_(True)
    opt = torch.optim.SGD([images], lr=cfg.lr_img, momentum=cfg.img_momentum)
    rate = batch_rate(cfg.batch_size, x.shape[0], accounted=cfg.private)
    include = [not zero for zero in structurally_zero(model)]
    blocks = supported_blocks(model, images)  # the written-out second-order pass applies
    accesses, total = 0, cfg.reinits * cfg.max_loops * cfg.real_batches
    for _ in range(cfg.reinits):
        with torch.no_grad():
            for p, a in zip(params, anchor, strict=True):
                p.copy_(a)
        for _ in range(cfg.max_loops):
            if distance(model, anchor) >= cfg.radius:
                break
            for _ in range(cfg.real_batches):
                aug = augment(generator) if augment is not None else NO_AUGMENTATION
                batch = poisson_sample(x.shape[0], rate, generator).to(x.device)
                # the model stands still for one real batch: its kernels transformed once
                with winograd.shared_kernel_tiles():
                    with phase("real gradients"):
                        g_real = _real_gradient(model, aug(x[batch]), y[batch], cfg, generator)
                    accesses += 1
                    with phase("matching"):
                        # the real side of L_dis once per real batch, reused by the R_s updates
                        target = MatchTarget(g_real, cfg.mse_weight, include=include)
                        for _ in range(cfg.syn_steps):
                            images.grad = _matching_gradient(model, images, syn.labels, aug,
                                                             target, include, blocks)
                            opt.step()
                report_step(accesses, total)  # at most T: a loop may stop at the radius
            current = SyntheticSet(images.detach(), syn.labels)
            with phase("local steps"):
                reached = _model_steps(model, current, cfg.local_model_steps, lr_net, anchor,
                                       cfg.radius)
            if reached:
                break
    learned = SyntheticSet(images.detach(), syn.labels)
    suggested = None
    if not cfg.private and cfg.radius_rule in ("min", "max", "median"):
        suggested = suggest_radius(global_model, learned, x, y, cfg, lr_net)
    return ClientUpdate(learned, accesses, suggested)


def suggest_radius(
    global_model: nn.Module,
    syn: SyntheticSet,
    x: Tensor,
    y: Tensor,
    cfg: TrainConfig,
    lr_net: float,
    max_eval: int = 2048,
) -> float:
    """Non-private FedLAP: the distance at which training on S_k gave the lowest real loss.

    Trains from w_g on the client's own synthetic set, evaluating the loss on (up to
    ``max_eval``) real records after every step; capped at ``cfg.radius``
    (docs/algorithms.md#radius-rules).
    """
    anchor = clone_params(global_model)
    model = copy.deepcopy(global_model)
    xs, ys = x[:max_eval], y[:max_eval]

    def real_loss() -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model(xs), ys))

    best_loss, best_dist = real_loss(), 0.0
    for _ in range(cfg.server_epochs):
        reached = _model_steps(model, syn, 1, lr_net, anchor, cfg.radius)
        loss = real_loss()
        if loss < best_loss:
            best_loss, best_dist = loss, distance(model, anchor)
        if reached:
            break
    return min(best_dist, cfg.radius) if best_dist > 0 else cfg.radius


def server_optimisation(
    model: nn.Module,
    sets: list[SyntheticSet],
    weights: list[float],
    radius: float | None,
    lr: float,
    epochs: int,
    batch_size: int,
    generator: torch.Generator,
    momentum: float = 0.0,
    augment: AugmentationDraw | None = None,
) -> int:
    """Eq. 14/16: minimise sum_k (N_k/N) loss(w, S_k) from w_g until ||w - w_g|| hits ``radius``.

    Each synthetic record of client k weighs (N_k/N)/|S_k|; a mini-batch's loss is its
    weighted mean, augmented by a fresh DSA draw per step when ``augment`` is given (as in the
    authors' code). The radius is checked after every step and never exceeded; ``radius``
    None runs the iteration cap (``epochs`` passes). Returns the number of steps taken.
    """
    anchor = clone_params(model)
    images = torch.cat([s.images for s in sets])
    labels = torch.cat([s.labels for s in sets])
    record_w = torch.cat(
        [torch.full((len(s.labels),), w / len(s.labels), dtype=images.dtype, device=images.device)
         for s, w in zip(sets, weights, strict=True)]
    )
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, fused=_fused_sgd(model))
    blocks = supported_blocks(model, images)
    steps = 0
    for _ in range(epochs):
        order = torch.randperm(len(labels), generator=generator, device=generator.device)
        for start in range(0, len(labels), batch_size):
            idx = order[start : start + batch_size].to(images.device)
            batch = images[idx] if augment is None else augment(generator)(images[idx])
            grads = _loss_grad(model, blocks, batch, labels[idx], record_w[idx])
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            opt.step()
            steps += 1
            if radius is not None and project_to_ball(model, anchor, radius):
                return steps
    return steps


def _fused_sgd(model: nn.Module) -> bool | None:
    """torch's fused SGD kernel (the same update as the per-tensor loop, one call) where it
    exists: floating-point parameters on the CPU or CUDA."""
    params = list(model.parameters())
    return True if params and all(p.is_floating_point() and p.device.type in ("cpu", "cuda")
                                  for p in params) else None


def cosine_lr(lr0: float, round_: int, rounds: int, schedule: str = "cosine") -> float:
    """The rate of round m of M (docs/algorithms.md#learning-rate), floored at 1e-6.

    ``"cosine"`` (the authors'): lr0 (1 + cos(pi (m-1)/(M-1)))/2, which is lr0 in the first
    round and the floor in the last. ``"cosine-open"``: lr0 (1 + cos(pi (m-1)/M))/2, torch's
    ``CosineAnnealingLR`` with T_max = M stepped once per round, whose last round keeps
    lr0 (1 - cos(pi/M))/2 (a quarter of lr0 at M = 3).
    """
    if schedule == "cosine-open":
        span = rounds
    elif rounds <= 1:
        return lr0
    else:
        span = rounds - 1
    return max(lr0 * (1 + math.cos(math.pi * (round_ - 1) / span)) / 2, 1e-6)


def server_radius(cfg: TrainConfig, suggested: list[float | None]) -> float | None:
    """The radius of Eq. 16: fixed, a statistic of the clients' suggestions, or None."""
    rule = cfg.radius_rule
    if rule == "iterations":
        return None
    values = [r for r in suggested if r is not None]
    if rule == "fixed" or not values:
        return cfg.radius
    return float({"min": np.min, "max": np.max, "median": np.median}[rule](values))


class FedLAP(Method):
    """FedLAP / FedLAP-DP: clients upload synthetic sets, the server trains on them.

    Node-local state: the client's synthetic set, refined across rounds (unless
    ``reinit_each_round``). Differentiable siamese augmentation
    (docs/algorithms.md#differentiable-siamese-augmentation) is on in all of
    the authors' runs (``dsa``).
    """

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self.augment: AugmentationDraw | None = None
        if cfg.dsa:
            self.augment = DSA().draw

    def _augment_for(self, x: Tensor) -> AugmentationDraw | None:
        """DSA for images ``(N, C, H, W)``; feature rows (tabular data) are never augmented:
        DSA's flips, crops and colour jitter have no meaning for them."""
        return self.augment if x.dim() == 4 else None

    def probe_config(self) -> tuple[TrainConfig, int]:
        """One loop (R_i = L_max = 1): its R_b real batches with their R_s synthetic updates,
        and its R_l model steps, which a run makes once per R_b accesses."""
        return dataclasses.replace(self.cfg, reinits=1, max_loops=1), self.cfg.real_batches

    def lr(self, round_: int) -> float:
        return cosine_lr(self.cfg.lr_net, round_, self.cfg.rounds, self.cfg.lr_schedule)

    def client(
        self, model: nn.Module, x: Tensor, y: Tensor, state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> Reply:
        cfg = self.cfg
        if "synthetic" in state and not cfg.reinit_each_round:
            syn = SyntheticSet.from_dict(state["synthetic"], x.device)
        else:
            syn = init_synthetic(x, y, cfg.ipc, cfg.init, generator)
        update = client_approximation(model, x, y, syn, cfg, info.lr, generator,
                                      self._augment_for(x))
        learned = update.synthetic
        state["synthetic"] = {"images": learned.images, "labels": learned.labels}
        stats = {} if update.suggested_radius is None else {"radius": update.suggested_radius}
        return Reply(dict(state["synthetic"]), update.accesses, len(y), stats)

    def aggregate(
        self, model: nn.Module, replies: list[Reply], server_state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> dict[str, Any]:
        cfg = self.cfg
        sets = [SyntheticSet(r.payload["images"], r.payload["labels"]) for r in replies]
        radius = server_radius(cfg, [r.stats.get("radius") for r in replies])
        steps = server_optimisation(
            model, sets, weights_of(replies), radius, cfg.server_lr * info.lr, cfg.server_epochs,
            cfg.server_batch, generator, cfg.server_momentum,
            self._augment_for(sets[0].images) if sets else None,
        )
        return {"server_steps": steps, "radius": radius}
