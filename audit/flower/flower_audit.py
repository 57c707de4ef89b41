"""``CanaryClients``: canary clients around any Flower strategy, in one call.

The canaries and their audit are :mod:`.flower_canaries` (no Flower needed); the Flower
strategies that insert them, :mod:`.flower_strategies`, are imported here only when called,
so that ``fedlap_privacy.audit`` imports without the ``flower`` extra and a missing Flower is
one line.
"""

from __future__ import annotations

from typing import Any

from fedlap_privacy.audit.flower.flower_canaries import CanaryClientRounds
from fedlap_privacy.errors import ConfigError

__all__ = ["CanaryClients"]


def CanaryClients(strategy: Any, m: int = 500, *, clip_norm: float | None = None,
                  update_scale: float | None = None, num_examples: float | None = None,
                  replace_clients: bool = True) -> Any:
    """Wrap a Flower strategy with ``m`` canary clients; returns a strategy of the same API
    (legacy ``flwr.server.strategy.Strategy`` or Message-API
    ``flwr.serverapp.strategy.Strategy``) with ``.canaries`` (:class:`CanaryClientRounds`)
    and ``.audit(...)``. Put it OUTSIDE the DP wrapper, so that the canaries are clipped,
    averaged and noised like every client. ``clip_norm``: the clip to scale the canaries by
    (default: the wrapper's ``clipping_norm``, read every round); ``update_scale``: the
    canary update in units of the clip (default 10, or 1 for the client-side clipping
    wrappers); ``num_examples``: the canary's aggregation weight (default: the median of
    the round's real replies); ``replace_clients``: each canary takes a sampled real
    client's place (default), so that a round averages as many replies as were sampled.
    The canaries' coins come from the operating system: no seed can be given. Needs the
    ``flower`` extra.

    Andrew et al. (ICLR 2024) canary clients, audited as in
    :mod:`~fedlap_privacy.audit.flower.flower_canaries` (its module docstring says how)."""
    try:
        from fedlap_privacy.audit.flower import flower_strategies
    except ImportError as exc:  # flwr missing
        raise ConfigError(f"CanaryClients needs Flower: pip install '.[flower]' in a clone of "
                          f"fedlap-privacy ({exc})") from None
    return flower_strategies.wrap(strategy, CanaryClientRounds(m), clip_norm=clip_norm,
                                  update_scale=update_scale, num_examples=num_examples,
                                  replace_clients=replace_clients)
