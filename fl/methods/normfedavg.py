"""DP-NormFedAvg: client-level DP by normalised client updates (docs/algorithms.md#dp-normfedavg).

Das, Hashemi, Sanghavi, Dhillon, "Privacy-preserving federated learning via normalized (instead
of clipped) updates". Each sampled client trains locally WITHOUT record-level noise, scales its
update Delta_k = w_k - w_g to the fixed norm C, and the server releases the noisy sum.

Contract — exactly the client-level sampled Gaussian mechanism the ledger assumes
(:meth:`fedlap_privacy.accountant.FedLAPSchedule.client_level`,
docs/accounting.md#client-level-dp):

* Neighbouring datasets: add/remove ONE CLIENT (all of its records at once).
* Sampling: every client takes part in a round independently with probability
  ``q = client_fraction`` (Bernoulli selection, done by the driver:
  :func:`fedlap_privacy.fl.engine.client_sampling.select_clients`).
* Sensitivity: a client's upload is its update over ALL parameters flattened into one vector,
  normalised to L2 norm exactly ``C = cfg.clip`` (``Delta_k * C / ||Delta_k||``), so adding or
  removing a client moves the sum by exactly ``C`` (at most ``C``: an update that is exactly
  zero stays zero rather than being given an arbitrary direction — it still has norm <= C).
  Normalising (not clipping) is the paper's choice: every client's step has the same length.
* Noise: ONE draw of ``N(0, sigma^2 C^2 I)`` added by the server to the SUM of the normalised
  updates, from the server's generator; the result is divided by the EXPECTED number of
  participants ``q K`` (a public constant), never by the realised count (which depends on who
  took part) — the same reasoning as :mod:`fedlap_privacy.fl.methods.dp`. Then
  ``w_g += server_lr * (sum_k Delta_k + noise) / (q K)``.
* Weighting is uniform: weights N_k / N would let one client's data size change its
  contribution, and the sensitivity would no longer be C.

One round is one release of each participating client's data (``accesses = 1``, however many
local steps it took): the ledger's client-level SGM at rate q composes these rounds. The local
steps themselves are not record-level private; the guarantee is for a client's whole dataset.
Only parameters are updated (the ConvNet has no buffers: GroupNorm). ``sigma = 0`` adds no
noise (unit tests only: ``TrainConfig.validate`` refuses it); ``sigma = None`` is an error.

A round in which no client was selected still releases pure noise
(``aggregate_without_replies``), as the sampled Gaussian mechanism does. The realised
selection (who, and how many: under add/remove-one-client neighbours the count depends on
whether a client took part) is not covered by the SGM bound, so the release withholds it
(:mod:`fedlap_privacy.fl.run.released_metrics`); only the trusted server knows it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.methods.dp import add_gaussian_noise
from fedlap_privacy.fl.methods.fedavg import local_training
from fedlap_privacy.fl.methods.interface import Method, Reply, RoundInfo, State

__all__ = ["DPNormFedAvg", "normalise_update"]


def normalise_update(update: dict[str, Tensor], norm: float) -> dict[str, Tensor]:
    """``update`` (all tensors flattened into one vector) scaled to L2 norm ``norm``.

    A zero update stays zero (its norm 0 <= ``norm`` keeps the sensitivity bound).
    The norm is taken in float64 so that the result's norm is ``norm`` to float32 precision.
    """
    total = math.sqrt(sum(float(t.double().square().sum()) for t in update.values()))
    if total == 0.0:
        return {k: torch.zeros_like(t) for k, t in update.items()}
    scale = norm / total
    return {k: (t.double() * scale).to(t.dtype) for k, t in update.items()}


class DPNormFedAvg(Method):
    """DP-NormFedAvg (docs/algorithms.md#dp-normfedavg): normalised client updates, Gaussian
    noise on their sum.

    Client: ``cfg.local_steps`` non-private local SGD steps at ``info.lr`` from w_g, upload
    ``normalise_update(w_k - w_g, cfg.clip)`` (one client-level access). Server: see the module
    docstring's contract.
    """

    aggregate_without_replies = True
    #: q K, a public constant
    public_extras = ("expected_clients",)

    def client(
        self, model: nn.Module, x: Tensor, y: Tensor, state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> Reply:
        cfg = self.cfg
        # The local steps are non-private (the protection is client-level), so the batch rate
        # only has to be a valid probability for a client smaller than B.
        batch = min(float(cfg.batch_size), float(x.shape[0]))
        trained, _ = local_training(
            model, x, y, steps=cfg.local_steps, lr=info.lr, batch_size=batch,
            generator=generator, dp=None,
        )
        start = dict(model.named_parameters())
        update = {k: (p.detach() - start[k].detach()) for k, p in trained.named_parameters()}
        return Reply(normalise_update(update, cfg.clip), 1, len(y))

    def aggregate(
        self, model: nn.Module, replies: list[Reply], server_state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> dict[str, Any]:
        cfg = self.cfg
        if cfg.sigma is None:  # planned by build_ledger before any round; never skip noise
            raise ConfigError("DP-NormFedAvg needs its noise multiplier sigma")
        sigma = float(cfg.sigma)
        expected = cfg.client_fraction * cfg.clients  # q K, public
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, p in params.items():  # noise drawn per parameter in a fixed order
                total = torch.zeros_like(p)
                for r in replies:
                    total += r.payload[name].to(p.device, p.dtype)
                total = add_gaussian_noise(total, sigma * cfg.clip, generator)
                p.add_(total, alpha=cfg.server_lr / expected)
        return {"expected_clients": expected}
