"""The accountant registry (``accountant.registry``, in the style of Opacus'
``register_accountant``): a name is read in one place, a registered accountant is planned
with by name like the package's own, and a name is never silently replaced."""

from __future__ import annotations

import pytest

from fedlap_privacy.accountant import (
    EXTENDED_ORDERS,
    FedLAPSchedule,
    RDPAccountant,
    accountant_names,
    epsilon,
    get_accountant,
    plan_sigma,
    register_accountant,
)
from fedlap_privacy.accountant import registry as registry_module
from fedlap_privacy.errors import ConfigError

SCHEDULE = FedLAPSchedule(batch_size=256, client_size=10000, local_steps=200)


class DoubledRDP(RDPAccountant):
    """RDP's epsilon doubled: a (looser) accountant whose answers differ from every other."""

    name = "doubled-rdp"

    def epsilon(self, schedule, sigma, rounds, delta):  # type: ignore[override]
        return 2 * super().epsilon(schedule, sigma, rounds, delta)


@pytest.fixture
def doubled():
    register_accountant(DoubledRDP.name, DoubledRDP)
    yield DoubledRDP.name
    registry_module._REGISTRY.pop(DoubledRDP.name)


def test_names_build_their_accountants() -> None:
    assert accountant_names() == ("rdp", "pld")
    assert type(get_accountant("rdp")) is RDPAccountant
    assert get_accountant("pld").name == "pld"
    grid = get_accountant("rdp", EXTENDED_ORDERS)
    assert grid.orders.size == EXTENDED_ORDERS.size
    assert get_accountant(grid) is grid  # an accountant object passes through
    with pytest.raises(ConfigError, match="accountant 'moments' must be one of rdp, pld"):
        get_accountant("moments")
    with pytest.raises(ConfigError, match="neither a name nor an accountant"):
        get_accountant(3)  # type: ignore[arg-type]


def test_a_registered_accountant_plans_by_name(doubled: str) -> None:
    assert accountant_names() == ("rdp", "pld", doubled)
    rdp = epsilon(SCHEDULE, 1.0, 15, 1e-5, "rdp")
    assert epsilon(SCHEDULE, 1.0, 15, 1e-5, doubled) == pytest.approx(2 * rdp)
    # planning with the doubled epsilon needs more noise for the same target
    sigma = plan_sigma(SCHEDULE, 15, 10.0, 1e-5, doubled)
    assert sigma > plan_sigma(SCHEDULE, 15, 10.0, 1e-5, "rdp")
    assert epsilon(SCHEDULE, sigma, 15, 1e-5, doubled) <= 10.0


def test_a_name_is_not_replaced_silently(doubled: str) -> None:
    with pytest.raises(ConfigError, match="registered already"):
        register_accountant("rdp", DoubledRDP)
    register_accountant(doubled, DoubledRDP, force=True)
    assert type(get_accountant(doubled)) is DoubledRDP


def test_the_accountants_do_not_import_planning() -> None:
    """PLD's planning start is RDP's plan, asked of planning by the accountant's hint, not
    planned inside the accountant (which made accountants <-> planning a cycle)."""
    pld = get_accountant("pld")
    hint = pld.hint_accountant()
    assert isinstance(hint, RDPAccountant) and hint.orders.size == EXTENDED_ORDERS.size
    assert get_accountant("rdp").hint_accountant() is None
