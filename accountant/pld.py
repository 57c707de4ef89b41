"""Privacy-loss-distribution accounting of Theorem 5.8 (docs/accounting.md#pld-accounting).

Contract (:mod:`fedlap_privacy.accountant.schedule`): a round is one Poisson-sampled Gaussian
step at ``q1`` and ``T - 1`` at ``q2``, every step with noise multiplier sigma, add/remove-one
neighbours. Composition is commutative, so a run is just a number of steps per rate
(:func:`~fedlap_privacy.accountant.schedule.step_counts`); rounds with different T or rates
(ALI-DPFL, a ledger's per-client rounds under the server threat model) only change the
counts.

Our own PLD accountant, numpy/scipy only, the same numbers as dp-accounting's PLD at its
default grid (interval 1e-4) and an upper bound on the true epsilon:

1. each distinct step (sigma, q) is discretised ONCE per direction (remove, add) and grid by
   pessimistic Connect-the-Dots (:mod:`~fedlap_privacy.accountant.pld_sgm`, cached);
2. all steps compose by one FFT whose window is sized by Chernoff bounds, the mass that
   could alias charged to delta (:mod:`~fedlap_privacy.accountant.pld_fft`);
3. epsilon for delta by a vectorised search over the grid; the larger epsilon of the two
   directions is reported (as dp-accounting's ``get_epsilon_for_delta``).

The grid: every grid gives an upper bound; a finer one a tighter bound at a higher cost
(Connect-the-Dots' excess shrinks like h^2). The grid starts at ``h = 1e-4 * 2^k`` with the
composed loss spanning at least :data:`MIN_POINTS` points (k <= :data:`COARSEST_LEVEL`) and
is halved until the epsilon at h and at 2h differ by at most ``3 * GRID_RTOL`` of epsilon
(an estimated excess of ``GRID_RTOL`` over the limit h -> 0), or until h = 1e-4,
dp-accounting's default; the epsilon at the final h is reported.

A step whose privacy losses span more grid points than
:data:`~fedlap_privacy.accountant.pld_sgm.MAX_BUCKETS`, or a composition longer than
:data:`~fedlap_privacy.accountant.pld_fft.MAX_FFT_LENGTH`, is a one-line ConfigError naming
the RDP accountant, which handles any configuration.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from fedlap_privacy.accountant.pld_fft import compose, epsilon_for_delta, window
from fedlap_privacy.accountant.pld_sgm import (
    MAX_BUCKETS,
    VALUE_INTERVAL,
    DiscretePLD,
    sgm_buckets,
    sgm_pld,
)
from fedlap_privacy.accountant.schedule import RoundSchedule, step_counts

__all__ = [
    "COARSEST_LEVEL",
    "GRID_RTOL",
    "MAX_BUCKETS",
    "MIN_POINTS",
    "VALUE_INTERVAL",
    "pld_buckets",
    "pld_composed_epsilon",
    "pld_epsilon",
    "pld_epsilon_curve",
    "pld_epsilons",
]


#: Estimated excess of the reported epsilon over the h -> 0 limit the grid is refined to.
GRID_RTOL = 3e-4
#: Coarsest grid tried: h = VALUE_INTERVAL * 2^COARSEST_LEVEL.
COARSEST_LEVEL = 6
#: Fewest grid points the composed privacy loss spans on the starting grid.
MIN_POINTS = 2**14


def pld_buckets(sigma: float, q: float = 1.0) -> int:
    """Grid points one step at (sigma, q) spans (q = 1: the widest)."""
    return sgm_buckets(sigma, q)


Steps = Mapping[tuple[float, float], int]


def _parts(steps: Steps, remove: bool, interval: float) -> list[tuple[DiscretePLD, int]]:
    return [
        (sgm_pld(sigma, q, remove, interval), n) for (sigma, q), n in steps.items()
        if q > 0.0 and n > 0
    ]


def _at(step_list: Sequence[Steps], delta: float, level: int) -> list[float]:
    """Epsilon of each composition at grid ``VALUE_INTERVAL * 2^level``, the larger of the
    remove and add directions (q = 1 everywhere: one direction)."""
    interval = VALUE_INTERVAL * 2**level
    rates = {q for steps in step_list for (_, q) in steps if q > 0.0}
    directions = (True,) if rates <= {1.0} else (True, False)
    best = [0.0] * len(step_list)
    for remove in directions:
        for i, steps in enumerate(step_list):
            parts = _parts(steps, remove, interval)
            if parts:
                best[i] = max(best[i], epsilon_for_delta(compose(parts, delta), delta))
    return best


def _start_level(step_list: Sequence[Steps], delta: float) -> int:
    """The coarsest level whose grid spans MIN_POINTS over the widest composed window."""
    interval = VALUE_INTERVAL * 2**COARSEST_LEVEL
    span = 0.0
    for remove in (True, False):
        for steps in step_list:
            parts = _parts(steps, remove, interval)
            if parts:
                win = window(parts, delta)
                span = max(span, (win.upper - win.lower) * interval)
    if span <= 0.0:
        return 0
    return min(max(math.floor(math.log2(span / (VALUE_INTERVAL * MIN_POINTS))), 0),
               COARSEST_LEVEL - 1)


def pld_epsilons(step_list: Sequence[Steps], delta: float) -> list[float]:
    """Epsilon of each composition in ``step_list``, each a map ``(sigma, q) -> number of
    steps``, on the adaptive grid (module docstring); an empty composition is 0."""
    step_list = [
        {(float(sigma), float(q)): int(n) for (sigma, q), n in steps.items()}
        for steps in step_list
    ]
    if not any(q > 0.0 and n > 0 for steps in step_list for (_, q), n in steps.items()):
        return [0.0] * len(step_list)
    level = _start_level(step_list, delta)
    coarse, fine = _at(step_list, delta, level + 1), _at(step_list, delta, level)
    while level > 0 and not all(
        abs(c - f) <= 3 * GRID_RTOL * f for c, f in zip(coarse, fine, strict=True)
    ):
        level -= 1
        coarse, fine = fine, _at(step_list, delta, level)
    return fine


def _with_sigma(counts: dict[float, int], sigma: float) -> dict[tuple[float, float], int]:
    return {(sigma, q): n for q, n in counts.items()}


def pld_composed_epsilon(
    rounds: Iterable[tuple[RoundSchedule, int]], sigma: float, delta: float
) -> float:
    """Epsilon of ``(schedule, number of rounds)`` pairs composed (any order; empty: 0)."""
    return pld_epsilons([_with_sigma(step_counts(rounds), sigma)], delta)[0]


def pld_epsilon(schedule: RoundSchedule, sigma: float, rounds: int, delta: float) -> float:
    """Epsilon after ``rounds`` equal rounds."""
    return pld_composed_epsilon([(schedule, rounds)], sigma, delta)


def pld_epsilon_curve(
    schedule: RoundSchedule, sigma: float, rounds: int, delta: float
) -> list[float]:
    """Epsilon after each round 1..rounds (one composition per round, one grid for all)."""
    return pld_epsilons(
        [_with_sigma(step_counts([(schedule, m)]), sigma) for m in range(1, rounds + 1)], delta
    )
