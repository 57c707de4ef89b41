"""Canary clients inside any Flower strategy: a one-run audit of Flower's DP wrappers.

G. Andrew, P. Kairouz, S. Oh, A. Oprea, H. B. McMahan, V. M. Suriyakumar, "One-shot
empirical privacy estimation for federated learning", ICLR 2024 (arXiv:2302.03098), run
as the one-run audit of T. Steinke, M. Nasr, M. Jagielski (NeurIPS 2023).

:func:`~fedlap_privacy.audit.flower.flower_audit.CanaryClients` wraps a Flower strategy (a legacy
``flwr.server.strategy`` one such as ``DifferentialPrivacyServerSideFixedClipping(FedAvg(...))``,
or a Message-API one from ``flwr.serverapp.strategy``) and, in every round's aggregation,
adds the replies of canary clients to the real ones before the strategy clips, averages
and noises them:

* ``m`` canaries, each included by a secret coin (probability 1/2, from the operating
  system's randomness: no seed can be given), each with a fixed random unit direction
  ``c_j`` in ``R^d`` (``d``: the flattened model);
* an included canary takes part in a round with the strategy's own sampling rate (clients
  it configured over clients available, read every round), independently (Poisson); by
  default it takes the place of a sampled real client (``replace_clients``), so a round
  aggregates as many replies as the strategy sampled and each canary weighs what a client
  weighs;
* its reply is the round's global model plus ``c_j`` times ``update_scale * C`` (``C``: the
  wrapper's current clipping norm): 10 C for server-side clipping, which any clipping brings
  to exactly C (a missing clip is seen), exactly C for client-side clipping wrappers, whose
  clients clip themselves; its weight (``num_examples``) is the median of the round's real
  clients unless given;
* after each aggregation the model's change ``Delta_t`` is recorded (projections on every
  ``c_j``).

:meth:`CanaryClientRounds.audit` scores each canary three ways: the cosine of ``c_j`` with
the total change (Andrew et al.'s final-model statistic), the largest cosine with a round's
change ("all iterates"), and the log-likelihood ratio of a Poisson-sampled client,
``sum_t log(1 - q + q exp((u_t - 1/2) / s_t^2))``, with ``u_t`` the round's change along
``c_j`` in units of the claimed per-client sensitivity ``C / n`` (``n``: the wrapper's
``num_sampled_clients``), ``q`` the claimed rate and ``s_t`` the noise the round actually
released in the same units (a robust estimate from the change's coordinates: their median
absolute deviation over 0.6745); ``u_t`` is first centred on its median over the rounds,
which removes what the real clients' common training direction adds along ``c_j`` in
every round (a canary takes part in few rounds). The coins are not used, so the score
stays valid. It is the likelihood-ratio test of one round of a subsampled Gaussian,
summed over rounds. Each score goes through
:func:`~fedlap_privacy.audit.canaries.canary_audit.run_canary_audits`: Steinke's bound, the f-DP
bound and the test against the claimed mechanism's own trade-off curve (a
Poisson-subsampled Gaussian with noise ``z`` at rate ``q`` for ``T`` rounds), Bonferroni
over all of them, plus the Andrew et al. epsilon ESTIMATE (not a bound) for the two cosine
statistics.

The audit sees what the server's aggregation releases: it tests the clipping, the
weighting, the noise and its calibration as they run, not the clients' own training, and
its participation rule is simulated (Poisson at the strategy's rate, where Flower samples a
fixed number of clients).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlap_privacy.accountant.pld import pld_epsilons
from fedlap_privacy.audit.bounds.canary_verdicts import audit_once
from fedlap_privacy.audit.bounds.claim_curve import ClaimCurve, beyond_pld
from fedlap_privacy.audit.canaries.canary_audit import run_canary_audits
from fedlap_privacy.audit.canaries.score_audit import (
    CanaryClaim,
    ClaimedMechanism,
    OnScoreAudit,
    ScoreAuditResult,
)
from fedlap_privacy.audit.reports.report_folder import ReportFolder
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.secret_random import os_generator
from fedlap_privacy.state.canary_state import CanaryState
from fedlap_privacy.state.jsonsafe import json_safe
from fedlap_privacy.vocabulary import CanaryKind

__all__ = [
    "MAX_DIRECTION_BYTES",
    "SERVER_SIDE_SCALE",
    "CanaryClientRounds",
    "CanaryClientRun",
    "FlowerAudit",
]

#: canary update in units of the clip for server-side clipping: any clip brings it to C
SERVER_SIDE_SCALE = 10.0
#: the canaries' directions are kept as an m x d float32 matrix, at most this large
MAX_DIRECTION_BYTES = 2 * 2**30
#: the per-round likelihood-ratio score (beside Andrew et al.'s two cosine statistics)
LIKELIHOOD = "clients/round-likelihood"


@dataclass(frozen=True)
class CanaryClientRun:
    """What the canary clients did: ``canaries`` (m), those ``included`` by their coins, the
    ``rounds`` observed, the model's ``dimension`` and the rounds an included canary took part
    in on average (``mean_participations``)."""

    canaries: int
    included: int
    rounds: int
    dimension: int
    mean_participations: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FlowerAudit(OnScoreAudit):
    """The outcome of :meth:`CanaryClientRounds.audit`: the canary audit's result
    (``audit``, a :class:`~fedlap_privacy.audit.canaries.score_audit.ScoreAuditResult` as
    every canary audit gives, one :class:`~.canary_verdicts.CanaryAudit` per score) and what
    the canary clients did (``run``)."""

    audit: ScoreAuditResult
    run: CanaryClientRun

    @property
    def mechanism(self) -> ClaimedMechanism:
        """The claimed mechanism: the client-level subsampled Gaussian, one step a round."""
        assert self.claim.mechanism is not None
        return self.claim.mechanism

    @property
    def claim_p_value(self) -> float:
        """The smallest claim-curve p-value over the scores (each already corrected)."""
        return min(a.claim_test.p_value for a in self.audits if a.claim_test is not None)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "flower-canary-clients", "verdict": self.verdict,
            "violation": self.violation, "epsilon_lower_bound": self.epsilon_lower_bound,
            "claim": self.claim.to_json(), **self.run.to_json(),
            "audits": [a.to_json() for a in self.audits],
        }

    def summary(self) -> str:
        """A few readable lines: the claim, then per score its bound, p-value, estimate."""
        c, m = self.claim, self.mechanism
        lines = [f"claim: epsilon {c.epsilon:.3f} at delta {c.delta:g} (noise multiplier "
                 f"{m.noise_multiplier:g}, rate {m.sample_rate:.4g}, {m.steps} rounds); "
                 f"verdict: {self.verdict}"]
        for a in self.audits:
            p = "-" if a.claim_test is None else f"{a.claim_test.p_value:.3g}"
            est = "-" if a.estimate is None else f"{a.estimate.epsilon:.2f}"
            lines.append(f"  {a.name:26s} bound {a.epsilon_lower_bound:.3f}  claim-curve "
                         f"p {p}  estimate {est}  {a.verdict}")
        return "\n".join(lines)

    def write(self, out: str | Path) -> dict[str, Path]:
        """Write the audit report of :meth:`ScoreAuditResult.write
        <fedlap_privacy.audit.canaries.score_audit.ScoreAuditResult.write>` (``report.json``,
        ``report.md``, ``report.html``, ``scores.png``) and ``flower-canaries.json`` (this
        record: the claim, the canaries' participation) into ``out``; the paths by kind."""
        paths = self.audit.write(out)
        with ReportFolder(out) as folder:
            path = folder.write_text("flower-canaries.json",
                                     json.dumps(json_safe(self.to_json()), indent=2))
        return {**paths, "flower": path}


class CanaryClientRounds:
    """The canaries of one run and what the aggregation did with them (framework-free:
    :func:`~fedlap_privacy.audit.flower.flower_audit.CanaryClients` feeds it from Flower).
    The coins, directions and per-round draws come from the operating system
    (:func:`~fedlap_privacy.secret_random.os_generator`): a seed anyone knows would make the
    secret coins public."""

    def __init__(self, m: int) -> None:
        if not (isinstance(m, int) and m >= 4):
            raise ConfigError(f"the audit needs at least 4 canary clients, got m={m!r}")
        self._rng = os_generator()
        self.included = self._rng.random(m) < 0.5
        self._direction_seed = int(self._rng.integers(2**62))
        self.dimension: int | None = None
        self.directions: np.ndarray | None = None
        self.projections: list[np.ndarray] = []  # per round: <c_j, Delta_t>
        self.norms: list[float] = []  # per round: |Delta_t|
        self.units: list[float] = []  # per round: the claimed sensitivity C_t / n_t
        self.noise: list[float] = []  # per round: the released noise std (robust estimate)
        self.rates: list[float] = []  # per round: the strategy's sampling rate
        self.participations = np.zeros(m, dtype=np.int64)
        self.total_delta: np.ndarray | None = None

    @property
    def size(self) -> int:
        return len(self.included)

    def state(self) -> CanaryState:
        """The canaries as the project's :class:`~fedlap_privacy.state.canary_state.CanaryState`
        (kind ``clients``): their directions come from it."""
        return CanaryState(
            CanaryKind.CLIENTS.value, torch.from_numpy(self.included.copy()),
            torch.zeros(self.size, dtype=torch.int64), direction_seed=self._direction_seed,
            dimension=self.dimension)

    def start(self, dimension: int) -> None:
        """Fix the model's dimension (first round) and draw the directions."""
        if self.dimension is not None:
            if dimension != self.dimension:
                raise ConfigError(f"the model changed size between rounds: {self.dimension} "
                                  f"then {dimension} parameters")
            return
        if dimension < 3:
            raise ConfigError(f"canary clients need a model of >= 3 parameters, got {dimension}")
        if self.size * dimension * 4 > MAX_DIRECTION_BYTES:
            raise ConfigError(
                f"{self.size} canary directions of {dimension} parameters need "
                f"{self.size * dimension * 4 / 2**30:.1f} GiB: use fewer canaries (m)")
        self.dimension = dimension
        state = self.state()
        self.directions = np.stack([state.direction(j).numpy().astype(np.float32)
                                    for j in range(self.size)])

    def sample(self, rate: float) -> np.ndarray:
        """The included canaries taking part in a round at ``rate`` (each independently)."""
        if not (math.isfinite(rate) and 0.0 < rate <= 1.0):
            raise ConfigError(f"the round's sampling rate must lie in (0, 1], got {rate}")
        self.rates.append(float(rate))
        taking_part = np.flatnonzero(self.included & (self._rng.random(self.size) < rate))
        self.participations[taking_part] += 1
        return taking_part

    def update(self, j: int, norm: float) -> np.ndarray:
        """Canary j's model update: its direction times ``norm`` (float64, flat)."""
        assert self.directions is not None
        return self.directions[j].astype(np.float64) * norm

    def drop(self, count: int) -> np.ndarray:
        """A random order of a round's ``count`` real replies (the canaries take the places
        of the first ones)."""
        return self._rng.permutation(count)

    def observe(self, delta: np.ndarray, clip: float, denominator: float) -> None:
        """Record one aggregation's model change (flat) and its claimed per-client
        sensitivity ``clip / denominator``."""
        assert self.directions is not None
        delta = np.asarray(delta, dtype=np.float64).ravel()
        if delta.shape != (self.dimension,) or not np.all(np.isfinite(delta)):
            raise ConfigError("the aggregated model has another shape or non-finite values")
        self.projections.append(self.directions @ delta.astype(np.float32))
        self.norms.append(float(np.linalg.norm(delta)))
        self.units.append(float(clip) / float(denominator))
        self.noise.append(float(np.median(np.abs(delta - np.median(delta)))) / 0.6745)
        self.total_delta = delta if self.total_delta is None else self.total_delta + delta

    # ------------------------------------------------------------------ the audit
    def claim(self, noise_multiplier: float, delta: float, sample_rate: float | None = None,
              rounds: int | None = None, claimed_epsilon: float | None = None) -> CanaryClaim:
        """The claimed mechanism: the given values, else the rate the strategy sampled at
        (mean over rounds) and the rounds observed; epsilon by the PLD accountant."""
        rate = float(np.mean(self.rates)) if sample_rate is None else float(sample_rate)
        steps = len(self.projections) if rounds is None else int(rounds)
        if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
            raise ConfigError(f"the claimed noise multiplier must be > 0, got {noise_multiplier}")
        mechanism = ClaimedMechanism(float(noise_multiplier), rate, steps).validate()
        if claimed_epsilon is None:
            try:
                claimed_epsilon = pld_epsilons([{(noise_multiplier, rate): steps}], delta)[0]
            except ConfigError:
                raise ConfigError(beyond_pld({(noise_multiplier, rate): steps})) from None
        return CanaryClaim(float(claimed_epsilon), float(delta), mechanism)

    def scores(self, claim: CanaryClaim) -> dict[str, np.ndarray]:
        """Every canary's three scores (module docstring), by audit name."""
        if len(self.projections) < 1 or self.total_delta is None:
            raise ConfigError("no aggregation was observed: nothing to audit")
        proj = np.stack(self.projections).astype(np.float64)  # (rounds, m)
        norms = np.asarray(self.norms)[:, None]
        cosines = np.divide(proj, norms, out=np.zeros_like(proj), where=norms > 0)
        total = proj.sum(axis=0) / max(float(np.linalg.norm(self.total_delta)), 1e-300)
        units = np.asarray(self.units)[:, None]
        u = proj / units  # the change along c_j, in units of C/n
        u = u - np.median(u, axis=0)  # minus what every round has along c_j (training)
        s2 = np.maximum(np.asarray(self.noise)[:, None] / units, 1e-6) ** 2
        assert claim.mechanism is not None
        q = claim.mechanism.sample_rate
        log_lr = np.logaddexp(math.log1p(-q) if q < 1 else -np.inf,
                              math.log(q) + (u - 0.5) / s2)
        return {"clients/final": total, "clients/all-iterates": cosines.max(axis=0),
                LIKELIHOOD: log_lr.sum(axis=0)}

    def audit(self, noise_multiplier: float, delta: float = 1e-5, *,
              sample_rate: float | None = None, rounds: int | None = None,
              claimed_epsilon: float | None = None, confidence: float = 0.95) -> FlowerAudit:
        """Score the canaries and test the claim (module docstring)."""
        if not self.projections:
            raise ConfigError("no aggregation was observed: nothing to audit")
        claim = self.claim(noise_multiplier, delta, sample_rate, rounds, claimed_epsilon)
        if self.included.sum() < 2 or (~self.included).sum() < 2:
            raise ConfigError("the coins left fewer than 2 canaries in or out: use more canaries")
        scores = self.scores(claim)
        m = claim.mechanism
        assert m is not None
        curve = ClaimCurve.from_steps({(m.noise_multiplier, m.sample_rate): m.steps},
                                      delta)
        state = self.state()
        audits = [a if a.name != LIKELIHOOD else replace(a, estimate=None)  # not a cosine
                  for a in audit_once(self, claim.epsilon, delta, lambda: run_canary_audits(
                      state, None, claim.epsilon, delta, confidence, extra_scores=scores,
                      curve=curve))]
        included = self.included
        assert claim.mechanism is not None
        result = ScoreAuditResult(audits, claim, confidence, title="Flower canary clients",
                                  mechanism_epsilon=claim.mechanism.epsilon(claim.delta))
        return FlowerAudit(result, CanaryClientRun(
            self.size, int(included.sum()), len(self.projections), int(self.dimension or 0),
            float(self.participations[included].mean())))
