"""The per-round metrics a run releases (``ckpt.pt``, ``metrics.jsonl``).

Under a threat model whose epsilon assumes the selection hidden (``hidden-selection``,
``trusted-server``: :func:`fedlap_privacy.state.ledger.selection_withheld`) the released metrics
must not reveal who took part in a round nor how many did: the number of clients selected
and answering, the realised accesses, the mean upload (client sizes and class lists are
public, so a mean over the selected clients points at them), the seconds a round took (it
grows with the cohort) and the server step's own statistics (e.g. FedLAP-DP's server
steps, which count the synthetic sets received). Only an allow-list is released there: the
metrics on public data, the ledger's numbers (computed from the rates alone) and the
server-step values a method declares public (``Method.public_extras`` of
:mod:`fedlap_privacy.fl.methods.interface`: the noisy mechanism's own releases, or public
constants). Under the ``server`` threat model the server knows the selection anyway; everything is
released. The full metrics stay in the run's private state.
"""

from __future__ import annotations

from fedlap_privacy.fl.run.run_records import RoundRecord
from fedlap_privacy.state.ledger import selection_withheld

__all__ = ["RELEASED_UNDER_HIDDEN_SELECTION", "released_history", "released_round"]

#: what a round's metrics release where the selection is hidden (module docstring): the
#: fields of :class:`~fedlap_privacy.fl.run.run_records.RoundRecord` but those of
#: ``SELECTION_FIELDS``, and none of its ``extras`` but the method's public ones
RELEASED_UNDER_HIDDEN_SELECTION = (
    "round", "test_accuracy", "test_loss", "epsilon", "delta", "rounds_spent", "local_steps",
    "lr",
)


def released_round(metrics: RoundRecord, threat_model: str | None,
                   public_extras: tuple[str, ...] = ()) -> RoundRecord:
    """One round's metrics as released under ``threat_model`` (module docstring)."""
    if not selection_withheld(threat_model):
        return metrics
    return metrics.withholding_selection(public_extras)


def released_history(history: list[RoundRecord], threat_model: str | None,
                     public_extras: tuple[str, ...] = ()) -> list[RoundRecord]:
    """Every round of ``history`` as :func:`released_round` releases it."""
    return [released_round(h, threat_model, public_extras) for h in history]
