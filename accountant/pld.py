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
(Connect-the-Dots' excess shrinks like h^2). Every composition is first priced at the coarsest
grid ``h = 1e-4 * 2^COARSEST_LEVEL``, in both directions: that fixes the start, the level
whose grid has the widest composed window span at least :data:`MIN_POINTS` points, and which
direction dominates. Finer grids are computed for the dominating direction only; the other
only while its finest value so far (an upper bound on it) exceeds the dominating one's. The
grid is halved until the epsilon at two grids ``k`` halvings apart differ by at most
``(4^k - 1) * GRID_RTOL`` of epsilon (an estimated excess of ``GRID_RTOL`` over the limit
h -> 0; the coarsest grid is the first check's coarse one when ``k <= 2``, the start's
neighbour otherwise), or until h = 1e-4, dp-accounting's default; the epsilon at the final h
is reported.

A step whose privacy losses span more grid points than
:data:`~fedlap_privacy.accountant.pld_sgm.MAX_BUCKETS`, or a composition longer than
:data:`~fedlap_privacy.accountant.pld_fft.MAX_FFT_LENGTH`, is a one-line ConfigError naming
the RDP accountant, which handles any configuration.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from fedlap_privacy.accountant.pld_fft import compose, epsilon_for_delta
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
MIN_POINTS = 3 * 2**13  # 24,576


def pld_buckets(sigma: float, q: float = 1.0) -> int:
    """Grid points one step at (sigma, q) spans (q = 1: the widest)."""
    return sgm_buckets(sigma, q)


Steps = Mapping[tuple[float, float], int]


def _parts(steps: Steps, remove: bool, interval: float) -> list[tuple[DiscretePLD, int]]:
    return [
        (sgm_pld(sigma, q, remove, interval), n) for (sigma, q), n in steps.items()
        if q > 0.0 and n > 0
    ]


Direction = bool  # True: remove, False: add


class _Grid:
    """Epsilons of one list of compositions, per grid level and direction, computed once
    each (a level is ``h = VALUE_INTERVAL * 2^level``)."""

    def __init__(self, step_list: Sequence[Steps], delta: float) -> None:
        self.step_list, self.delta = step_list, delta
        rates = {q for steps in step_list for (_, q) in steps if q > 0.0}
        self.directions: tuple[Direction, ...] = (True,) if rates <= {1.0} else (True, False)
        self.values: dict[tuple[int, int, Direction], float] = {}
        self.span = 0.0  # widest composed window at COARSEST_LEVEL, in loss units

    def epsilon(self, i: int, level: int, remove: Direction) -> float:
        """Epsilon of composition ``i`` in one direction at one level (0 if empty)."""
        key = (i, level, remove)
        if key not in self.values:
            interval = VALUE_INTERVAL * 2**level
            parts = _parts(self.step_list[i], remove, interval)
            value = 0.0
            if parts:
                composed = compose(parts, self.delta)
                if level == COARSEST_LEVEL:
                    self.span = max(self.span, composed.span)
                value = epsilon_for_delta(composed, self.delta)
            self.values[key] = value
        return self.values[key]

    def bound(self, i: int, level: int) -> float:
        """An upper bound on the epsilon of composition ``i`` (the larger of its
        directions'): the direction that was the larger at the coarsest level is computed at
        ``level``; the other only if its finest value so far exceeds that (any grid gives an
        upper bound, so a coarser value below it cannot raise the maximum)."""
        first, *others = sorted(
            self.directions, key=lambda d: -self.epsilon(i, COARSEST_LEVEL, d)
        )
        best = self.epsilon(i, level, first)
        for d in others:
            finest = min(lv for (j, lv, dd) in self.values if j == i and dd == d)
            if self.values[(i, finest, d)] > best:
                best = max(best, self.epsilon(i, level, d))
        return best


def _start_level(span: float) -> int:
    """The coarsest level whose grid spans MIN_POINTS over the widest composed window
    (``span``, in loss units, at COARSEST_LEVEL)."""
    if span <= 0.0:
        return 0
    return min(max(math.floor(math.log2(span / (VALUE_INTERVAL * MIN_POINTS))), 0),
               COARSEST_LEVEL - 1)


def _agree(coarse: Sequence[float], fine: Sequence[float], levels: int) -> bool:
    """Whether the estimated excess of every fine epsilon over the h -> 0 limit is at most
    GRID_RTOL of it, the grids ``levels`` halvings apart: with Connect-the-Dots' excess
    ``c h^2``, ``coarse - fine = (4^levels - 1)`` times the fine excess."""
    factor = 4**levels - 1
    return all(abs(c - f) <= factor * GRID_RTOL * f for c, f in zip(coarse, fine, strict=True))


def pld_epsilons(step_list: Sequence[Steps], delta: float) -> list[float]:
    """Epsilon of each composition in ``step_list``, each a map ``(sigma, q) -> number of
    steps``, on the adaptive grid (module docstring); an empty composition is 0."""
    step_list = [
        {(float(sigma), float(q)): int(n) for (sigma, q), n in steps.items()}
        for steps in step_list
    ]
    if not any(q > 0.0 and n > 0 for steps in step_list for (_, q), n in steps.items()):
        return [0.0] * len(step_list)
    grid = _Grid(step_list, delta)
    indices = range(len(step_list))

    def at(level: int) -> list[float]:
        return [grid.bound(i, level) for i in indices]

    top = at(COARSEST_LEVEL)  # every direction: the span, and which direction dominates
    level = _start_level(grid.span)
    if level == 0:
        return at(0)
    # the coarsest grid (computed anyway) is the coarse grid of the first check when it is
    # at most two halvings above the start; otherwise the start's neighbour is
    coarse_level = COARSEST_LEVEL if COARSEST_LEVEL - level <= 2 else level + 1
    coarse, fine = (top if coarse_level == COARSEST_LEVEL else at(coarse_level)), at(level)
    while level > 0 and not _agree(coarse, fine, coarse_level - level):
        coarse_level, level = level, level - 1
        coarse, fine = fine, at(level)
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
