"""Distributed DP over secure aggregation: sensitivities, RDP, epsilon against the server, and
planning (docs/accounting.md#distributed-dp-over-secure-aggregation). Needs only numpy/scipy.

The mechanism: each of ``n`` clients clips its update to L2 norm ``c``, pads it to ``d`` (a
power of 2), rotates it with a randomised Hadamard transform (norm kept), divides by the grid
step ``gamma``, rounds each coordinate randomly to an integer (conditional rounding: redraw
until the rounded norm is within the bound below), adds its integer noise share and reduces
mod 2^b. Secure aggregation returns only the sum mod 2^b.

Sensitivities (Kairouz, Liu, Steinke, ICML 2021, Thm 1; rounding bias ``beta``), in units of
the original update:

    Delta2 <= min{ c + gamma sqrt(d),
                   sqrt(c^2 + gamma^2 d / 4 + sqrt(2 ln(1/beta)) gamma (c + gamma sqrt(d) / 2)) }

On the integer grid (divide by gamma), ``Delta1 <= Delta2 min(sqrt(d), Delta2)`` because
``|x| <= x^2`` for every integer x.

RDP of the noisy sum at order alpha:

* Skellam (Agarwal, Kairouz, Liu, NeurIPS 2021): total noise Sk(mu, mu) per coordinate
  (variance 2 mu; each of n shares is Sk(mu/n, mu/n)):
  ``alpha Delta2^2/(4 mu) + min{((2 alpha - 1) Delta2^2 + 6 Delta1)/(16 mu^2), 3 Delta1/(4 mu)}``,
  stated for integer orders: fractional orders are reported as infinite (never used).
* discrete Gaussian (KLS Prop. 14): n shares N_Z(0, s^2),
  ``tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 s^2 k/(k+1))`` and
  ``min{ alpha Delta2^2/(2 n s^2) + tau d, alpha/2 (Delta2^2/(n s^2) + 2 Delta1 tau/(sqrt(n) s)
  + tau^2 d), alpha/2 (Delta2/(sqrt(n) s) + tau sqrt(d))^2 }``.

Neighbouring runs differ in one client's update, replaced by zero (the client's participation
is visible to the server). Against the server: no amplification by sampling (the server chose
the cohort), so the RDP of each of a client's participations adds up; only the noise shares
that reached the sum count, and with ``t`` clients colluding with the server only the
``n - t`` honest shares count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from scipy.special import erfcinv

from fedlap_privacy.accountant.rdp import DEFAULT_ORDERS, _as_orders, rdp_to_epsilon, sgm_rdp
from fedlap_privacy.errors import ConfigError

__all__ = [
    "DEFAULT_BETA",
    "DEFAULT_WRAP_PROBABILITY",
    "DistributedEpsilon",
    "DistributedMechanism",
    "DistributedNoise",
    "DistributedPlan",
    "Quantisation",
    "central_gaussian_sigma",
    "counted_shares",
    "discrete_gaussian_rdp",
    "distributed_epsilon",
    "grid_step",
    "l1_sensitivity",
    "l2_sensitivity",
    "padded_dimension",
    "plan_distributed",
    "round_rdp",
    "secure_bits",
    "share_mechanism",
    "share_variance",
    "skellam_rdp",
]

#: conditional rounding bias recommended by Kairouz, Liu, Steinke 2021 (section 4)
DEFAULT_BETA = math.exp(-0.5)
#: probability that one coordinate of the sum leaves [-2^(b-1), 2^(b-1)) (wraps around)
DEFAULT_WRAP_PROBABILITY = 1e-4
#: the noise multipliers plan_distributed searches
_Z_RANGE = (1e-3, 1e4)
_Z_RTOL = 1e-5


class DistributedNoise(StrEnum):
    """The integer noise each client adds to its share."""

    SKELLAM = "skellam"
    DISCRETE_GAUSSIAN = "discrete-gaussian"


def _noise_kind(noise: DistributedNoise | str) -> DistributedNoise:
    try:
        return DistributedNoise(noise)
    except ValueError:
        choices = ", ".join(n.value for n in DistributedNoise)
        raise ConfigError(f"distributed noise {noise!r} is not one of: {choices}") from None


def padded_dimension(size: int) -> int:
    """The smallest power of 2 >= ``size`` (the randomised Hadamard transform needs it)."""
    if not (isinstance(size, int | np.integer) and size >= 1):
        raise ConfigError(f"model size {size!r} must be a positive integer")
    return 1 << (int(size) - 1).bit_length()


def l2_sensitivity(clip: float, dim: int, gamma: float, beta: float) -> float:
    """L2 norm bound of one client's rounded vector, in grid units (KLS 2021, Thm 1).

    ``beta = 0`` is unconditional randomised rounding: only the bound ``c + gamma sqrt(d)``.
    """
    _check_quantisation(clip, dim, gamma, beta)
    root_d = math.sqrt(dim)
    bound = clip + gamma * root_d
    if beta > 0.0:
        spread = math.sqrt(2.0 * math.log(1.0 / beta)) * gamma * (clip + gamma * root_d / 2.0)
        conditional = clip**2 + gamma**2 * dim / 4.0 + spread
        bound = min(bound, math.sqrt(conditional))
    return bound / gamma


def l1_sensitivity(l2: float, dim: int) -> float:
    """L1 bound of an integer vector of L2 norm <= ``l2``: ``l2 min(sqrt(d), l2)``."""
    return l2 * min(math.sqrt(dim), l2)


def _check_quantisation(clip: float, dim: int, gamma: float, beta: float) -> None:
    if not (math.isfinite(clip) and clip > 0):
        raise ConfigError(f"clipping bound {clip!r} must be a positive number")
    if not (isinstance(dim, int | np.integer) and dim >= 1 and dim & (dim - 1) == 0):
        raise ConfigError(f"padded dimension {dim!r} must be a power of 2")
    if not (math.isfinite(gamma) and gamma > 0):
        raise ConfigError(f"grid step gamma {gamma!r} must be a positive number")
    if not 0.0 <= beta < 1.0:
        raise ConfigError(f"rounding bias beta {beta!r} must be in [0, 1)")


@dataclass(frozen=True)
class Quantisation:
    """Clip ``c``, padded dimension ``d``, grid step ``gamma`` and rounding bias ``beta``."""

    clip: float
    dim: int
    gamma: float
    beta: float = DEFAULT_BETA

    def __post_init__(self) -> None:
        _check_quantisation(self.clip, self.dim, self.gamma, self.beta)

    @property
    def l2(self) -> float:
        """L2 sensitivity in grid units."""
        return l2_sensitivity(self.clip, self.dim, self.gamma, self.beta)

    @property
    def l1(self) -> float:
        """L1 sensitivity in grid units."""
        return l1_sensitivity(self.l2, self.dim)


@dataclass(frozen=True)
class DistributedMechanism:
    """One round's mechanism: the quantisation and each client's noise share.

    ``local_std`` is the standard deviation parameter of ONE client's share in grid units: a
    Skellam share Sk(local_std^2/2, local_std^2/2), or a discrete Gaussian share
    N_Z(0, local_std^2).
    """

    noise: DistributedNoise
    quantisation: Quantisation
    local_std: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise", _noise_kind(self.noise))
        if not (math.isfinite(self.local_std) and self.local_std > 0):
            raise ConfigError(f"local noise {self.local_std!r} must be a positive number")


@dataclass(frozen=True)
class DistributedEpsilon:
    """Epsilon against the server, the order attaining it, and what it counted."""

    epsilon: float
    order: float
    delta: float
    participations: int
    fewest_honest_shares: int


def skellam_rdp(l2: float, l1: float, mu: float, orders: Sequence[float] | np.ndarray
                ) -> np.ndarray:
    """RDP of the Skellam sum Sk(mu, mu) per coordinate (Agarwal, Kairouz, Liu 2021).

    The bound is stated for integer orders; at fractional orders this returns infinity.
    """
    a = _as_orders(orders)
    if not (mu > 0 and math.isfinite(mu)):
        raise ConfigError(f"Skellam parameter mu {mu!r} must be a positive number")
    rdp = a * l2**2 / (4.0 * mu) + np.minimum(((2.0 * a - 1.0) * l2**2 + 6.0 * l1) / (16.0 * mu**2),
                                              3.0 * l1 / (4.0 * mu))
    return np.where(a == np.round(a), rdp, np.inf)


def discrete_gaussian_rdp(l2: float, l1: float, s: float, shares: int, dim: int,
                          orders: Sequence[float] | np.ndarray) -> np.ndarray:
    """RDP of the sum of ``shares`` discrete Gaussians N_Z(0, s^2) per coordinate in
    dimension ``dim`` (Kairouz, Liu, Steinke 2021, Prop. 14)."""
    a = _as_orders(orders)
    if not (s > 0 and math.isfinite(s)):
        raise ConfigError(f"discrete Gaussian scale {s!r} must be a positive number")
    n = int(shares)
    k = np.arange(1, n, dtype=float)
    tau = 10.0 * float(np.sum(np.exp(-2.0 * math.pi**2 * s**2 * k / (k + 1.0))))
    var = n * s**2
    first = a * l2**2 / (2.0 * var) + tau * dim
    second = a / 2.0 * (l2**2 / var + 2.0 * l1 * tau / math.sqrt(var) + tau**2 * dim)
    third = a / 2.0 * (l2 / math.sqrt(var) + tau * math.sqrt(dim)) ** 2
    return np.minimum(np.minimum(first, second), third)


def counted_shares(received: int, colluding: int = 0) -> int:
    """Noise shares that protect an honest client against the server: those that reached the
    sum (``received``) less those of the clients colluding with the server."""
    if not (isinstance(received, int | np.integer) and received >= 1):
        raise ConfigError(f"received shares {received!r} must be a positive integer")
    if not (isinstance(colluding, int | np.integer) and colluding >= 0):
        raise ConfigError(f"colluding clients {colluding!r} must be a non-negative integer")
    honest = int(received) - int(colluding)
    if honest < 1:
        raise ConfigError(f"{colluding} colluding clients of {received} leave no honest noise "
                          "share: there is no guarantee against the server")
    return honest


def round_rdp(mechanism: DistributedMechanism, received: int, colluding: int = 0,
              orders: Sequence[float] | np.ndarray = DEFAULT_ORDERS) -> np.ndarray:
    """RDP against the server of one round in which ``received`` shares reached the sum."""
    shares = counted_shares(received, colluding)
    q = mechanism.quantisation
    l2, l1 = q.l2, q.l1
    if mechanism.noise is DistributedNoise.SKELLAM:
        return skellam_rdp(l2, l1, shares * mechanism.local_std**2 / 2.0, orders)
    return discrete_gaussian_rdp(l2, l1, mechanism.local_std, shares, q.dim, orders)


def distributed_epsilon(mechanism: DistributedMechanism, received: Sequence[int], delta: float,
                        colluding: int = 0,
                        orders: Sequence[float] | np.ndarray = DEFAULT_ORDERS
                        ) -> DistributedEpsilon:
    """Epsilon against the server of one client over its participations.

    ``received[i]`` is the number of noise shares that reached the sum in the client's i-th
    participation. No amplification by sampling: the RDP of every participation adds up.
    """
    if not 0.0 < delta < 1.0:
        raise ConfigError(f"delta {delta!r} must be in (0, 1)")
    counts = [int(r) for r in received]
    if not counts:
        raise ConfigError("a client with no participation has no epsilon to account")
    honest = [counted_shares(r, colluding) for r in counts]
    a = _as_orders(orders)
    total = np.zeros_like(a)
    for r, n in _tally(counts):
        total = total + n * round_rdp(mechanism, r, colluding, a)
    eps, order = rdp_to_epsilon(total, a, delta)
    return DistributedEpsilon(eps, order, delta, len(counts), min(honest))


def _tally(counts: list[int]) -> list[tuple[int, int]]:
    values, times = np.unique(np.asarray(counts), return_counts=True)
    return [(int(v), int(t)) for v, t in zip(values, times, strict=True)]


def grid_step(clip: float, dim: int, clients: int, bits: int, local_sigma: float,
              wrap_probability: float = DEFAULT_WRAP_PROBABILITY) -> float:
    """The grid step gamma for which the sum of ``clients`` shares fits mod 2^bits.

    Each coordinate of the rotated sum is treated as sub-Gaussian (Kairouz, Liu, Steinke 2021,
    sections 4.2 and 4.4, and TensorFlow Federated's distributed DP): signal at most
    ``n c / sqrt(d)`` (every client aligned, the rotation flattening each vector), rounding
    variance ``n gamma^2 / 4`` and noise variance ``n sigma^2`` (``local_sigma`` is one share's
    standard deviation in the units of the update). ``k`` standard deviations, with ``k`` the
    two-sided Gaussian quantile of ``wrap_probability``, must fit in 2^bits:

        2^b gamma = 2 k sqrt(n^2 c^2 / d + n gamma^2 / 4 + n sigma^2).
    """
    _check_quantisation(clip, dim, 1.0, 0.0)
    _check_bits(bits, clients)
    if not 0.0 < wrap_probability < 1.0:
        raise ConfigError(f"wrap-around probability {wrap_probability!r} must be in (0, 1)")
    k = math.sqrt(2.0) * float(erfcinv(wrap_probability))
    room = 4.0**bits / (4.0 * k**2) - clients / 4.0
    if room <= 0:
        raise ConfigError(f"{bits} bits cannot hold the rounding of {clients} clients "
                          f"({k:.1f} standard deviations): use more bits or fewer clients")
    return math.sqrt((clients**2 * clip**2 / dim + clients * local_sigma**2) / room)


def _check_bits(bits: int, clients: int) -> None:
    if not (isinstance(clients, int | np.integer) and clients >= 1):
        raise ConfigError(f"clients per round {clients!r} must be a positive integer")
    if not (isinstance(bits, int | np.integer) and 2 <= bits <= 62):
        raise ConfigError(f"bits {bits!r} must be an integer in [2, 62]")


def central_gaussian_sigma(epsilon: float, delta: float, rounds: int,
                           orders: Sequence[float] | np.ndarray = DEFAULT_ORDERS) -> float:
    """Noise multiplier of the central Gaussian sum (sensitivity = clip, no sampling) composed
    ``rounds`` times that reaches ``epsilon`` (RDP, the package's Gaussian: ``sgm_rdp`` at
    q = 1). Bisection in log sigma; the result meets the target."""
    _check_target(epsilon, delta, rounds)
    a = _as_orders(orders)

    def eps_of(sigma: float) -> float:
        return rdp_to_epsilon(rounds * sgm_rdp(1.0, sigma, a), a, delta)[0]

    sigma = _smallest_passing(eps_of, epsilon, *_Z_RANGE)
    if sigma is None:
        raise ConfigError(f"epsilon {epsilon:g} at delta {delta:g} over {rounds} rounds needs a "
                          f"noise multiplier above {_Z_RANGE[1]:g}")
    return sigma


def _check_target(epsilon: float, delta: float, rounds: int) -> None:
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ConfigError(f"epsilon {epsilon!r} must be a positive number")
    if not 0.0 < delta < 1.0:
        raise ConfigError(f"delta {delta!r} must be in (0, 1)")
    if not (isinstance(rounds, int | np.integer) and rounds >= 1):
        raise ConfigError(f"rounds {rounds!r} must be a positive integer")


def _smallest_passing(eps_of: Callable[[float], float], target: float, lo: float, hi: float,
                      points: int = 241) -> float | None:
    """Smallest z in [lo, hi] with eps_of(z) <= target: the first passing point of a log grid,
    then bisection against the failing point before it. ``eps_of`` need not be monotone (the
    rounding floor of a distributed mechanism makes epsilon level off and rise again), so the
    grid finds the first crossing; None when no point passes."""
    grid = np.geomspace(lo, hi, points)
    first = next((i for i, z in enumerate(grid) if eps_of(float(z)) <= target), None)
    if first is None:
        return None
    if first == 0:
        return float(grid[0])
    bad, good = float(grid[first - 1]), float(grid[first])
    while good / bad - 1.0 > _Z_RTOL:
        mid = math.sqrt(bad * good)
        if eps_of(mid) <= target:
            good = mid
        else:
            bad = mid
    return good


@dataclass(frozen=True)
class DistributedPlan:
    """The smallest local noise reaching a target epsilon against the server, and its cost.

    ``noise_multiplier`` is the standard deviation of the summed noise of the fewest honest
    shares (``min_survivors - colluding``) over the clip, in the units of the update
    (``sqrt(min_survivors - colluding) * local_sigma / clip``); ``central_sigma`` is the
    central Gaussian's noise multiplier at the same epsilon, and ``ratio`` their quotient (the
    price of not trusting the server).
    """

    mechanism: DistributedMechanism
    bits: int
    clients: int
    rounds: int
    model_size: int
    noise_multiplier: float
    local_sigma: float
    epsilon: float
    delta: float
    central_sigma: float
    min_survivors: int = 0  # 0: every client of the round (``clients``)
    colluding: int = 0

    @property
    def ratio(self) -> float:
        return self.noise_multiplier / self.central_sigma

    @property
    def modulus(self) -> int:
        return 1 << self.bits


def plan_distributed(noise: DistributedNoise | str, *, epsilon: float, delta: float,
                     model_size: int, clients: int, rounds: int, bits: int, clip: float = 1.0,
                     beta: float = DEFAULT_BETA,
                     wrap_probability: float = DEFAULT_WRAP_PROBABILITY,
                     orders: Sequence[float] | np.ndarray = DEFAULT_ORDERS,
                     min_survivors: int | None = None, colluding: int = 0) -> DistributedPlan:
    """Plan the smallest local noise for a target ``(epsilon, delta)`` against the server.

    ``rounds`` is the number of a client's participations (every round, conservatively, when the
    server may pick the same client each time). A round is released with as few as
    ``min_survivors`` of the ``clients`` shares (None: all of them), ``colluding`` of which
    may be the server's: the plan holds when only ``min_survivors - colluding`` honest shares
    count in every round. For each candidate noise multiplier z the mechanism follows from
    :func:`share_mechanism` (local share ``z clip / sqrt(min_survivors - colluding)``, the grid
    step from the bits for ``clients`` uploads) and its epsilon from
    :func:`distributed_epsilon`; the smallest passing z is returned. Raises ConfigError when
    no noise reaches the target: the rounding then dominates (use more bits).
    """
    noise = _noise_kind(noise)
    _check_target(epsilon, delta, rounds)
    _check_bits(bits, clients)
    survivors = clients if min_survivors is None else int(min_survivors)
    honest = counted_shares(survivors, colluding)  # refuses colluding >= survivors
    if survivors > clients:
        raise ConfigError(f"min_survivors {survivors} is more than the {clients} clients")
    a = _as_orders(orders)

    def mechanism_at(z: float) -> tuple[DistributedMechanism, float]:
        mechanism = share_mechanism(noise, sigma=z, clip=clip, model_size=model_size,
                                    capacity=clients, honest=honest, bits=bits, beta=beta,
                                    wrap_probability=wrap_probability)
        return mechanism, mechanism.local_std * mechanism.quantisation.gamma

    def eps_of(z: float) -> float:
        return distributed_epsilon(mechanism_at(z)[0], [survivors] * rounds, delta, colluding,
                                   a).epsilon

    central = central_gaussian_sigma(epsilon, delta, rounds, a)
    z = _smallest_passing(eps_of, epsilon, central, central * 1e3)
    if z is None:
        raise ConfigError(f"{bits} bits cannot reach epsilon {epsilon:g} for {model_size} "
                          f"parameters, {clients} clients a round and {rounds} rounds at any "
                          "noise: use more bits")
    mechanism, local_sigma = mechanism_at(z)
    return DistributedPlan(mechanism, bits, clients, rounds, model_size, z, local_sigma,
                           eps_of(z), delta, central, survivors, colluding)


def share_mechanism(noise: DistributedNoise | str, *, sigma: float, clip: float,
                    model_size: int, capacity: int, honest: int, bits: int,
                    beta: float = DEFAULT_BETA,
                    wrap_probability: float = DEFAULT_WRAP_PROBABILITY) -> DistributedMechanism:
    """The mechanism of a training round: each client's noise share, from the run's noise
    multiplier ``sigma`` (the summed noise over the clip when only ``honest`` shares count).

    The local share has standard deviation ``sigma clip / sqrt(honest)`` in the units of the
    update, so that ``honest`` = min_survivors - colluding shares (the fewest a released round
    counts) already add ``sigma clip``; the grid step lets the sum of ``capacity`` uploads (the
    most a round sums) fit mod 2^bits (:func:`grid_step`). This is the one function that sets
    the noise a client adds (``fl.secure_sum.encode``) and the noise the accountant prices.
    """
    if not (math.isfinite(sigma) and sigma > 0):
        raise ConfigError(f"noise multiplier {sigma!r} must be a positive number")
    if not (isinstance(honest, int | np.integer) and 1 <= honest <= capacity):
        raise ConfigError(f"honest shares {honest!r} must be in [1, {capacity}]")
    dim = padded_dimension(model_size)
    local_sigma = sigma * clip / math.sqrt(honest)
    gamma = grid_step(clip, dim, capacity, bits, local_sigma, wrap_probability)
    return DistributedMechanism(_noise_kind(noise), Quantisation(clip, dim, gamma, beta),
                                local_sigma / gamma)


def secure_bits(noise: DistributedNoise | str, *, sigma: float, clip: float, model_size: int,
                capacity: int, honest: int, within: float = 0.02, lowest: int = 8,
                highest: int = 62) -> int:
    """The fewest bits whose mechanism (:func:`share_mechanism`) costs at most ``within``
    more noise than central DP: its sensitivity after rounding, Delta2 gamma in the units of
    the update, is at most ``(1 + within) clip``, so the summed noise over it is at least
    ``sigma / (1 + within)``. The rounding floor of about k sqrt(d) / 2^b on the scale sets
    it by the model's size (18 bits for 65k parameters and 20 for 1M at 100 clients and noise
    multiplier 44.8: the table in docs/accounting.md)."""
    for bits in range(lowest, highest + 1):
        try:
            q = share_mechanism(noise, sigma=sigma, clip=clip, model_size=model_size,
                                capacity=capacity, honest=honest, bits=bits).quantisation
        except ConfigError:  # too few bits to hold the sum
            continue
        if q.l2 * q.gamma <= (1.0 + within) * clip:
            return bits
    raise ConfigError(f"no number of bits up to {highest} keeps the extra noise over central "
                      f"DP within {within:.0%} for {model_size} parameters at sigma {sigma:g}")


def share_variance(mechanism: DistributedMechanism) -> float:
    """The variance of one client's noise share in grid units: local_std^2 for Skellam; for
    the discrete Gaussian its pmf's (below s^2 for s < 1: Canonne, Kamath, Steinke 2020)."""
    s = mechanism.local_std
    if mechanism.noise is DistributedNoise.SKELLAM:
        return s**2
    k = np.arange(-math.ceil(12 * s) - 12, math.ceil(12 * s) + 13, dtype=float)
    weights = np.exp(-(k**2) / (2.0 * s**2))
    return float(np.sum(k**2 * weights) / np.sum(weights))
