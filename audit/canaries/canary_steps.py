"""What a DP optimiser was set up with, what it did at each released step, and what changed.

Opacus's accountant reads ``optimizer.noise_multiplier`` and the accumulated micro-batches at
every step (``hook_fn`` of ``IAccountant.get_optimizer_hook_fn``: it accounts
``sample_rate * accumulated_iterations``), so an epsilon taken from it after training follows
whatever the training did: noise cut to 0.3x after ``make_private`` is accounted as such, and
the audit of a claim that large can refute nothing. The claim an auditor acts on is the one
the run was set up to keep: :class:`OptimizerSetup` (recorded when the canaries attach) and the
rate the accountant was given at the first released step. :class:`StepRecord` holds each
released step's actual values; :func:`changes` lists, for each quantity, the values that
differ from the set-up one, with the steps they ran at. Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Change", "OptimizerSetup", "StepRecord", "changes", "describe_change"]


@dataclass(frozen=True)
class OptimizerSetup:
    """An Opacus ``DPOptimizer`` as the canaries found it at ``attach``: its noise multiplier
    and clipping norm, the per-batch sample rate ``make_private`` gave its accountant hook
    (``1 / len(data_loader)``; None when it has no hook), its expected batch size, its loss
    reduction and the accountant's name (``rdp``, ``prv``, ``gdp``; None without one)."""

    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float | None
    expected_batch_size: float | None
    loss_reduction: str
    accountant: str | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StepRecord:
    """One released step: the noise multiplier and clipping norm that ran, the sample rate
    the step is accounted at (the accountant's ``sample_rate * accumulated_iterations`` for
    Opacus, the canaries' rate in a plain loop), the micro-batches accumulated into it and
    the expected batch size the optimiser divided by (None in a plain loop)."""

    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float
    accumulated_iterations: int = 1
    expected_batch_size: float | None = None


@dataclass(frozen=True)
class Change:
    """``quantity`` ran at ``value`` instead of the set-up ``set_up`` on ``steps`` released
    steps, the first at ``first_step`` and the last at ``last_step`` (1-based)."""

    quantity: str
    set_up: float
    value: float
    first_step: int
    last_step: int
    steps: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


#: the quantities :func:`changes` compares, by their name in a report
_QUANTITIES = {"noise multiplier": "noise_multiplier", "clipping norm": "max_grad_norm",
               "accounted sample rate": "sample_rate",
               "accumulated micro-batches": "accumulated_iterations",
               "expected batch size": "expected_batch_size"}


def changes(set_up: StepRecord, steps: list[StepRecord]) -> tuple[Change, ...]:
    """Every value of each quantity that differs from ``set_up``'s (relative difference above
    1e-9), with the steps it ran at; in order of the quantity, then of the first step."""
    found: list[Change] = []
    for name, field in _QUANTITIES.items():
        reference = getattr(set_up, field)
        if reference is None:
            continue
        seen: dict[float, list[int]] = {}
        for index, step in enumerate(steps, start=1):
            value = getattr(step, field)
            if value is None or abs(value - reference) <= 1e-9 * max(abs(reference), 1e-300):
                continue
            seen.setdefault(float(value), []).append(index)
        for value, at in sorted(seen.items(), key=lambda item: item[1][0]):
            found.append(Change(name, float(reference), value, at[0], at[-1], len(at)))
    return tuple(found)


def describe_change(change: Change, total_steps: int) -> str:
    """One line: ``noise multiplier 0.3 instead of the set-up 1 at 110 of 120 steps (steps
    11-120)``."""
    span = (f"step {change.first_step}" if change.steps == 1
            else f"steps {change.first_step}-{change.last_step}")
    return (f"{change.quantity} {change.value:.4g} instead of the set-up {change.set_up:.4g} "
            f"at {change.steps} of {total_steps} steps ({span})")
