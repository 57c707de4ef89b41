"""Tiny real Opacus DP-SGD runs with gradient canaries, what the gradient-canary tests
train (one thread): scikit-learn's digits with an MLP 64-16-10 at Poisson rate 1/15
(:func:`train`), and synthetic data with an MLP 20-16-2 whose noise, accumulation or loader
goes wrong after ``make_private`` (:func:`train_synthetic`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fedlap_privacy.audit.canaries import gradient_canaries
from fedlap_privacy.audit.canaries.gradient_canaries import GradientCanaries

SIGMA = 1.0
CLIP = 1.0
DELTA = 1e-5


def digits() -> torch.utils.data.TensorDataset:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    return torch.utils.data.TensorDataset(x, torch.tensor(d.target))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


@dataclass
class Run:
    canaries: GradientCanaries
    engine: Any
    model: nn.Module
    optimizer: Any
    loader: Any


def seeded_coins(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Replace the OS coins and draws by seeded ones: a test's verdict is then the same on
    every run (the product has no such switch)."""
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(gradient_canaries, "_secret_coins", lambda m: rng.random(m) < 0.5)
    monkeypatch.setattr(gradient_canaries, "os_generator",
                        lambda: np.random.default_rng(seed + 1))


def train(seed: int, *, factor: float = 1.0, epochs: int = 12, batch: int = 120,
          m: int = 1000, mode: str = "hooks", poisson: bool = True,
          attach_loader: bool = False, optimizer_first: bool = True) -> Run:
    """Opacus DP-SGD with noise multiplier ``SIGMA * factor`` and canaries attached (told
    the data loader when ``attach_loader``)."""
    from opacus import PrivacyEngine

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    loader = torch.utils.data.DataLoader(digits(), batch_size=batch, shuffle=not poisson)
    model = mlp()
    canaries = GradientCanaries(m=m)
    if optimizer_first:  # as most scripts do: the optimiser from the model before wrap
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model = canaries.wrap(model)
    else:
        model = canaries.wrap(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine(accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                   noise_multiplier=SIGMA * factor, max_grad_norm=CLIP,
                                   poisson_sampling=poisson, grad_sample_mode=mode)
    if mode == "ghost":
        model, optimizer, criterion, loader = made
    else:
        model, optimizer, loader = made
        criterion = nn.CrossEntropyLoss()
    canaries.attach(optimizer, data_loader=loader if attach_loader else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(epochs):
            for x, y in loader:
                optimizer.zero_grad()
                criterion(model(x), y).backward()
                optimizer.step()
    return Run(canaries, engine, model, optimizer, loader)


def synthetic(n: int = 1800, d: int = 20, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``n`` Gaussian records in ``d`` dimensions, two classes split by a hyperplane."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long())


@dataclass
class Synthetic:
    """A synthetic-data Opacus run's canaries, engine and (RDP) accountant history."""

    canaries: GradientCanaries
    engine: Any
    history: list[tuple[float, float, int]]


def train_synthetic(seed: int, *, m: int = 2000, sigma: float = SIGMA, cut: float = 1.0,
                    cut_after: int = 0, epochs: int = 8, batch: int = 120,
                    accumulate: int = 1, records: bool = False, loader: str = "opacus",
                    n: int = 1800, attach_loader: bool = False) -> Synthetic:
    """Opacus DP-SGD on :func:`synthetic` data, an MLP 20-16-2, canaries attached right
    after ``make_private``; the noise multiplier is multiplied by ``cut`` after
    ``cut_after`` released steps (the bug of a script that changes it after set-up).
    ``accumulate`` micro-batches of ``batch / accumulate`` records per step
    (``poisson_sampling=False``); ``records``: canaries as records (``wrap_dataset``);
    ``loader``: ``opacus`` (the loader make_private returns), ``3x`` (a shuffled loader of
    3x the batch), ``weighted`` (a WeightedRandomSampler drawing canary records 10x as
    often as the others)."""
    from opacus import PrivacyEngine

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    data: Any = synthetic(n, seed=seed)
    model: nn.Module = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    canaries = GradientCanaries(m=m)
    model = canaries.wrap(model)
    if records:
        data = canaries.wrap_dataset(data)
    poisson = accumulate == 1
    batches = torch.utils.data.DataLoader(data, batch_size=batch // accumulate,
                                          shuffle=not poisson)
    engine = PrivacyEngine(accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, batches = engine.make_private(
            module=model, optimizer=optimizer, data_loader=batches, noise_multiplier=sigma,
            max_grad_norm=CLIP, poisson_sampling=poisson)
    canaries.attach(optimizer, data_loader=batches if attach_loader else None)
    if cut_after == 0:
        optimizer.noise_multiplier *= cut
    if loader == "3x":
        batches = torch.utils.data.DataLoader(data, batch_size=3 * batch, shuffle=True)
    elif loader == "weighted":
        weights = torch.ones(len(data))
        weights[n:] = 10.0
        sampler = torch.utils.data.WeightedRandomSampler(weights, len(data))
        batches = torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler)
    criterion = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(epochs):
            for i, (x, y) in enumerate(batches):
                criterion(model(x), y).backward()
                if (i + 1) % accumulate == 0:
                    optimizer.step()
                    optimizer.zero_grad()
                    if cut_after and canaries.steps == cut_after:
                        optimizer.noise_multiplier *= cut
    return Synthetic(canaries, engine, list(engine.accountant.history))
