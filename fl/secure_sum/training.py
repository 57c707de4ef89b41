"""Client-level DP-FedAvg over secure aggregation, one training round in process
(docs/threat-model.md#secure-aggregation; Kairouz, Liu, Steinke, ICML 2021; Agarwal,
Kairouz, Liu, NeurIPS 2021; Bell et al., CCS 2020).

:class:`SecurePlan` is the run's mechanism, fixed before round 1 from its configuration and
the model's size (:func:`~fedlap_privacy.accountant.distributed.share_mechanism`: the one
place the local noise share is computed, for the clients and for the accountant alike).
:func:`secure_sum_round` is one round: every client of the round gets fresh masking seeds
(:func:`~.masking.setup_round`) and a public rotation seed; each client that answers encodes
its clipped update with its own noise share (:func:`~.encoding.encode`) and masks it; the
server object (:class:`~.masking.SecureSumServer`) holds only the masked uploads, unmasks
their sum if at least ``min_survivors`` arrived, checks that the sum carries the noise of
the shares that reached it (:func:`check_noise`) and decodes it. A round refused for too few
survivors was never unmasked: it releases nothing and its record spends nothing. A sum that
fails the noise check does not move the model, but the server has unmasked it: its record
charges the shares the sum's noise shows (:func:`shares_present`, a lower bound).

Which noise an audit can see missing: a client that skips its share (``encode(add_noise=
False)``) removes 1/r of the summed noise variance of r shares. Canary clients cannot show it
at test sizes: their one-run audit bounds epsilon from below by ranking a few dozen canary
cosines, far from resolving a noise standard deviation lower by a factor sqrt((r-1)/r)
(about 0.89 at r = 5). The server can: the decoded sum has d coordinates whose squares add
up to about d r v (v: one share's variance) plus at most (r Delta2)^2 of signal, so a sum
whose squared norm, even with all the signal counted as noise, falls below d r v (1 - 6
sqrt(3/d)) lacks noise; that catches one skipped share when 1/r exceeds 6 sqrt(3/d) plus the
signal's part (d = 2^15, r up to about 17), with a false alarm below a six-sigma tail.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fedlap_privacy.accountant.distributed import (
    DistributedMechanism,
    central_gaussian_sigma,
    distributed_epsilon,
    plan_distributed,
    secure_bits,
    share_mechanism,
    share_variance,
)
from fedlap_privacy.fl.secure_sum.encoding import SecureSumSpec, decode, encode
from fedlap_privacy.fl.secure_sum.masking import (
    MaskingClient,
    Reveal,
    RoundRefused,
    SecureSumServer,
    setup_round,
)
from fedlap_privacy.state.secure_rounds import SecureRound

if TYPE_CHECKING:
    from fedlap_privacy.fl.config import TrainConfig

__all__ = ["MaskedRound", "SecureOutcome", "SecurePlan", "check_noise", "finish_round",
           "round_spec", "secure_sum_round", "shares_present", "with_planned_noise"]

#: the tail, in standard deviations of the squared norm, the noise check allows
_NOISE_CHECK_SIGMAS = 6.0


def with_planned_noise(cfg: TrainConfig, model_size: int) -> TrainConfig:
    """``cfg`` itself when it has a sigma; otherwise (``--target-eps``) a NEW configuration
    whose sigma and bits spend ``target_eps`` against the server over ``rounds``
    participations of one client, each round counting the fewest honest shares
    (:func:`~fedlap_privacy.accountant.distributed.plan_distributed`, as ``plan
    --secure-aggregation`` plans it). The bits are ``secure_bits``, else the fewest within 2%
    of central DP at the central Gaussian's multiplier for the target; both are recorded in
    the configuration, so the run's mechanism (:meth:`SecurePlan.of`) is the plan's."""
    if cfg.sigma is not None:
        return cfg
    assert cfg.secure_aggregation is not None and cfg.target_eps is not None
    common = dict(clip=cfg.clip, model_size=model_size)
    bits = cfg.secure_bits or secure_bits(
        cfg.secure_aggregation, capacity=cfg.secure_capacity,
        sigma=central_gaussian_sigma(cfg.target_eps, cfg.delta, cfg.rounds),
        honest=cfg.secure_min_survivors - cfg.colluding, **common)
    plan = plan_distributed(cfg.secure_aggregation, epsilon=cfg.target_eps, delta=cfg.delta,
                            clients=cfg.secure_capacity, rounds=cfg.rounds, bits=bits,
                            min_survivors=cfg.secure_min_survivors, colluding=cfg.colluding,
                            **common)
    return dataclasses.replace(cfg, sigma=plan.noise_multiplier, secure_bits=bits).validate()


@dataclass(frozen=True)
class SecurePlan:
    """A run's secure-aggregation mechanism: noise, bits, the most uploads a round sums
    (``capacity``), the fewest it is released with, the colluding clients, the model size."""

    mechanism: DistributedMechanism
    bits: int
    capacity: int
    min_survivors: int
    colluding: int
    model_size: int

    @classmethod
    def of(cls, cfg: TrainConfig, model_size: int) -> SecurePlan:
        """The mechanism of ``cfg`` (validated, sigma set) for a model of ``model_size``
        parameters: each share planned so that min_survivors - colluding honest shares add
        noise ``sigma clip``; bits ``secure_bits`` or the fewest within 2% of central DP."""
        assert cfg.secure_aggregation is not None and cfg.sigma is not None
        honest = cfg.secure_min_survivors - cfg.colluding
        common = dict(sigma=cfg.sigma, clip=cfg.clip, model_size=model_size,
                      capacity=cfg.secure_capacity, honest=honest)
        bits = cfg.secure_bits or secure_bits(cfg.secure_aggregation, **common)
        return cls(share_mechanism(cfg.secure_aggregation, bits=bits, **common), bits,
                   cfg.secure_capacity, cfg.secure_min_survivors, cfg.colluding, model_size)

    @property
    def outsider_sigma(self) -> float:
        """The noise multiplier against those who see only the released models: the noise of
        the fewest honest shares over the sensitivity after rounding, sigma c / (Delta2
        gamma), with the summed integer noise taken as the Gaussian of its variance."""
        q = self.mechanism.quantisation
        honest = self.min_survivors - self.colluding
        return math.sqrt(honest) * self.mechanism.local_std / q.l2

    @property
    def extra_noise(self) -> float:
        """The price of rounding: the sensitivity after rounding over the clip (Delta2 gamma /
        c); the summed noise is worth sigma over it (1.02 or less at the default bits)."""
        q = self.mechanism.quantisation
        return q.l2 * q.gamma / q.clip

    def planned_epsilon(self, rounds: int, delta: float) -> float:
        """Epsilon against the server after ``rounds`` participations of one client, each
        round counting the fewest honest shares (min_survivors - colluding): what the run's
        ledger never exceeds."""
        honest = self.min_survivors - self.colluding
        return distributed_epsilon(self.mechanism, [self.min_survivors] * rounds, delta,
                                   self.colluding).epsilon if honest >= 1 else math.inf

    def warnings(self) -> list[str]:
        if self.extra_noise <= 1.02:
            return []
        return [f"{self.bits} bits: rounding inflates the sensitivity {self.extra_noise:.3g} "
                "times, so the summed noise is worth sigma over that; more --bits (or the "
                "default, the fewest within 2%) lowers epsilon"]

    @property
    def upload_bytes(self) -> int:
        """What one client uploads a round: its masked vector, 8 bytes a coordinate of the
        padded dimension."""
        return 8 * self.mechanism.quantisation.dim

    def sum_server(self) -> SecureSumServer:
        """A round's server side of the masking, for this mechanism's vectors."""
        return SecureSumServer(self.bits, self.mechanism.quantisation.dim, self.min_survivors)

    def record(self, planned: int, received: int, released: bool) -> SecureRound:
        return SecureRound.of(self.mechanism, self.bits, planned, received, self.min_survivors,
                              self.colluding, released)

    def describe(self) -> str:
        q = self.mechanism.quantisation
        return (f"{self.mechanism.noise.value} shares over secure aggregation mod 2^{self.bits}"
                f" (d {q.dim}, gamma {q.gamma:.4g}, each share {self.mechanism.local_std:.4g} "
                f"grid units), a round released with at least {self.min_survivors} uploads, "
                f"{self.colluding} clients assumed colluding with the server")


@dataclass(frozen=True)
class SecureOutcome:
    """A round's result: the decoded noisy sum of the clipped updates (None: refused), its
    ledger record and why it was refused."""

    total: np.ndarray | None
    record: SecureRound
    refused: str | None = None


def _norm(total: np.ndarray, spec: SecureSumSpec) -> float:
    """The L2 norm of the sum, its residues centred on zero."""
    centred = np.asarray(total, dtype=np.uint64).astype(np.int64)
    centred[centred >= spec.modulus // 2] -= spec.modulus
    return math.sqrt(math.fsum(centred.astype(np.float64) ** 2))


def shares_present(total: np.ndarray, spec: SecureSumSpec, received: int) -> int:
    """A lower bound on the noise shares in the sum: its squared norm less the most the
    ``received`` clipped updates can add, over one share's ``d v``, at the check's tail (the
    squared norm of ``k`` shares is ``d k v (1 +- 6 sqrt(3/d))``)."""
    q = spec.mechanism.quantisation
    noise = max(0.0, _norm(total, spec) - received * q.l2) ** 2
    per_share = q.dim * share_variance(spec.mechanism)
    return min(received, int(noise / (per_share * (1.0 + _NOISE_CHECK_SIGMAS
                                                   * math.sqrt(3.0 / q.dim)))))


def check_noise(total: np.ndarray, spec: SecureSumSpec, received: int) -> None:
    """The server's check that the sum carries the noise of ``received`` shares (module
    docstring); raises :class:`RoundRefused` when it does not."""
    q = spec.mechanism.quantisation
    norm = _norm(total, spec)
    expected = q.dim * received * share_variance(spec.mechanism)
    floor = expected * (1.0 - _NOISE_CHECK_SIGMAS * math.sqrt(3.0 / q.dim))
    if (norm + received * q.l2) ** 2 < floor:
        raise RoundRefused(f"the sum carries less noise than {received} shares add (squared "
                           f"norm {norm**2:.4g}, expected {expected:.4g}): a client skipped "
                           "its noise share; not released")


@dataclass
class MaskedRound:
    """A round's masked uploads as a remote driver (Flower's) collected them: the round's
    public parameters, what the server holds, how to ask the survivors to unmask, and the
    clients set up (``planned``)."""

    spec: SecureSumSpec
    server: SecureSumServer
    reveal: Reveal
    planned: int


def round_spec(plan: SecurePlan) -> SecureSumSpec:
    """A round's public parameters: the run's mechanism and a fresh public rotation seed."""
    return SecureSumSpec(plan.mechanism, plan.bits, plan.model_size, secrets.token_bytes(32))


def finish_round(plan: SecurePlan, spec: SecureSumSpec, server: SecureSumServer,
                 reveal: dict[int, MaskingClient] | Reveal, planned: int) -> SecureOutcome:
    """The server's part of a round whose uploads ``server`` holds: unmask their sum with the
    survivors' answers (``reveal``), check its noise and decode it (module docstring)."""
    received = len(server.survivors)
    try:
        total = server.unmask(reveal)
    except RoundRefused as exc:  # never unmasked: nothing seen, nothing spent
        return SecureOutcome(None, plan.record(planned, received, released=False), str(exc))
    try:
        check_noise(total, spec, received)
    except RoundRefused as exc:  # unmasked: the server saw the sum, charged at its noise
        present = shares_present(total, spec, received)
        return SecureOutcome(None, plan.record(planned, present, released=True),
                             f"{exc}; charged at the {present} shares its noise shows")
    return SecureOutcome(decode(total, spec), plan.record(planned, received, released=True))


def secure_sum_round(plan: SecurePlan, updates: list[np.ndarray], planned: int
                     ) -> SecureOutcome:
    """One round in process (module docstring): ``planned`` clients set up, the first
    ``len(updates)`` answer with their clipped updates (flat float vectors of the model's
    size); the others dropped out."""
    spec = round_spec(plan)
    clients = setup_round(range(planned), plan.bits)
    server = plan.sum_server()
    for cid, update in enumerate(updates):  # client side: its own share, masked
        server.receive(cid, clients[cid].mask(encode(update, spec)))
    return finish_round(plan, spec, server, clients, planned)
