"""Client-level DP-FedAvg, fixed or adaptive clipping (docs/algorithms.md#dp-fedavg-client-level).

McMahan, Ramage, Talwar, Zhang 2018, "Learning differentially private recurrent language
models" (DP-FedAvg); adaptive clipping from Andrew, Thakkar, McMahan, Ramaswamy 2021,
"Differentially private learning with adaptive clipping".

Threat model: TRUSTED SERVER (as DP-NormFedAvg). The server sees each client's clipped update
in the clear and adds the noise itself; the epsilon holds for one client's whole dataset
against those who see the released models, never against the server.

Contract — the mechanism :mod:`fedlap_privacy.accountant.client_level` prices:

* Neighbouring datasets: add/remove ONE CLIENT (all of its records).
* Sampling (the driver, :func:`fedlap_privacy.fl.engine.client_sampling.select_clients`, from
  secret randomness): Poisson at ``client_fraction`` q, or ``clients_per_round`` K drawn
  uniformly without replacement; the latter is accounted at rate K/n with twice the
  sensitivity (the ledger's sigma is sigma / 2).
* Client: ``local_steps`` non-private local SGD steps from w_g (FedAvg's
  :func:`~fedlap_privacy.fl.methods.fedavg.local_training`), then its update
  ``Delta_k = w_k - w_g`` over ALL parameters flattened into one vector, clipped to the
  round's norm ``C_t`` (``Delta_k * min(1, C_t / ||Delta_k||)``). With adaptive clipping it
  also reports ``b_k = 1[||Delta_k|| <= C_t]``. One client-level access per round. The
  in-process driver may train a cohort's local steps at once (:meth:`DPFedAvgClient.cohort_client`,
  :mod:`fedlap_privacy.fl.engine.cohort`: each client's batches from its own generator, as in the
  loop) and then clips each update as above; the same uploads up to rounding.
* Server: re-clips every upload to ``C_t`` (so the bound holds whatever arrives), adds ONE
  draw of ``N(0, sigma_u^2 C_t^2 I)`` to the SUM, divides by the EXPECTED cohort (q n, or K: a
  public constant, never the realised count) and steps
  ``w_g += server_lr * (sum_k Delta_k + noise) / m``. Uniform weights: N_k / N weights would
  let a client's size change its sensitivity.
* Fixed clipping: ``C_t = clip`` and ``sigma_u = sigma``.
* Adaptive clipping (``clip_quantile`` gamma): the server also releases
  ``b = (sum_k (b_k - 1/2) + N(0, sigma_b^2)) / m + 1/2`` and sets
  ``C_{t+1} = C_t exp(-clip_lr (b - gamma))`` (Andrew et al.'s geometric update), so C follows
  the gamma-quantile of the update norms. ``sigma`` is the multiplier the run is ACCOUNTED
  with; the update noise is ``sigma_u = (sigma^-2 - (2 sigma_b)^-2)^-1/2``
  (:func:`~fedlap_privacy.accountant.client_level.update_sigma`), ``sigma_b`` =
  ``clip_count_sigma`` (default max(m / 20, sigma)). ``C_t`` is computed from released
  noisy values only (post-processing) and is broadcast to the clients.

Over secure aggregation (``secure_aggregation``, :mod:`fedlap_privacy.fl.secure_sum.training`)
the server never sees an update: each client's clipped upload is encoded with its own integer
noise share and masked, the server decodes only the sum and steps with
:meth:`DPFedAvgClient.step_on_sum` (no server noise); the epsilon then also holds against the
server (distributed DP, ``fedlap_privacy.accountant.distributed``). Fixed clipping only.

A round in which no client was selected still releases noise (``aggregate_without_replies``).
The amplification by sampling holds against observers of the models who do not know who
was selected, so the release (``ckpt.pt``, ``metrics.jsonl``) withholds who was selected in
each round and how many (:mod:`fedlap_privacy.fl.run.released_metrics`); the server, trusted,
knows it. ``sigma = 0`` adds no noise (unit tests only: ``TrainConfig.validate`` refuses it).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from fedlap_privacy.accountant.client_level import update_sigma
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.engine.cohort import ClientBatches, cohort_local_sgd
from fedlap_privacy.fl.methods.dp import add_gaussian_noise
from fedlap_privacy.fl.methods.fedavg import local_training
from fedlap_privacy.fl.methods.interface import Method, Reply, RoundInfo, State
from fedlap_privacy.state.ledger import PrivacyLedger

__all__ = ["BELOW_CLIP", "DPFedAvgClient", "clip_update", "update_norm"]

#: the payload key of the adaptive-clipping indicator b_k (not a parameter name: no dot)
BELOW_CLIP = "_below_clip"


def update_norm(update: dict[str, Tensor]) -> float:
    """L2 norm of all tensors of ``update`` flattened into one vector (in float64)."""
    return math.sqrt(sum(float(t.double().square().sum()) for t in update.values()))


def clip_update(update: dict[str, Tensor], clip: float) -> tuple[dict[str, Tensor], float]:
    """``update * min(1, clip / ||update||)`` (McMahan et al. 2018) and the norm before."""
    norm = update_norm(update)
    if norm <= clip:
        return dict(update), norm
    scale = clip / norm
    return {k: (t.double() * scale).to(t.dtype) for k, t in update.items()}, norm


def _round_clip(info: RoundInfo) -> float:
    clip = info.extras.get("clip")
    if isinstance(clip, bool) or not isinstance(clip, int | float) or not (
            math.isfinite(clip) and clip > 0):
        raise ConfigError(f"the round's clip norm {clip!r} must be a finite number > 0")
    return float(clip)


class DPFedAvgClient(Method):
    """Client-level DP-FedAvg (module docstring): clipped client updates, Gaussian noise on
    their sum added by the (trusted) server, fixed or adaptive clip norm."""

    aggregate_without_replies = True
    #: q n or K (public), the clip norm broadcast and the noisy fraction below it (DP releases)
    public_extras = ("expected_clients", "clip", "below_clip_fraction")

    @property
    def adaptive(self) -> bool:
        return self.cfg.clip_quantile is not None

    def init_server_state(self, model: nn.Module, ledger: PrivacyLedger) -> State:
        return {"clip": float(self.cfg.clip)}

    def extras(self, server_state: State) -> dict[str, Any]:
        return {"clip": float(server_state["clip"])}

    def noise_multiplier(self) -> float:
        """sigma_u: the noise on the update sum, per unit of C_t (module docstring)."""
        sigma = self.cfg.sigma
        if sigma is None:  # planned by build_ledger before any round; never skip noise
            raise ConfigError("dp-fedavg-client needs its noise multiplier sigma")
        if sigma == 0 or not self.adaptive:
            return float(sigma)
        return update_sigma(float(sigma), self.cfg.clip_count_noise)

    def client(
        self, model: nn.Module, x: Tensor, y: Tensor, state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> Reply:
        cfg, clip = self.cfg, _round_clip(info)
        # non-private local steps (the protection is client-level): the batch rate only has
        # to be a valid probability for a client smaller than B
        batch = min(float(cfg.batch_size), float(x.shape[0]))
        trained, _ = local_training(
            model, x, y, steps=cfg.local_steps, lr=info.lr, batch_size=batch,
            generator=generator, dp=None,
        )
        start = dict(model.named_parameters())
        update = {k: p.detach() - start[k].detach() for k, p in trained.named_parameters()}
        return self._clipped_reply(update, clip, len(y))

    def vectorises(self) -> bool:
        """The local steps are FedAvg's, without record-level noise: the cohort trains at once
        (:meth:`cohort_client`)."""
        return True

    def cohort_client(
        self, model: nn.Module, x: Tensor, y: Tensor, indices: list[Tensor], info: RoundInfo,
        generators: list[torch.Generator], *, packed: bool = False,
    ) -> list[Reply]:
        """:meth:`client` for a whole cohort: the local steps of all its clients together
        (:func:`~fedlap_privacy.fl.engine.cohort.cohort_local_sgd`, each client's batches from its
        own generator at its own rate min(B, N_k) / N_k), then each update clipped as
        :meth:`client` clips it."""
        cfg, clip = self.cfg, _round_clip(info)
        clients = [ClientBatches.draw(index, cfg.local_steps,
                                      min(float(cfg.batch_size), float(index.numel())), gen)
                   for index, gen in zip(indices, generators, strict=True)]
        states = cohort_local_sgd(model, x, y, clients, lr=info.lr, packed=packed)
        start = {k: p.detach() for k, p in model.named_parameters()}
        return [self._clipped_reply({k: state[k] - w for k, w in start.items()}, clip,
                                    int(index.numel()))
                for state, index in zip(states, indices, strict=True)]

    def _clipped_reply(self, update: dict[str, Tensor], clip: float, records: int) -> Reply:
        """The client's upload: its update clipped to the round's norm, with adaptive
        clipping's b_k = 1[||Delta_k|| <= C_t]; one client-level access."""
        payload, norm = clip_update(update, clip)
        if self.adaptive:
            payload[BELOW_CLIP] = torch.tensor(1.0 if norm <= clip else 0.0)
        return Reply(payload, 1, records)

    def step_on_sum(self, model: nn.Module, total: Tensor) -> None:
        """Over secure aggregation: the server's step on the decoded noisy sum of the clipped
        updates (flat, in ``named_parameters`` order; the noise came from the clients),
        ``w_g += server_lr * total / m`` with m the expected cohort (public)."""
        scale = self.cfg.server_lr / self.cfg.sampling.expected_cohort
        offset = 0
        with torch.no_grad():
            for p in model.parameters():
                piece = total[offset:offset + p.numel()].view_as(p)
                p.add_(piece.to(p.device, p.dtype), alpha=scale)
                offset += p.numel()

    def aggregate(
        self, model: nn.Module, replies: list[Reply], server_state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> dict[str, Any]:
        cfg = self.cfg
        clip, sigma_u = float(server_state["clip"]), self.noise_multiplier()
        expected = cfg.sampling.expected_cohort  # q n or K, public
        params = dict(model.named_parameters())
        below = 0.0
        uploads = []
        for r in replies:  # the server enforces the bound whatever a client sent
            update = {name: r.payload[name] for name in params}
            clipped, norm = clip_update(update, clip)
            flag = r.payload.get(BELOW_CLIP)
            # an indicator is 0 or 1 whatever was sent (the count's sensitivity is 1/2)
            below += float(norm <= clip) if flag is None else float(float(flag) > 0.5)
            uploads.append(clipped)
        with torch.no_grad():
            for name, p in params.items():  # noise drawn per parameter in a fixed order
                total = torch.zeros_like(p)
                for u in uploads:
                    total += u[name].to(p.device, p.dtype)
                total = add_gaussian_noise(total, sigma_u * clip, generator)
                p.add_(total, alpha=cfg.server_lr / expected)
        metrics: dict[str, Any] = {"expected_clients": expected, "clip": clip}
        if self.adaptive:
            assert cfg.clip_quantile is not None
            count = below - 0.5 * len(replies)  # sum of b_k - 1/2: sensitivity 1/2
            if cfg.sigma:
                count = float(add_gaussian_noise(
                    torch.tensor(count, dtype=torch.float64), cfg.clip_count_noise, generator))
            fraction = count / expected + 0.5
            server_state["clip"] = clip * math.exp(-cfg.clip_lr * (fraction - cfg.clip_quantile))
            metrics["below_clip_fraction"] = fraction  # noisy: a DP release
        return metrics
