"""A run's privacy accounting: its schedule, sigma planned for a target, its ledger, the
privacy statement it releases and the warnings it prints (docs/threat-model.md).

The ledger (:class:`~fedlap_privacy.state.ledger.PrivacyLedger`) composes the recorded rounds;
this module decides what a NEW run is accounted with.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from fedlap_privacy.accountant import AccountantName, FedLAPSchedule, epsilon, plan_sigma
from fedlap_privacy.accountant.report import large_epsilon_reason
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.run.run_records import PrivacyStatement
from fedlap_privacy.state.ledger import PrivacyLedger, selection_withheld
from fedlap_privacy.vocabulary import (
    LARGE_EPSILON,
    NOTION_THREAT_MODELS,
    NoiseKind,
    Notion,
    ThreatModel,
)

if TYPE_CHECKING:
    from fedlap_privacy.fl.secure_sum.training import SecurePlan

__all__ = [
    "build_ledger", "check_accountable", "large_epsilon_warning", "planned_epsilon",
    "privacy_statement", "privacy_warnings", "run_schedule", "with_planned_sigma",
]


def run_schedule(cfg: TrainConfig, client_sizes: list[int]) -> FedLAPSchedule | None:
    """The schedule a run's rounds are accounted with (None without a Gaussian accountant).

    Record level: Theorem 5.8 at the smallest client (the largest rate). Client level: one
    SGM over clients per round, at the rate of the run's client sampling
    (:class:`~fedlap_privacy.accountant.client_level.ClientSampling`).
    """
    if cfg.notion == Notion.CLIENT:
        return cfg.sampling.schedule()
    if cfg.notion != Notion.RECORD:
        return None
    smallest = min(range(len(client_sizes)), key=client_sizes.__getitem__)
    if cfg.batch_size > client_sizes[smallest]:  # its rate B / N_k would exceed 1
        raise ConfigError(
            f"batch size {cfg.batch_size} is larger than the smallest client (client "
            f"{smallest}, {client_sizes[smallest]} records): {cfg.method}'s accountant "
            "samples its batches at rate B / N_k, at most 1; lower --batch-size"
            + (" or use --schedule small" if cfg.is_fedlap else "")
        )
    return FedLAPSchedule(
        batch_size=cfg.batch_size, client_size=min(client_sizes),
        local_steps=cfg.accesses_per_round, client_fraction=cfg.client_fraction,
    )


def with_planned_sigma(cfg: TrainConfig, client_sizes: list[int]) -> TrainConfig:
    """``cfg`` itself when it has a sigma (or needs none, or is planned over secure
    aggregation once its model is built); otherwise a NEW configuration whose sigma spends
    ``target_eps`` in ``rounds`` against the run's threat model (against the server: as if
    every round selected the same client)."""
    schedule = run_schedule(cfg, client_sizes)
    if schedule is None or cfg.sigma is not None:
        return cfg
    if cfg.secure_aggregation is not None and cfg.target_eps is not None:
        return cfg  # planned for the model's size (fl.secure_sum.training.with_planned_noise)
    if cfg.target_eps is None:
        raise ConfigError("a DP run needs --sigma, or --target-eps to plan it")
    if cfg.resolved_threat_model == ThreatModel.SERVER:
        schedule = dataclasses.replace(schedule, client_fraction=1.0)
    sigma = plan_sigma(schedule, cfg.rounds, cfg.target_eps, cfg.delta, cfg.accountant)
    if cfg.notion == Notion.CLIENT:  # the plan is the accounted multiplier
        sigma = cfg.sampling.run_sigma(sigma)
    return dataclasses.replace(cfg, sigma=sigma).validate()


def check_accountable(cfg: TrainConfig, schedule: FedLAPSchedule, sigma: float) -> None:
    """Refuse, before any round runs, a run whose accountant cannot price all its rounds
    (``sigma``: the multiplier it composes, :func:`build_ledger`).

    RDP prices any configuration. PLD discretises the privacy loss of the whole run (every
    round, every client selected: the worst case any ledger of the run composes) within a
    memory budget; a run beyond it (very small sigma, or very many accesses) is one line
    naming the RDP fallback, not an error in the middle of training.
    """
    if cfg.accountant == AccountantName.RDP:
        return
    worst = dataclasses.replace(schedule, client_fraction=1.0)
    try:
        epsilon(worst, sigma, cfg.rounds, cfg.delta, cfg.accountant)
    except ConfigError as exc:
        raise ConfigError(f"{cfg.rounds} rounds at sigma {sigma:g}: {exc}; for a run: "
                          "--set accountant=rdp") from None


def build_ledger(cfg: TrainConfig, client_sizes: list[int],
                 secure: SecurePlan | None = None) -> PrivacyLedger:
    """The empty ledger of a run of ``cfg`` (whose sigma is set: :func:`with_planned_sigma`),
    after :func:`check_accountable` found its accountant can price every round. Its sigma is
    the multiplier the accountant composes: the run's, halved for fixed-size client cohorts
    (:mod:`fedlap_privacy.accountant.client_level`); over secure aggregation (``secure``) the
    one against outsiders, :attr:`~fedlap_privacy.fl.secure_sum.training.SecurePlan.outsider_sigma`
    (the epsilon against the server comes from each entry's secure record)."""
    schedule = run_schedule(cfg, client_sizes)
    if schedule is not None and cfg.sigma is None:
        raise ConfigError("a DP run needs --sigma, or --target-eps to plan it")
    sigma = cfg.sigma if secure is None else secure.outsider_sigma
    if sigma is not None and cfg.notion == Notion.CLIENT:  # fixed cohorts: sigma / 2
        sigma = cfg.sampling.accounted_sigma(sigma)
    if schedule is not None and sigma is not None:
        check_accountable(cfg, schedule, sigma)
    return PrivacyLedger(
        cfg.notion, schedule, sigma if schedule else None, cfg.delta if schedule else None,
        cfg.accountant, cfg.ldp_epsilon if cfg.notion == Notion.LOCAL else None,
        cfg.resolved_threat_model, cfg.noise, cfg.clients,
    )


def _finite(eps: float) -> float | None:
    return None if eps == float("inf") else eps


def privacy_statement(cfg: TrainConfig, ledger: PrivacyLedger,
                      secure: str | None = None) -> PrivacyStatement:
    """The privacy statement of a run (in ``ckpt.pt`` and the summary; read by ``audit``).

    ``epsilon`` holds against ``threat_model`` (the one ``target_eps`` enforces), composed by
    ``accountant`` (the run's); ``epsilon_by_accountant`` gives that epsilon by every
    accountant, the run's first (RDP's Theorem 5.8 figure beside PLD's tighter one: both
    bound the same mechanism). Record-level runs also give it against each threat model.
    ``noise`` "seeded" marks a run that is not private (its noise can be recomputed from the
    seed); ``public`` lists what the run releases without noise. ``selection`` says whether
    the release states who was selected in each round ("released") or withholds it because
    the epsilon assumes it hidden ("withheld"); there the epsilon against the server is
    computed from the released ledger too (every client counted in every round), so that it
    reveals nothing of the selection either. Over secure aggregation (``secure``, its
    description) the epsilon is the one against the server (distributed DP, the released
    rounds priced at min_survivors; composed in RDP), the outsiders' (``trusted-server``, by
    the run's accountant) beside it.
    """
    gaussian = cfg.private
    allowed = NOTION_THREAT_MODELS[Notion(ledger.notion)]
    withheld = selection_withheld(ledger.threat_model)
    shown = ledger.released() if withheld else ledger
    by_threat = {t.value: shown.epsilon_under(t) for t in allowed} if len(allowed) > 1 else None
    eps = by_threat[ledger.threat_model] if by_threat and ledger.threat_model else ledger.epsilon
    threat, accountant = ledger.threat_model, cfg.accountant if gaussian else None
    by_accountant = shown.epsilon_by_accountant() if gaussian else None
    if secure is not None:  # the distributed mechanism's RDP (accountant.distributed)
        accountant, by_accountant = AccountantName.RDP.value, None
        by_threat = {ThreatModel.SERVER.value: shown.server_epsilon(), threat or "": eps}
        threat, eps = ThreatModel.SERVER.value, by_threat[ThreatModel.SERVER]
    return PrivacyStatement(
        notion=ledger.notion,
        epsilon=_finite(eps),
        threat_model=threat,
        epsilon_by_threat_model=by_threat,
        delta=cfg.delta if gaussian else None,
        sigma=cfg.sigma if gaussian else None,
        accountant=accountant,
        epsilon_by_accountant=by_accountant,
        round_epsilon=ledger.round_epsilon,
        noise=ledger.noise,
        private=ledger.notion != Notion.NONE and ledger.noise == NoiseKind.SECRET,
        public=tuple(cfg.public_metadata),
        selection="withheld" if withheld else "released",
        # client level: who takes part each round and how that is accounted
        client_sampling=cfg.sampling.describe() if cfg.notion == Notion.CLIENT else None,
        secure_aggregation=secure,
    )


def planned_epsilon(cfg: TrainConfig, sizes: list[int]) -> float | None:
    """The epsilon ``cfg`` (its sigma set) will have spent after all its rounds, every client
    in every round (the worst case its target check uses), against its threat model; None
    without a Gaussian accountant or where the accountant cannot price it."""
    try:
        schedule = run_schedule(cfg, sizes)
    except ConfigError:
        return None
    if schedule is None or cfg.sigma is None:
        return None
    if cfg.resolved_threat_model == ThreatModel.SERVER:
        schedule = dataclasses.replace(schedule, client_fraction=1.0)
    sigma = (cfg.sampling.accounted_sigma(cfg.sigma) if cfg.notion == Notion.CLIENT
             else cfg.sigma)
    try:
        return epsilon(schedule, sigma, cfg.rounds, cfg.delta, cfg.accountant)
    except ConfigError:
        return None


def large_epsilon_warning(cfg: TrainConfig, sizes: list[int], eps: float | None) -> str | None:
    """Why an epsilon above :data:`LARGE_EPSILON` is so large and what lowers it (None when
    it is not): a large sampling rate (few records per client for its batch size, or a large
    client fraction at client level), else the number of noisy steps composed."""
    if eps is None or not eps > LARGE_EPSILON or not cfg.private:
        return None
    if cfg.notion == Notion.CLIENT:
        why = (f"each client takes part in a round with probability {cfg.sampling.q:.2g} "
               f"over {cfg.rounds} rounds")
        change = "more --clients or a smaller --client-fraction"
    else:
        smallest = min(sizes)
        why = large_epsilon_reason(
            eps, cfg.rounds, cfg.accesses_per_round, min(cfg.batch_size / smallest, 1.0),
            cfg.sigma, f"a batch of B {cfg.batch_size} (the smallest client holds "
            f"{smallest:,} records)") or ""
        change = "a smaller --batch-size or more records per client (fewer --clients)"
    target = ("a smaller --target-eps" if cfg.target_eps is not None
              else "a sigma planned by plan --secure-aggregation" if cfg.secure_aggregation
              else "--target-eps E (sigma planned for it)")
    return (f"epsilon {eps:.1f} after {cfg.rounds} rounds is above the usual range (at most "
            f"about {LARGE_EPSILON:g}) and promises little: {why}. To lower it: more noise "
            f"(--sigma above {cfg.sigma:.3g}), fewer --rounds, {change}, or {target}")


def privacy_warnings(cfg: TrainConfig, sizes: list[int],
                     eps: float | None = None) -> list[str]:
    """Settings that are valid but weaken what the guarantee means (``eps``: the run's
    epsilon after its rounds when the caller has it, else :func:`planned_epsilon`)."""
    out = []
    eps = planned_epsilon(cfg, sizes) if eps is None else eps
    if eps is not None and cfg.target_eps is not None:  # the run stops before exceeding it
        eps = min(eps, cfg.target_eps)
    large = large_epsilon_warning(cfg, sizes, eps)
    if large is not None:
        out.append(large)
    if cfg.private:
        unit, n = ("records of the smallest client", min(sizes))
        if cfg.notion == Notion.CLIENT:
            unit, n = "clients", cfg.clients
        if cfg.delta >= 1.0 / n:
            out.append(f"delta {cfg.delta:g} is not well below 1/{n} ({n} {unit}): a mechanism "
                       "that publishes one record in the clear meets it; use delta << 1/n")
    if cfg.notion != Notion.NONE and cfg.reproducible_noise:
        out.append("--reproducible-noise: the DP noise is derived from the seed, so anyone "
                   "with the seed can remove it; this run is NOT private")
    return out
