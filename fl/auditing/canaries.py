"""Canaries for one-run audits: inserted during training, each with a secret coin.

``train --canaries M`` builds a :class:`CanarySet` before round 1: M canaries, each included
independently with probability 1/2 (the secret bits S_i of Steinke, Nasr, Jagielski,
NeurIPS 2023, drawn like the DP noise: secret unless the run's noise is seeded) and assigned
to a client in turn. The set, its bits and what the auditor observed live in the run's
private state (``private.pt``); ``fedlap-privacy audit`` turns them into a lower bound on
epsilon (:mod:`fedlap_privacy.audit.canaries.canary_audit`). Three kinds:

* ``white-box`` (record-level methods that release noisy gradients: FedLAP-DP, DP-FedAvg,
  DP-FedProx, ALI-DPFL): Dirac gradient canaries. Canary i is a raw gradient of
  ``scale * C`` on one random coordinate of the flattened weights; in each DP step of its
  client, if included, it is Poisson-sampled at the client's rate and clipped like a record
  (:func:`fedlap_privacy.fl.methods.dp.dirac_canaries`). The auditor reads every release of the
  client, as the server (or anyone holding the client's DP gradients) can, and scores the
  canary by the sum of the released noisy sums on its coordinate, in units of C. The
  coordinate is a weight of the model, or (``canary_coordinates="dedicated"``, FedLAP-DP's
  default) one of M coordinates appended to every release of the DP step, noised like the
  weights, which no real record's gradient reaches: the data's gradients on the canaries'
  weights no longer blur the scores, and the canaries cost no accuracy.
* ``black-box`` (every method): canary records, images of uniform noise with a label drawn
  from the client's own classes (the public class list does not change). An included canary
  is appended to its client's data; the score is read from the final model (minus the
  loss). The client still reports its own N_k: the canaries do not change public metadata.
* ``clients`` (client-level DP-NormFedAvg; Andrew et al., ICLR 2024): canary clients whose
  update is a fixed random unit direction c_j, normalised to C like any update, taking part
  in a round with the client fraction's probability when included. The auditor records the
  cosine of every c_j with each round's model change.

Canaries cost privacy like records (or clients): each is sampled at a rate no larger than
the one the ledger accounts, so the ledger stays valid; they do cost accuracy.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.methods.dp import (
    DiracCanaryStep,
    dirac_canaries,
    dp_gradient,
    poisson_sample,
)
from fedlap_privacy.fl.methods.interface import Reply
from fedlap_privacy.fl.run.randomness import dp_generator
from fedlap_privacy.state.canary_state import CanaryState
from fedlap_privacy.vocabulary import CanaryCoordinates, CanaryKind

__all__ = ["DIRAC_SCALE", "CanarySet", "audit_dp_steps", "flat_weights"]

#: raw Dirac canary gradient in units of C: clipping matters (a missing clip is caught)
DIRAC_SCALE = 10.0
_CANARY_KEY = 2 * 10**6  # key of the canary generators (clients use k + 1, the server 10**6)


class CanarySet(CanaryState):
    """The run's canaries (:class:`~fedlap_privacy.state.canary_state.CanaryState`) with what
    training does with them."""

    # ------------------------------------------------------------------ building
    @classmethod
    def create(
        cls, cfg: TrainConfig, model: nn.Module, x_shape: tuple[int, ...],
        client_labels: list[Tensor],
    ) -> CanarySet:
        """``cfg.canaries`` canaries of ``cfg.resolved_canary_kind`` for a run of ``cfg``
        (``client_labels``: each client's labels, for the black-box canaries' classes)."""
        kind = cfg.resolved_canary_kind
        m = cfg.canaries
        gen = dp_generator(cfg, torch.device("cpu"), 0, _CANARY_KEY)
        included = torch.rand(m, generator=gen) < 0.5
        client = torch.arange(m) % cfg.clients
        out = cls(kind, included, client)
        d = sum(p.numel() for p in model.parameters())
        if kind == CanaryKind.WHITE_BOX:
            out.dedicated = cfg.resolved_canary_coordinates == CanaryCoordinates.DEDICATED
            out.coordinates = (torch.arange(m) if out.dedicated
                               else _dirac_coordinates(model, m, gen))
            out.scores = torch.zeros(m, dtype=torch.float64)
        elif kind == CanaryKind.BLACK_BOX:
            out.images = torch.rand((m, *x_shape), generator=gen) * 4.0 - 2.0
            picks = [client_labels[int(k)].unique() for k in client]
            out.labels = torch.stack([
                p[int(torch.randint(len(p), (), generator=gen))] for p in picks])
        else:
            out.direction_seed = int(torch.randint(2**62, (), generator=gen))
            out.dimension = d
        return out

    # ------------------------------------------------------------------ during training
    def dirac_step(self, cfg: TrainConfig, k: int, rate: float, round_: int,
                   device: torch.device) -> DiracCanaryStep:
        """Client k's white-box canaries for one client round."""
        assert self.coordinates is not None and self.scores is not None
        mine = self.client == k
        scores, positions = self.scores, torch.nonzero(mine).flatten()

        def observe(released: Tensor) -> None:
            scores.index_add_(0, positions, released)

        return DiracCanaryStep(
            self.coordinates[mine], self.included[mine], rate, DIRAC_SCALE,
            dp_generator(cfg, device, round_, k + 1, _CANARY_KEY), observe,
            self.size if self.dedicated else 0,
        )

    def client_records(self, k: int) -> tuple[Tensor, Tensor] | None:
        """Client k's included black-box canary records (None for other kinds)."""
        if self.kind != CanaryKind.BLACK_BOX:
            return None
        assert self.images is not None and self.labels is not None
        mine = (self.client == k) & self.included
        return self.images[mine], self.labels[mine]

    def canary_replies(self, cfg: TrainConfig, model: nn.Module, round_: int) -> list[Reply]:
        """The canary clients taking part in this round (included, sampled at the client
        fraction), each uploading its direction normalised to C."""
        gen = dp_generator(cfg, torch.device("cpu"), round_, 0, _CANARY_KEY)
        taking_part = (torch.rand(self.size, generator=gen) < cfg.client_fraction) & self.included
        names = [(n, p.shape, p.numel()) for n, p in model.named_parameters()]
        replies = []
        for j in torch.nonzero(taking_part).flatten().tolist():
            flat = (self.direction(j) * cfg.clip).float()
            pieces = flat.split([numel for _, _, numel in names])
            payload = {n: t.view(shape) for (n, shape, _), t in zip(names, pieces, strict=True)}
            replies.append(Reply(payload, 0, 0))
        return replies

    def observe_round(self, before: Tensor, after: Tensor) -> None:
        """Canary clients: cosine of every direction with this round's model change."""
        delta = (after - before).double().cpu()
        self.total_delta = delta if self.total_delta is None else self.total_delta + delta
        self.cosines.append(self.cosines_with(delta))


