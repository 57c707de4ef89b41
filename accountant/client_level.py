"""Client-level DP of server-noised federated averaging: the sampling of clients, and the
noise of adaptive clipping (docs/accounting.md#client-level-dp).

Contract, for one round (McMahan et al. 2018, "Learning differentially private recurrent
language models", DP-FedAvg): neighbouring datasets differ by ADDING OR REMOVING ONE CLIENT
(all of its records); each participating client's update is clipped to L2 norm ``C``; the
server adds ``N(0, sigma^2 C^2 I)`` once to the SUM of the clipped updates and divides by a
public constant. The ``n`` clients are public; who is selected must be hidden from whoever
the epsilon holds against (the observers of the released models).

How a round is priced, for each way of drawing its cohort (:class:`ClientSampling`):

* Poisson (``rate`` q): every client takes part independently with probability q; the
  cohort's size varies. The round is the sampled Gaussian mechanism at rate q with noise
  multiplier sigma (Mironov, Talwar, Zhang 2019), exactly what
  :meth:`~fedlap_privacy.accountant.FedLAPSchedule.client_level` describes.
* Fixed size (``cohort`` K, drawn uniformly WITHOUT replacement from the n clients, as
  Flower does). dp-accounting's ``SampledWithoutReplacementDpEvent`` is analysed under
  REPLACE-one adjacency, not the add/remove-one-client notion this package states. Under
  add/remove we use a coupling (conservative): draw the cohort S' of the dataset without
  client x; the dataset with x has the cohort S' (probability 1 - K/n) or S' with one
  uniformly chosen member y replaced by x (probability K/n), which is K uniform clients of
  n. The two sums then differ by ``u_x - u_y``, of norm at most ``2C``. By the joint
  quasi-convexity of Renyi divergence (and of the hockey-stick divergence) over the mixture
  in S' and y, the round is bounded by the POISSON sampled Gaussian at rate ``q = K/n``
  with sensitivity ``2C``: noise multiplier ``sigma / 2``. Rounds compose as usual. The
  factor 2 is the price of a cohort of fixed size under add/remove neighbours (Lebeda et
  al. 2024 discuss why the Poisson accountant at K/n with sensitivity C is not valid here).
  ``n`` is the run's number of clients: a neighbour with one client more has the smaller
  rate K/(n+1), so q = K/n bounds both directions.

Adaptive clipping (Andrew et al. 2021, "Differentially private learning with adaptive
clipping"): each client also reports ``b = 1[||update|| <= C] - 1/2`` (sensitivity 1/2), the
server adds ``N(0, sigma_count^2)`` to their sum. The two Gaussian queries on the same cohort
are one Gaussian query of the pair; its noise multiplier (per unit sensitivity) is
``(sigma_update^-2 + (2 sigma_count)^-2)^-1/2`` (:func:`effective_sigma`). A run states the
multiplier it is ACCOUNTED with, ``sigma``, and the count noise ``sigma_count``; the noise on
the updates is then ``sigma_update = (sigma^-2 - (2 sigma_count)^-2)^-1/2``
(:func:`update_sigma`), larger than sigma, and needs ``2 sigma_count > sigma``. Under fixed
cohorts both sensitivities double (the count's to 1), so the accounted multiplier is
``sigma / 2`` again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedlap_privacy.accountant.schedule import FedLAPSchedule
from fedlap_privacy.errors import ConfigError

__all__ = ["ClientSampling", "effective_sigma", "update_sigma"]


@dataclass(frozen=True)
class ClientSampling:
    """How a round's cohort is drawn from ``clients`` clients: fixed-size ``cohort`` K
    without replacement, or (``cohort`` None) Poisson at ``rate`` q (module docstring)."""

    clients: int
    rate: float = 1.0
    cohort: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.clients, int) and self.clients >= 1):
            raise ConfigError(f"clients {self.clients!r} must be a positive integer")
        if self.cohort is None:
            if not (isinstance(self.rate, float | int) and 0.0 < self.rate <= 1.0):
                raise ConfigError(f"client fraction {self.rate!r} must be in (0, 1]")
        elif not (isinstance(self.cohort, int) and 1 <= self.cohort <= self.clients):
            raise ConfigError(f"a cohort of {self.cohort!r} clients per round must be between "
                              f"1 and the {self.clients} clients")

    @property
    def fixed(self) -> bool:
        return self.cohort is not None

    @property
    def q(self) -> float:
        """The rate of the sampled Gaussian a round is priced as: q, or K / n."""
        return self.rate if self.cohort is None else self.cohort / self.clients

    @property
    def expected_cohort(self) -> float:
        """The public denominator of the average: q n, or K."""
        return self.q * self.clients if self.cohort is None else float(self.cohort)

    @property
    def sensitivity_factor(self) -> float:
        """How many C one client can move the sum by, as the analysis sees it: 1 (Poisson),
        2 (fixed size, a replacement within the cohort)."""
        return 2.0 if self.fixed else 1.0

    def schedule(self) -> FedLAPSchedule:
        """One sampled Gaussian step per round at :attr:`q` over the clients."""
        return FedLAPSchedule.client_level(self.clients, self.q)

    def accounted_sigma(self, sigma: float) -> float:
        """The noise multiplier the accountant composes for a run of multiplier ``sigma``."""
        return sigma / self.sensitivity_factor

    def run_sigma(self, accounted: float) -> float:
        """The run's multiplier whose :meth:`accounted_sigma` is ``accounted``."""
        return accounted * self.sensitivity_factor

    def describe(self) -> str:
        """One line for a summary: the sampling and how it is accounted."""
        if self.cohort is None:
            return (f"Poisson client sampling at rate {self.rate:g} (cohort size varies), "
                    "accounted as the sampled Gaussian at that rate")
        return (f"fixed cohorts of {self.cohort} of {self.clients} clients drawn without "
                f"replacement, accounted as the sampled Gaussian at rate {self.q:g} with "
                "twice the sensitivity (add/remove-one-client neighbours)")


def effective_sigma(update: float, count: float) -> float:
    """Andrew et al. 2021: the noise multiplier of the update sum (``update``, sensitivity
    C) and the centred count (noise std ``count``, sensitivity 1/2) released together:
    ``(update^-2 + (2 count)^-2)^-1/2``."""
    if not (update > 0 and count > 0):
        raise ConfigError("noise multipliers must be positive")
    return (update**-2 + (2.0 * count) ** -2) ** -0.5


def update_sigma(sigma: float, count: float) -> float:
    """The update noise that, released with a count of noise std ``count``, is accounted as
    multiplier ``sigma`` (the inverse of :func:`effective_sigma`); one line when
    ``2 count <= sigma`` (the count alone would spend more than sigma allows)."""
    if not (sigma > 0 and count > 0):
        raise ConfigError("noise multipliers must be positive")
    rest = sigma**-2 - (2.0 * count) ** -2
    if rest <= 0:
        raise ConfigError(
            f"adaptive clipping: the count noise clip_count_sigma {count:g} must exceed "
            f"sigma/2 = {sigma / 2:g} (Andrew et al.: sigma^-2 = sigma_update^-2 + "
            "(2 sigma_count)^-2); raise clip_count_sigma, or lower sigma (a larger target "
            "epsilon)")
    return 1.0 / math.sqrt(rest)
