"""White-box gradient canaries for a DP-SGD training run elsewhere (Opacus, or a plain loop).

The one-run audit of Steinke, Nasr, Jagielski (NeurIPS 2023) with Dirac gradient canaries
(Nasr, Hayes, Steinke et al., USENIX Security 2023; docs/audit.md): ``m`` canaries, each
included with a secret fair coin drawn from the operating system before training; each owns
one coordinate of a block of weights that no record's gradient reaches
(:mod:`.canary_block`); at every step each included canary is sampled as the optimiser
samples records and, when sampled, its clipped gradient (norm ``C`` on its coordinate) enters
the clipped sum before the noise, as a record's would. The block's released value on each
coordinate is recorded every step; after training, each canary is scored from those
releases (:mod:`.gradient_canary_scores`) and the scores are audited against the claim by
:func:`~fedlap_privacy.audit.score_audit.audit_canary_scores` (Steinke's bound, the f-DP
bound, and the test against the claimed mechanism's own trade-off curve).

Opacus::

    canaries = GradientCanaries(m=1000)
    model = canaries.wrap(model)                     # before make_private
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, ...)
    canaries.attach(optimizer)                       # the training loop stays as it is
    result = canaries.audit(claimed_epsilon=eps, delta=1e-5, out="runs/opacus-audit")

A plain torch DP-SGD loop calls, per step, on the block's clipped sum (the sum over the
batch of the clipped per-record gradients, before noise) and on its noisy sum::

    canaries.add_to_clipped_sum(block_sum, max_grad_norm=C, sample_rate=q)
    noisy = block_sum + sigma * C * torch.randn_like(block_sum)
    canaries.record_release(noisy, noise_multiplier=sigma, max_grad_norm=C)

What it tests: the noise and clipping step as it runs (a missing, mis-scaled or misplaced
noise, a normalisation that differs from the accounting) against the claim, for canaries
sampled at the rate the accountant was given. What it cannot test: the data pipeline (the
canaries are not records: a sampler whose real rate differs from the accounted one, or a
record used twice, is invisible to them), and a claim above the audit's ceiling.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedlap_privacy.audit import gradient_canary_scores as gcs
from fedlap_privacy.audit.canary_block import add_canary_block, canary_block, remove_canary_block
from fedlap_privacy.audit.gradient_canary_scores import CanaryRun
from fedlap_privacy.errors import ConfigError

__all__ = ["MAX_CANARIES", "MIN_CANARIES", "CanaryRun", "GradientCanaries"]

#: the largest block :meth:`GradientCanaries.wrap` adds (its zero input is batch x m floats)
MAX_CANARIES = 1 << 20
#: the fewest canaries an audit accepts
MIN_CANARIES = 10


def _secret_coins(m: int) -> np.ndarray:
    """``m`` fair inclusion coins from the operating system's randomness (``secrets``)."""
    raw = np.frombuffer(secrets.token_bytes((m + 7) // 8), dtype=np.uint8)
    return np.unpackbits(raw)[:m].astype(bool)


def _step_generator() -> np.random.Generator:
    """The generator of the per-step sampling draws, seeded with 128 bits from the OS."""
    return np.random.Generator(np.random.PCG64(secrets.randbits(128)))


class GradientCanaries:
    """``m`` white-box gradient canaries (module docstring).

    The inclusion coins are drawn here, from the operating system, and never leave this
    object except in the audit (after training). No seed can be given: coins an auditor or a
    configuration could predict would void the audit.
    """

    def __init__(self, m: int = 1000) -> None:
        if isinstance(m, bool) or not isinstance(m, int | np.integer):
            raise ConfigError(f"the number of canaries must be an integer, got {m!r}")
        if not MIN_CANARIES <= m <= MAX_CANARIES:
            raise ConfigError(f"the number of canaries must lie in {MIN_CANARIES}.."
                              f"{MAX_CANARIES} (one block coordinate each), got {m}")
        self.m = int(m)
        self._included = _secret_coins(self.m)
        self._generator = _step_generator()
        self._block: nn.Linear | None = None
        self._optimizer: Any = None
        self._rate: float | None = None
        self._epoch: int | None = None  # steps per epoch under shuffled batches
        self._slots: np.ndarray | None = None
        self._pending: np.ndarray | None = None  # canaries added at the open step
        self._releases: list[np.ndarray] = []
        self._sigmas: list[float] = []
        self._clips: list[float] = []
        self._sampled = np.zeros(self.m, dtype=np.int64)

    # -- Opacus -----------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        """``model`` with its canary block (:class:`~.canary_block.CanaryBlockModel`, the
        outputs unchanged). Call before ``PrivacyEngine.make_private`` and pass it the model
        this returns."""
        if self._block is not None:
            raise ConfigError("these canaries already wrapped a model (one model each)")
        wrapped = add_canary_block(model, self.m)
        self._block = canary_block(wrapped)
        return wrapped

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The model :meth:`wrap` was given, without its block (from the wrapped model or
        from the Opacus module around it): what to save or deploy after training."""
        return remove_canary_block(model)

    def attach(self, optimizer: Any, *, data_loader: Any = None,
               sample_rate: float | None = None) -> None:
        """Enter the Opacus ``DPOptimizer`` ``optimizer`` (:mod:`.opacus_canaries`).

        The canaries are sampled as the optimiser's records: Poisson at ``sample_rate``, or
        at the rate of ``data_loader`` (an Opacus ``DPDataLoader``), or at the rate
        ``make_private`` gave the optimiser's accountant (the default). A ``data_loader``
        that is not Poisson (``poisson_sampling=False``) makes each included canary enter
        exactly one uniformly chosen step of each epoch of ``len(data_loader)`` steps, as a
        shuffled record does.
        """
        from fedlap_privacy.audit import opacus_canaries

        if self._optimizer is not None:
            raise ConfigError("these canaries are already attached to an optimiser (attach "
                              "once)")
        if self._block is None:
            raise ConfigError("wrap the model first: canaries.wrap(model) before "
                              "make_private, then attach(optimizer)")
        opacus_canaries.check_dp_optimizer(optimizer)
        if sample_rate is not None:
            rate, epoch = sample_rate, None
        elif data_loader is not None:
            rate, epoch = opacus_canaries.loader_sampling(data_loader)
        else:
            found = opacus_canaries.optimizer_sample_rate(optimizer)
            if found is None:
                raise ConfigError("the optimiser has no accountant hook to read its sample "
                                  "rate from: pass attach(optimizer, sample_rate=q)")
            rate, epoch = found, None
        self._set_sampling(rate, epoch)
        opacus_canaries.hook_dp_optimizer(self, optimizer, self._block.weight)
        self._optimizer = optimizer

    # -- any DP-SGD loop --------------------------------------------------------------------
    def _set_sampling(self, rate: float | None, epoch: int | None) -> None:
        if epoch is not None:
            if isinstance(epoch, bool) or not isinstance(epoch, int | np.integer) or epoch < 1:
                raise ConfigError(f"steps_per_epoch must be an integer >= 1, got {epoch!r}")
            rate = 1.0 / int(epoch)
        if rate is None or not (isinstance(rate, int | float) and math.isfinite(rate)
                                and 0.0 < rate <= 1.0):
            raise ConfigError(f"the sample rate must lie in (0, 1], got {rate!r}")
        if self._rate is not None and (self._rate != rate or self._epoch != epoch):
            raise ConfigError(f"the sampling rule changed during training (was rate "
                              f"{self._rate}, steps per epoch {self._epoch})")
        self._rate, self._epoch = float(rate), None if epoch is None else int(epoch)

    def _draw(self) -> np.ndarray:
        """Which canaries enter the open step: included and sampled by the rule."""
        assert self._rate is not None
        step = len(self._releases)
        if self._epoch is None:
            sampled = self._generator.random(self.m) < self._rate
        else:
            if step % self._epoch == 0 or self._slots is None:
                self._slots = self._generator.integers(0, self._epoch, self.m)
            sampled = self._slots == step % self._epoch
        return self._included & sampled

    def add_to_clipped_sum(self, clipped_sum: torch.Tensor, *, max_grad_norm: float,
                           sample_rate: float | None = None,
                           steps_per_epoch: int | None = None) -> torch.Tensor:
        """Add this step's sampled canaries, ``max_grad_norm`` each on its own coordinate of
        the first ``m`` entries of ``clipped_sum`` (in place), before the noise.

        ``clipped_sum``: the canary block's sum of clipped per-record gradients (any shape,
        at least ``m`` entries; every record's entry there is 0). The rule: Poisson at
        ``sample_rate`` or shuffled epochs of ``steps_per_epoch`` steps, given at the first
        step (or by :meth:`attach`); later steps may omit it. Then call
        :meth:`record_release` with the noisy sum before the next step.
        """
        if self._pending is not None:
            raise ConfigError("record_release was not called after the last "
                              "add_to_clipped_sum (one of each per step)")
        if not isinstance(clipped_sum, torch.Tensor) or clipped_sum.numel() < self.m:
            size = clipped_sum.numel() if isinstance(clipped_sum, torch.Tensor) else "no"
            raise ConfigError(f"{self.m} canaries need a block of at least {self.m} entries, "
                              f"got {size}")
        if not (isinstance(max_grad_norm, int | float) and math.isfinite(max_grad_norm)
                and max_grad_norm > 0):
            raise ConfigError(f"max_grad_norm must be > 0, got {max_grad_norm!r}")
        if sample_rate is not None or steps_per_epoch is not None:
            if sample_rate is not None and steps_per_epoch is not None:
                raise ConfigError("give sample_rate (Poisson) or steps_per_epoch (shuffled "
                                  "batches), not both")
            self._set_sampling(sample_rate, steps_per_epoch)
        elif self._rate is None:
            raise ConfigError("the first step needs sample_rate= or steps_per_epoch=")
        added = self._draw()
        self._pending = added
        self._sampled += added
        index = torch.from_numpy(np.flatnonzero(added)).to(clipped_sum.device)
        with torch.no_grad():
            flat = clipped_sum.view(-1)
            flat[index] += float(max_grad_norm)
        return clipped_sum

    def record_release(self, noisy_sum: torch.Tensor, *, noise_multiplier: float,
                       max_grad_norm: float) -> None:
        """Record the step's release on the canary block: the clipped sum plus the noise, in
        the sum's units (before dividing by a batch size), first ``m`` entries."""
        if self._pending is None:
            raise ConfigError("record_release needs add_to_clipped_sum first (one of each "
                              "per step)")
        if not isinstance(noisy_sum, torch.Tensor) or noisy_sum.numel() < self.m:
            raise ConfigError(f"the released block must hold at least {self.m} entries")
        values = noisy_sum.detach().reshape(-1)[:self.m].double().cpu().numpy()
        self._releases.append((values / float(max_grad_norm)).astype(np.float32))
        self._sigmas.append(float(noise_multiplier))
        self._clips.append(float(max_grad_norm))
        self._pending = None

    # -- after training ---------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Steps released so far."""
        return len(self._releases)

    def releases(self) -> np.ndarray:
        """The recorded ``(steps, m)`` releases in units of ``C`` (no secret in them)."""
        if not self._releases:
            hint = ("call canaries.attach(optimizer) after make_private (or record_release "
                    "each step of a plain loop), then train"
                    if self._optimizer is None else "train (optimizer.step) before the audit")
            raise ConfigError(f"no step was recorded: {hint}")
        return np.vstack(self._releases).astype(np.float64)

    def run(self) -> CanaryRun:
        """The run as the canaries saw it (:class:`CanaryRun`)."""
        releases = self.releases()
        assert self._rate is not None

        def single(values: list[float]) -> float | None:
            return values[0] if len(set(values)) == 1 else None

        return CanaryRun(self.m, len(releases), self._rate, self._epoch, single(self._sigmas),
                         single(self._clips), gcs.measured_noise_multiplier(releases))

    def scores(self, sigma: float | None = None) -> dict[str, np.ndarray]:
        """Every score of the canaries by name (:mod:`.gradient_canary_scores`): the
        likelihood ratio at ``sigma`` (the claimed noise multiplier) and at the noise
        measured on the block, and the summed release."""
        releases = self.releases()
        run = self.run()
        ratio: Callable[[float], np.ndarray]
        if run.steps_per_epoch is None:
            def ratio(s: float) -> np.ndarray:
                return gcs.poisson_scores(releases, run.sample_rate, s)
        else:
            def ratio(s: float) -> np.ndarray:
                return gcs.shuffle_scores(releases, int(run.steps_per_epoch), s)
        out = {}
        if sigma is not None:
            out["likelihood ratio (claimed noise)"] = ratio(sigma)
        # a noiseless release measures 0: any small scale then separates the canaries
        out["likelihood ratio (measured noise)"] = ratio(max(run.measured_noise_multiplier,
                                                             1e-3))
        out["summed release"] = gcs.summed_scores(releases)
        return out

    def accountant(self) -> Any | None:
        """The Opacus accountant ``make_private`` hooked to the attached optimiser, if any."""
        from fedlap_privacy.audit import opacus_canaries

        return None if self._optimizer is None else opacus_canaries.accountant_of(
            self._optimizer)

    @property
    def included(self) -> np.ndarray:
        """The secret inclusion coins: read them only to audit, after training."""
        return self._included.copy()

    def audit(self, claimed_epsilon: float | None = None, delta: float = 1e-5, *,
              accountant: Any = None, mechanism: Any = None, confidence: float = 0.95,
              out: str | Path | None = None) -> Any:
        """Audit the claim from the canaries (:mod:`.gradient_canary_audit`)."""
        from fedlap_privacy.audit.gradient_canary_audit import audit_gradient_canaries

        return audit_gradient_canaries(self, claimed_epsilon, delta, accountant=accountant,
                                       mechanism=mechanism, confidence=confidence, out=out)