def _dirac_coordinates(model: nn.Module, m: int, generator: torch.Generator) -> Tensor:
    """``m`` distinct flat indices drawn among the weight matrices and kernels: biases and
    normalisation scales carry large, systematic data gradients that would drown a
    canary's signal."""
    candidates, offset = [], 0
    for p in model.parameters():
        if p.ndim >= 2:
            candidates.append(torch.arange(p.numel()) + offset)
        offset += p.numel()
    pool = torch.cat(candidates)
    if m > len(pool):
        raise ConfigError(f"{m} Dirac canaries need as many distinct weights; the model has "
                          f"{len(pool)} in its weight matrices")
    return pool[torch.randperm(len(pool), generator=generator)[:m]]


def flat_weights(model: nn.Module) -> Tensor:
    """All parameters as one flat vector, in ``model.parameters()`` order."""
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def audit_dp_steps(
    model: nn.Module, x: Tensor, y: Tensor, *, steps: int, batch_size: float, clip: float,
    sigma: float, canaries: int, generator: torch.Generator,
) -> CanaryState:
    """Run ``steps`` DP steps (:func:`~fedlap_privacy.fl.methods.dp.dp_gradient` on Poisson batches
    of ``(x, y)``, the model left unchanged) with ``canaries`` white-box Dirac canaries, each
    included with probability 1/2: the white-box audit of the DP step alone, as it runs
    (Nasr et al. 2023). Returns the canary state for
    :func:`fedlap_privacy.audit.canaries.canary_audit.run_canary_audits`."""
    n = x.shape[0]
    included = torch.rand(canaries, generator=generator) < 0.5
    coordinates = _dirac_coordinates(model, canaries, generator)
    scores = torch.zeros(canaries, dtype=torch.float64)
    step = DiracCanaryStep(coordinates, included, batch_size / n, DIRAC_SCALE, generator,
                           lambda released: scores.add_(released))
    with dirac_canaries(step):
        for _ in range(steps):
            batch = poisson_sample(n, batch_size / n, generator)
            dp_gradient(model, x[batch], y[batch], clip, sigma, batch_size, generator)
    return CanaryState(CanaryKind.WHITE_BOX.value, included,
                       torch.zeros(canaries, dtype=torch.int64), coordinates=coordinates,
                       scores=scores)
