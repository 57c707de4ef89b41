"""The privacy promise an audit tests (docs/audit.md#what-is-tested), recomputed from the
run's ledger rather than read from the checkpoint's stored claim:

* ``record-level`` -- the audit tests exactly the promised (epsilon, delta);
* ``client-level`` -- a record is inside one client, and changing one client's data is two
  add/remove steps, so by group privacy the promise for a record is
  ``(2 epsilon, (1 + e^epsilon) delta)``; that is what is tested;
* ``local`` (LDP-FL's per-weight, per-round epsilon, docs/accounting.md#local-dp) and ``none``
  -- no bound on record membership of the released model follows, so nothing is tested.
"""

from __future__ import annotations

import math
from typing import Any

from fedlap_privacy.audit.reports.results import PrivacyClaim
from fedlap_privacy.state.ledger import PrivacyLedger
from fedlap_privacy.state.run_state import PrivateRunState
from fedlap_privacy.vocabulary import Notion

__all__ = ["config_delta", "privacy_claim"]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(out) else out


def privacy_claim(privacy: Any, ledger: Any = None, digest: str | None = None) -> PrivacyClaim:
    """The promise the audit tests, RECOMPUTED from the run's ledger (module docstring).

    ``epsilon`` / ``delta`` / ``notion`` / ``threat_model`` come from composing the ledger's
    recorded rounds (:meth:`fedlap_privacy.state.ledger.PrivacyLedger.replay`, checked against the
    private state's ``digest`` when given); the checkpoint's stored ``privacy.epsilon`` is
    only reported beside it (``stored_epsilon``, ``stored_matches``; over secure aggregation
    the stored epsilon is the one against the server, recomputed from the entries' secure
    records, while the audit tests the outsiders' promise the released model is bound by).
    """
    privacy = privacy if isinstance(privacy, dict) else {}
    replayed = PrivacyLedger.replay(ledger if ledger is not None else [], digest)
    notion = replayed.notion
    recomputed = replayed.epsilon
    epsilon = None if math.isinf(recomputed) else recomputed
    delta = replayed.delta
    stored = _number(privacy.get("epsilon"))
    headline = epsilon  # over secure aggregation the stored one is against the server
    if any(e.secure is not None for e in replayed.entries):
        server = replayed.server_epsilon()
        headline = None if math.isinf(server) else server
    recorded = dict(
        notion=notion, epsilon=epsilon, delta=delta,
        accountant=replayed.accountant if Notion(notion).gaussian else None,
        threat_model=replayed.threat_model, noise=replayed.noise,
        rounds=replayed.rounds_spent, stored_epsilon=stored,
        stored_matches=(stored is None and headline is None) or (
            stored is not None and headline is not None
            and math.isclose(stored, headline, rel_tol=1e-6)),
    )
    return PrivacyClaim(**recorded, **_tested(notion, epsilon, delta))


def _tested(notion: str, epsilon: float | None, delta: float | None) -> dict[str, Any]:
    """The record-level promise a claim implies, and why (docs/audit.md#what-is-tested)."""
    if notion in (Notion.NONE, Notion.LOCAL) or epsilon is None or not math.isfinite(epsilon):
        basis = {
            "none": "non-private model: no promise to test",
            "local": "a per-weight local-DP epsilon bounds no record's membership in the model",
        }.get(notion, "no finite epsilon recorded: no promise to test")
        return {"basis": basis}
    d = 0.0 if delta is None else delta
    if notion == Notion.RECORD:
        if d >= 1.0:
            return {"basis": "delta >= 1 promises nothing: no promise to test"}
        return {"epsilon_tested": epsilon, "delta_tested": d,
                "basis": "record-level DP, as promised"}
    group_delta = (1.0 + math.exp(min(epsilon, 700.0))) * d
    if group_delta >= 1.0:
        return {"basis": "client-level DP: the group-privacy delta (1 + e^eps) delta >= 1 for "
                         "a record, so no record-level promise to test"}
    return {"epsilon_tested": 2.0 * epsilon, "delta_tested": group_delta,
            "basis": "client-level DP -> a record by group privacy: (2 eps, (1 + e^eps) delta)"}


def config_delta(private: PrivateRunState) -> float:
    """The run's configured delta (a non-private run's canaries are bounded at it)."""
    value = _number(private.config.get("delta"))
    return value if value is not None and 0 < value < 1 else 1e-5
