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
:func:`~fedlap_privacy.audit.canaries.score_audit.audit_canary_scores` (Steinke's bound, the f-DP
bound, and the test against the claimed mechanism's own trade-off curve).

Opacus, the canaries as records of the user's data (drawn by the user's own loader and
sampler, so that what the data pipeline does is audited too)::

    canaries = GradientCanaries(m=1000)
    model = canaries.wrap(model)                     # before make_private
    train_set = canaries.wrap_dataset(train_set)     # included canaries become records
    loader = DataLoader(train_set, batch_size=b)     # or any sampler you have
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer,
                                                   data_loader=loader, ...)
    canaries.attach(optimizer)                       # the training loop stays as it is
    result = canaries.audit(delta=1e-5, out="runs/opacus-audit")

Without ``wrap_dataset`` the canaries enter at the optimiser instead (added to the block's
clipped sum, sampled at the rate Opacus accounts). ``attach`` records what the optimiser was
set up with and every released step's actual values (:mod:`.canary_steps`); by default the
audit tests the set-up claim, whatever the training changed afterwards.

A plain torch DP-SGD loop calls, per step, on the block's clipped sum (the sum over the
batch of the clipped per-record gradients, before noise) and on its noisy sum::

    canaries.add_to_clipped_sum(block_sum, max_grad_norm=C, sample_rate=q)
    noisy = block_sum + sigma * C * torch.randn_like(block_sum)
    canaries.record_release(noisy, noise_multiplier=sigma, max_grad_norm=C)

What it tests: the noise and clipping step as it runs (a missing, mis-scaled or misplaced
noise, a normalisation that differs from the accounting) against the claim; with
``wrap_dataset``, also the sampling (a loader whose real rate exceeds the accounted one, a
record drawn twice in a step). What it cannot test: a claim above the
audit's ceiling; without ``wrap_dataset``, anything before the clipped sum.
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

from fedlap_privacy.audit.canaries import gradient_canary_scores as gcs
from fedlap_privacy.audit.canaries.canary_block import (
    add_canary_block,
    canary_block,
    remove_canary_block,
)
from fedlap_privacy.audit.canaries.canary_dataset import CanaryRecords
from fedlap_privacy.audit.canaries.canary_steps import OptimizerSetup, StepRecord, changes
from fedlap_privacy.audit.canaries.gradient_canary_scores import CanaryRun
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.secret_random import os_generator

__all__ = ["MAX_CANARIES", "MIN_CANARIES", "CanaryRun", "GradientCanaries"]

#: the largest block :meth:`GradientCanaries.wrap` adds (its zero input is batch x m floats)
MAX_CANARIES = 1 << 20
#: the fewest canaries an audit accepts
MIN_CANARIES = 10
#: below this many expected draws of canary records, none drawn is no evidence of a fault
_MIN_EXPECTED_DRAWS = 5.0


