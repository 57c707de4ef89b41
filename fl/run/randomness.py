"""Where a run's randomness comes from: public (the seed) or secret (the operating system).

Public randomness — the initial weights — is derived from the run's ``seed``, so a run's
starting point can be reproduced. The released weights stay correlated with the initial
ones, so anyone can recover a small seed from ``ckpt.pt`` by brute force: the seed is
public in effect.

The split — which records each client holds, the validation hold-out and the client
subsets — is drawn from a SEPARATE split seed (:func:`run_split_seed`): by default 63 bits
from :mod:`secrets`, kept in ``private.pt`` only (so ``--resume`` restores the same split),
never in ``ckpt.pt``; so the released weights do not reveal the membership. A user who sets
``split_seed`` gets a reproducible split, and the guarantee then declares the membership
public (:attr:`TrainConfig.public_metadata`).

DP randomness — the Poisson batches, the Gaussian noise, LDP-FL's perturbation and
shuffling, the server's noise and the client selection, with everything else a client round
or a server step draws from the same generator (augmentation, synthetic initialisation) — is
SECRET by default: each generator is seeded with 63 bits from :mod:`secrets` (the operating
system's entropy) on the party that uses it, and that seed is never stored, logged or sent.
Anyone who could predict this randomness could subtract the noise (Wang et al.'s FedLAP-DP
accounting, and every DP guarantee, assumes they cannot).

A non-private method's randomness is derived from the seed (it protects nothing).
``reproducible_noise`` derives the DP randomness from the seed too, for research and tests:
the run is then bit-for-bit reproducible and NOT private (the ledger, the checkpoint and the
summary say ``noise: seeded``). torch's generators are not cryptographically secure
(as in Opacus without ``secure_mode``): seeding from the OS makes the noise unpredictable
from anything the run stores or sends, not immune to an attack on the generator itself.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.vocabulary import NoiseKind

__all__ = [
    "SERVER_KEY", "dp_generator", "run_split_seed", "secret_generator", "secret_seed",
    "seeded_generator",
]

#: the third key of the server's generator in a round (clients use k + 1, selection 0)
SERVER_KEY = 10**6


def seeded_generator(device: torch.device, *keys: int) -> torch.Generator:
    """A generator determined by ``keys`` (e.g. seed, round, client): public randomness."""
    seed = int(np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint64)[0] >> 1)
    return torch.Generator(device=device).manual_seed(seed)


def secret_seed() -> int:
    """63 bits of the operating system's entropy."""
    return secrets.randbits(63)


def secret_generator(device: torch.device) -> torch.Generator:
    """A generator seeded by the operating system's entropy; the seed is not kept."""
    return torch.Generator(device=device).manual_seed(secret_seed())


def run_split_seed(cfg: TrainConfig, secret: int | None = None) -> int:
    """The split seed of a new run: ``cfg.split_seed`` when the user set one (public),
    else ``secret`` (one a caller shares over several runs: ``compare``, or the Flower
    server, which needs it before the run starts), else a fresh :func:`secret_seed`."""
    if cfg.split_seed is not None:
        return cfg.split_seed
    return secret_seed() if secret is None else secret


def dp_generator(cfg: TrainConfig, device: torch.device, *keys: int) -> torch.Generator:
    """The DP randomness of one party's step: secret, or ``(cfg.seed, *keys)`` when the run
    asked for ``reproducible_noise`` or is not private (nothing to protect)."""
    if cfg.noise != NoiseKind.SECRET:
        return seeded_generator(device, cfg.seed, *keys)
    return secret_generator(device)
