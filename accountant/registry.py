"""The accountants by name: a registry in the style of Opacus' ``register_accountant``.

A name (``--accountant``, a configuration's ``accountant``, a ledger entry's) is turned into
an accountant here and nowhere else: :func:`get_accountant` looks it up,
:func:`accountant_names` lists the choices (the CLI builds its own from them), and
:func:`register_accountant` adds one (a class implementing
:class:`~fedlap_privacy.accountant.accountants.Accountant`, constructed as ``cls(orders)``).
"""

from __future__ import annotations

from fedlap_privacy.accountant.accountants import (
    Accountant,
    AccountantName,
    Orders,
    PLDAccountant,
    RDPAccountant,
)
from fedlap_privacy.errors import ConfigError

__all__ = ["accountant_names", "get_accountant", "register_accountant"]

#: name (plain text) -> accountant class
_REGISTRY: dict[str, type[Accountant]] = {
    AccountantName.RDP.value: RDPAccountant,
    AccountantName.PLD.value: PLDAccountant,
}


def register_accountant(name: str, cls: type[Accountant], *, force: bool = False) -> None:
    """Make ``get_accountant(name)`` build ``cls``; an existing name only with ``force``."""
    if name in _REGISTRY and not force:
        raise ConfigError(f"accountant {name!r} is registered already (force=True replaces it)")
    _REGISTRY[str(name)] = cls


def accountant_names() -> tuple[str, ...]:
    """The registered names, the package's own first (``rdp``, ``pld``)."""
    return tuple(_REGISTRY)


def get_accountant(accountant: str | Accountant = AccountantName.RDP,
                   orders: Orders = None) -> Accountant:
    """The accountant named ``accountant`` (``orders``: RDP's grid), or ``accountant`` itself
    when it is an accountant object already."""
    if not isinstance(accountant, str):
        if not isinstance(accountant, Accountant):
            raise ConfigError(f"accountant {accountant!r} is neither a name nor an accountant")
        return accountant
    if accountant not in _REGISTRY:
        raise ConfigError(f"accountant {accountant!r} must be one of "
                          f"{', '.join(accountant_names())}")
    return _REGISTRY[accountant](orders)
