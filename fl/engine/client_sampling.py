"""Which clients take part in a round: the sampling the accountant believes.

Drawn by the driver from DP randomness (:func:`~fedlap_privacy.fl.run.randomness.dp_generator`:
secret, from the operating system, unless the run's noise is seeded), key (round, 0), so
no party can predict who is selected (:mod:`fedlap_privacy.accountant.client_level`):

* Poisson (``clients_per_round`` None): each client independently with probability
  ``client_fraction`` q (the q1 of Theorem 5.8; client-level: the rate of the sampled
  Gaussian); the cohort's size varies from round to round.
* Fixed size (``clients_per_round`` K): K distinct clients drawn uniformly without
  replacement (a uniformly random permutation's first K), as Flower's strategies do.
"""

from __future__ import annotations

import torch

from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.run.randomness import dp_generator

__all__ = ["select_clients"]


def select_clients(cfg: TrainConfig, round_: int) -> list[int]:
    """The clients of round ``round_`` (sorted), by ``cfg``'s sampling (module docstring)."""
    select = dp_generator(cfg, torch.device("cpu"), round_, 0)
    if cfg.clients_per_round is not None:
        chosen = torch.randperm(cfg.clients, generator=select)[: cfg.clients_per_round]
        return sorted(int(k) for k in chosen)
    # one uniform per client, in client order: the same draws as one scalar torch.rand per
    # client (a float32 draw consumes one 32-bit word either way), compared in float64 as
    # Python's float(u) < q compares them
    draws = torch.rand(cfg.clients, generator=select).double()
    return torch.nonzero(draws < cfg.client_fraction).flatten().tolist()