def _secret_coins(m: int) -> np.ndarray:
    """``m`` fair inclusion coins from the operating system's randomness (``secrets``)."""
    raw = np.frombuffer(secrets.token_bytes((m + 7) // 8), dtype=np.uint8)
    return np.unpackbits(raw)[:m].astype(bool)


class GradientCanaries:
    """``m`` white-box gradient canaries (module docstring).

    The inclusion coins are drawn here, from the operating system, and never leave this
    object except in the audit (after training) and, with :meth:`wrap_dataset`, as the
    records of the included canaries. No seed can be given: coins an auditor or a
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
        self._generator = os_generator()  # the per-step draws
        self._block: nn.Linear | None = None
        self._records: CanaryRecords | None = None
        self._optimizer: Any = None
        self._route = "plain loop"
        self._setup: OptimizerSetup | None = None
        self._unmodelled: str | None = None
        self._rate: float | None = None
        self._epoch: int | None = None  # steps per epoch under shuffled batches
        self._epoch_accumulated = 1  # micro-batches per step under shuffled batches
        self._slots: np.ndarray | None = None
        self._pending: np.ndarray | None = None  # canaries added at the open step
        self._pending_rate = 0.0
        self._releases: list[np.ndarray] = []
        self._steps: list[StepRecord] = []
        self._sampled = np.zeros(self.m, dtype=np.int64)
        self._drawn: list[int] = []  # canary records in each released step's clipped sum

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

    def wrap_dataset(self, dataset: Any, *, input_key: str | None = None) -> CanaryRecords:
        """``dataset`` with one record per included canary after its own records
        (:class:`~.canary_dataset.CanaryRecords`): build the data loader (and any sampler)
        from what this returns, before ``make_private``. The wrapped model routes each
        canary record the loader draws to the canary's coordinate of the block; the
        optimiser then adds nothing (:meth:`attach`). ``input_key``: for dict records, the
        key of the model's input."""
        if self._block is None:
            raise ConfigError("wrap the model first: canaries.wrap(model), then "
                              "wrap_dataset(train_set)")
        if self._records is not None:
            raise ConfigError("these canaries are already records of a dataset (wrap one "
                              "training set)")
        if self._optimizer is not None:
            raise ConfigError("wrap_dataset before make_private and attach")
        self._records = CanaryRecords(dataset, np.flatnonzero(self._included), input_key)
        return self._records

    def attach(self, optimizer: Any, *, data_loader: Any = None,
               sample_rate: float | None = None) -> None:
        """Enter the Opacus ``DPOptimizer`` ``optimizer`` (:mod:`.opacus_canaries`) and
        record what it is set up with (noise multiplier, clipping norm, the accountant's
        sample rate, expected batch size): the claim the audit tests by default.

        With :meth:`wrap_dataset` the canaries are records: the loader draws them, and each
        released step is scored at the rate Opacus accounts for it. Otherwise they enter at
        the optimiser, sampled as its records: Poisson at the rate Opacus accounts for each
        released step (``make_private``'s ``1 / len(data_loader)`` times the micro-batches
        accumulated into the step), or per micro-batch at ``sample_rate``; a
        ``data_loader`` that is not Poisson (``poisson_sampling=False``) makes each included
        canary enter exactly one uniformly chosen step of each epoch of ``len(data_loader)``
        batches, as a shuffled record does (with ``a`` micro-batches accumulated into every
        step, an epoch of ``len(data_loader) / a`` steps; any other accumulation cannot be
        modelled so, and the audit refuses it).
        """
        from fedlap_privacy.audit.canaries import opacus_canaries

        if self._optimizer is not None:
            raise ConfigError("these canaries are already attached to an optimiser (attach "
                              "once)")
        if self._block is None:
            raise ConfigError("wrap the model first: canaries.wrap(model) before "
                              "make_private, then attach(optimizer)")
        opacus_canaries.check_dp_optimizer(optimizer)
        records = self._records is not None
        if records and data_loader is not None:
            raise ConfigError("the canaries are records of your dataset: your loader draws "
                              "them; attach(optimizer) without data_loader=")
        names = [cls.__name__ for cls in type(optimizer).__mro__]
        if records and any("FastGradientClipping" in n for n in names):
            raise ConfigError("canary records need per-sample gradients "
                              "(grad_sample_mode='hooks'); ghost clipping rescales the "
                              "loss, not the records' gradients: drop wrap_dataset to put "
                              "the canaries at the optimiser")
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
        self._setup = opacus_canaries.optimizer_setup(optimizer)
        self._route = "data pipeline" if records else "optimizer"
        opacus_canaries.hook_dp_optimizer(self, optimizer, self._block.weight)
        self._optimizer = optimizer

    @property
    def step_open(self) -> bool:
        """True between :meth:`enter_step` and :meth:`release_step`."""
        return self._pending is not None

    def enter_step(self, clipped_sum: torch.Tensor, *, max_grad_norm: float,
                   accumulated: int = 1) -> None:
        """Open a released step of the attached optimiser (its ``add_noise``): draw the
        canaries at the rate the step is accounted at and add them to the block's clipped
        sum (none are added when they are records of the dataset: the loader drew them)."""
        assert self._rate is not None
        if self._epoch is None:
            rate = min(1.0, self._rate * accumulated)
        else:
            if (not self._steps and self._epoch_accumulated == 1 and accumulated > 1
                    and self._epoch % accumulated == 0):
                # every step accumulates the same micro-batches: an epoch of len(loader)
                # batches is len(loader) / accumulated steps, each record in exactly one
                self._epoch //= accumulated
                self._rate = 1.0 / self._epoch
                self._epoch_accumulated = accumulated
            rate = self._rate
            if accumulated != self._epoch_accumulated and self._unmodelled is None:
                self._unmodelled = (f"a step over {accumulated} accumulated micro-batches "
                                    f"while the canaries follow shuffled epochs of "
                                    f"{self._epoch * self._epoch_accumulated} batches in "
                                    f"steps of {self._epoch_accumulated}: attach(optimizer) "
                                    f"without data_loader samples them at the rate Opacus "
                                    f"accounts")
        if self._route == "data pipeline":
            self._open(np.zeros(self.m, dtype=bool), rate)
            with torch.no_grad():
                total = float(clipped_sum.reshape(-1)[:self.m].double().sum())
            self._drawn.append(round(total / float(max_grad_norm)))
            return
        self._add(clipped_sum, max_grad_norm, rate)

    def release_step(self, noisy_sum: torch.Tensor, *, noise_multiplier: float,
                     max_grad_norm: float, accumulated: int = 1,
                     expected_batch_size: float | None = None) -> None:
        """Close the open step: record the block's release (the clipped sum plus the noise,
        in the sum's units, first ``m`` entries) and the values the step ran with."""
        if self._pending is None:
            raise ConfigError("record_release needs add_to_clipped_sum first (one of each "
                              "per step)")
        if not isinstance(noisy_sum, torch.Tensor) or noisy_sum.numel() < self.m:
            raise ConfigError(f"the released block must hold at least {self.m} entries")
        values = noisy_sum.detach().reshape(-1)[:self.m].double().cpu().numpy()
        self._releases.append((values / float(max_grad_norm)).astype(np.float32))
        self._steps.append(StepRecord(float(noise_multiplier), float(max_grad_norm),
                                      self._pending_rate, int(accumulated),
                                      expected_batch_size))
        self._pending = None

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

    def _draw(self, rate: float) -> np.ndarray:
        """Which canaries enter the open step: included and sampled by the rule."""
        step = len(self._releases)
        if self._epoch is None:
            sampled = self._generator.random(self.m) < rate
        else:
            if step % self._epoch == 0 or self._slots is None:
                self._slots = self._generator.integers(0, self._epoch, self.m)
            sampled = self._slots == step % self._epoch
        return self._included & sampled

    def _open(self, added: np.ndarray, rate: float) -> None:
        if self._pending is not None:
            raise ConfigError("record_release was not called after the last "
                              "add_to_clipped_sum (one of each per step)")
        self._pending = added
        self._pending_rate = float(rate)
        self._sampled += added

    def _add(self, clipped_sum: torch.Tensor, max_grad_norm: float, rate: float) -> None:
        if not isinstance(clipped_sum, torch.Tensor) or clipped_sum.numel() < self.m:
            size = clipped_sum.numel() if isinstance(clipped_sum, torch.Tensor) else "no"
            raise ConfigError(f"{self.m} canaries need a block of at least {self.m} entries, "
                              f"got {size}")
        if not (isinstance(max_grad_norm, int | float) and math.isfinite(max_grad_norm)
                and max_grad_norm > 0):
            raise ConfigError(f"max_grad_norm must be > 0, got {max_grad_norm!r}")
        if self._pending is not None:
            raise ConfigError("record_release was not called after the last "
                              "add_to_clipped_sum (one of each per step)")
        added = self._draw(rate)
        self._open(added, rate)
        index = torch.from_numpy(np.flatnonzero(added)).to(clipped_sum.device)
        with torch.no_grad():
            flat = clipped_sum.view(-1)
            flat[index] += float(max_grad_norm)

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
        if sample_rate is not None or steps_per_epoch is not None:
            if sample_rate is not None and steps_per_epoch is not None:
                raise ConfigError("give sample_rate (Poisson) or steps_per_epoch (shuffled "
                                  "batches), not both")
            self._set_sampling(sample_rate, steps_per_epoch)
        elif self._rate is None:
            raise ConfigError("the first step needs sample_rate= or steps_per_epoch=")
        assert self._rate is not None
        self._add(clipped_sum, max_grad_norm, self._rate)
        return clipped_sum

    def record_release(self, noisy_sum: torch.Tensor, *, noise_multiplier: float,
                       max_grad_norm: float) -> None:
        """Record the step's release on the canary block: the clipped sum plus the noise, in
        the sum's units (before dividing by a batch size), first ``m`` entries."""
        self.release_step(noisy_sum, noise_multiplier=noise_multiplier,
                          max_grad_norm=max_grad_norm)

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

    def step_records(self) -> list[StepRecord]:
        """What each released step ran with (:class:`~.canary_steps.StepRecord`)."""
        return list(self._steps)

    def _set_up_step(self) -> StepRecord:
        """The step as set up: the optimiser's values at ``attach`` (a plain loop: its first
        step's), at the rate the first released step was accounted at."""
        first = self._steps[0]
        if self._setup is None:
            return first
        return StepRecord(self._setup.noise_multiplier, self._setup.max_grad_norm,
                          first.sample_rate, first.accumulated_iterations,
                          self._setup.expected_batch_size)

    def run(self) -> CanaryRun:
        """The run as the canaries saw it (:class:`CanaryRun`)."""
        releases = self.releases()
        assert self._rate is not None

        def single(values: list[float]) -> float | None:
            return values[0] if len(set(values)) == 1 else None

        set_up = self._set_up_step()
        records = None if self._records is None else len(self._records.coordinates)
        draws = sum(self._drawn[:len(self._steps)]) if records is not None else None
        return CanaryRun(
            self.m, len(releases), set_up.sample_rate, self._epoch,
            single([s.noise_multiplier for s in self._steps]),
            single([s.max_grad_norm for s in self._steps]),
            gcs.measured_noise_multiplier(releases), route=self._route, setup=self._setup,
            set_up_noise_multiplier=set_up.noise_multiplier,
            changes=changes(set_up, self._steps), canary_records=records,
            canary_draws=draws,
            accounted_draws=None if records is None
            else records * float(sum(s.sample_rate for s in self._steps)))

    def check_modelled(self) -> None:
        """A one-line ConfigError where the run cannot be modelled: the canaries' rule did
        not follow the optimiser's steps, or no canary record reached the model though
        several were due."""
        if self._unmodelled is not None:
            raise ConfigError(f"the canaries cannot model this run: {self._unmodelled}")
        run = self.run()
        if (run.canary_draws == 0 and run.accounted_draws is not None
                and run.accounted_draws >= _MIN_EXPECTED_DRAWS):
            raise ConfigError(f"no canary record reached the model in training "
                              f"({run.accounted_draws:.0f} were due at the accounted rate): "
                              f"build the loader and sampler from the dataset wrap_dataset "
                              f"returned, and hand the model its input unchanged")

    def scores(self, sigma: float | None = None) -> dict[str, np.ndarray]:
        """Every score of the canaries by name (:mod:`.gradient_canary_scores`): the
        likelihood ratio at ``sigma`` (the claimed noise multiplier) and at the noise
        measured on the block (per group of steps the optimiser ran with the same noise
        multiplier and clipping norm), and the summed release. Poisson ratios use the rate
        each step was accounted at."""
        releases = self.releases()
        run = self.run()
        rates = np.array([s.sample_rate for s in self._steps])
        ratio: Callable[[float | np.ndarray], np.ndarray]
        if run.steps_per_epoch is None:
            def ratio(s: float | np.ndarray) -> np.ndarray:
                return gcs.poisson_scores(releases, rates, s)
        else:
            def ratio(s: float | np.ndarray) -> np.ndarray:
                return gcs.shuffle_scores(releases, int(run.steps_per_epoch), s)
        out = {}
        if sigma is not None:
            out["likelihood ratio (claimed noise)"] = ratio(sigma)
        # one scale per group of steps the optimiser ran alike (a noise changed mid-run is
        # scored at each part's own); a noiseless release measures 0: any small scale then
        # separates the canaries
        groups = np.unique([(s.noise_multiplier, s.max_grad_norm) for s in self._steps],
                           axis=0, return_inverse=True)[1].reshape(-1)
        measured = gcs.measured_noise_by_step(releases, groups)
        out["likelihood ratio (measured noise)"] = ratio(np.maximum(measured, 1e-3))
        out["summed release"] = gcs.summed_scores(releases)
        return out

    def accountant(self) -> Any | None:
        """The Opacus accountant ``make_private`` hooked to the attached optimiser, if any."""
        from fedlap_privacy.audit.canaries import opacus_canaries

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
        from fedlap_privacy.audit.canaries.gradient_canary_audit import audit_gradient_canaries

        return audit_gradient_canaries(self, claimed_epsilon, delta, accountant=accountant,
                                       mechanism=mechanism, confidence=confidence, out=out)

