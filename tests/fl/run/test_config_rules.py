"""Every configuration key has a declared rule (``fl.config_rules.FIELD_RULES``: type, finite,
range) and :meth:`TrainConfig.validate` applies them all, in one place, before any data is read.

Iterating over the dataclass's fields makes a key added without a rule fail here.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import pytest

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig, field_types
from fedlap_privacy.fl.config_rules import FIELD_RULES, MAX_ROUNDS

FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]
#: values of the wrong type (or not finite) for a key of each type
WRONG: dict[type, list[Any]] = {
    bool: [1, "true", 0.0],
    int: [1.5, True, float("nan"), float("inf"), "3"],
    float: [float("nan"), float("inf"), float("-inf"), True, "1.0"],
    str: [3, True, b"digits"],
}


def _optional(name: str) -> bool:
    return type(None) in typing.get_args(typing.get_type_hints(TrainConfig)[name])


def _refused(name: str, value: Any) -> str:
    cfg = dataclasses.replace(TrainConfig(), **{name: value})
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_every_key_has_exactly_one_rule() -> None:
    assert set(FIELD_RULES) == set(FIELDS)  # a new key without a rule fails here
    for name in FIELDS:
        assert FIELD_RULES[name].kind is field_types()[name], name


def test_the_defaults_and_the_presets_satisfy_their_rules() -> None:
    from fedlap_privacy.fl.config import PRESETS
    from fedlap_privacy.fl.config_resolve import resolve_config

    TrainConfig().validate()
    for preset in PRESETS:
        resolve_config(preset)


@pytest.mark.parametrize("name", FIELDS)
def test_every_key_refuses_the_wrong_type_and_non_finite_numbers(name: str) -> None:
    rule = FIELD_RULES[name]
    for bad in WRONG[rule.kind]:
        message = _refused(name, bad)
        assert message.startswith(f"{name} {bad!r} must be "), message
    if not _optional(name):
        assert _refused(name, None).startswith(f"{name} None must be ")


@pytest.mark.parametrize("name", [n for n in FIELDS if FIELD_RULES[n].kind in (int, float)])
def test_every_number_refuses_values_outside_its_range(name: str) -> None:
    rule = FIELD_RULES[name]
    step = 1 if rule.kind is int else 1e-9
    assert rule.lo is not None, f"{name} has no lower bound"
    below = rule.lo if rule.lo_open else rule.lo - max(step, abs(rule.lo) * 1e-9)
    outside = [rule.kind(below)]
    if rule.hi is not None:
        outside.append(rule.kind(rule.hi if rule.hi_open else rule.hi + max(step, rule.hi * 1e-9)))
    for value in outside:
        message = _refused(name, value)
        # one line naming the key, the value and the allowed range
        assert message == f"{name} {value!r} must be {rule.describe(_optional(name))}"
    for end, is_open in ((rule.lo, rule.lo_open), (rule.hi, rule.hi_open)):
        if end is not None and not is_open:
            assert rule.allows(rule.kind(end))


@pytest.mark.parametrize("name", [n for n in FIELDS if FIELD_RULES[n].choices is not None])
def test_every_word_refuses_an_unknown_word(name: str) -> None:
    assert " must be one of " in _refused(name, "nonsense")


@pytest.mark.parametrize(("setting", "message"), [
    (dict(server_momentum=math.nan), "server_momentum nan must be a finite number in [0, 1)"),
    (dict(server_momentum=math.inf), "server_momentum inf must be"),
    (dict(img_momentum=math.nan), "img_momentum nan must be a finite number in [0, 1)"),
    (dict(img_momentum=-math.inf), "img_momentum -inf must be"),
    (dict(mse_weight=math.nan), "mse_weight nan must be a finite number >= 0"),
    (dict(mse_weight=math.inf), "mse_weight inf must be"),
    (dict(width=0), "width 0 must be an integer in [1, 1024] or none"),
    (dict(width=-1), "width -1 must be"),
    (dict(depth=-1), "depth -1 must be an integer in [1, 5] or none"),
    (dict(server_epochs=-1), "server_epochs -1 must be an integer in [1, 100000]"),
    (dict(syn_steps=-1), "syn_steps -1 must be an integer in [0, 100000]"),
    (dict(server_batch=-1), "server_batch -1 must be an integer in [1, 1000000]"),
    (dict(server_batch=0), "server_batch 0 must be"),
    (dict(lr_img=-1.0), "lr_img -1.0 must be a finite number > 0"),
    (dict(rounds=10**8), "rounds 100000000 must be an integer in [1, 100000]"),
])
def test_the_reported_attacks_are_refused(setting: dict[str, Any], message: str) -> None:
    assert _refused(*next(iter(setting.items()))).startswith(message)


def test_pld_runs_are_bounded_by_what_pld_can_discretise() -> None:
    """PLD (the default) prices the longest run the defaults allow; a run whose privacy loss
    it cannot discretise is refused before training, naming the RDP fallback."""
    from fedlap_privacy.accountant import FedLAPSchedule
    from fedlap_privacy.fl.run.privacy import check_accountable

    assert TrainConfig().accountant == "pld"
    digits = FedLAPSchedule(batch_size=64, client_size=281, local_steps=10)
    check_accountable(TrainConfig(rounds=MAX_ROUNDS).validate(), digits, 1.5)
    tiny = TrainConfig(sigma=0.1, rounds=1000).validate()
    crowded = FedLAPSchedule(batch_size=64, client_size=200, local_steps=100)
    with pytest.raises(ConfigError, match=r"1000 rounds at sigma 0.1: the PLD accountant cannot "
                       r"discretise .* for a run: --set accountant=rdp$"):
        check_accountable(tiny, crowded, 0.1)
    check_accountable(dataclasses.replace(tiny, accountant="rdp"), crowded, 0.1)


@pytest.mark.parametrize(("setting", "message"), [
    (dict(clients=0), "clients 0 must be an integer in [1, 100000]"),
    (dict(clients=-3), "clients -3 must be"),
    (dict(dataset="digits", split="iid", clients=1439), "clients 1439: digits has 1,438 "
     "training records for the clients, too few to give each of them a record (at most 1,438"),
    (dict(dataset="fashion-mnist", split="shards", clients=30_001),
     "clients 30001: fashion-mnist has 60,000 training records"),
    (dict(dataset="mnist", split="label-dirichlet", clients=59_001, validation_records=1000),
     "clients 59001: mnist has 59,000"),
])
def test_more_clients_than_records_is_refused_before_the_data(setting: dict[str, Any],
                                                              message: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(method="fedavg", **setting).validate()
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_as_many_clients_as_records_allow_is_accepted() -> None:
    TrainConfig(method="fedavg", dataset="fashion-mnist", split="shards",
                clients=30_000).validate()
    TrainConfig(method="fedavg", dataset="digits", split="iid", clients=1438).validate()
