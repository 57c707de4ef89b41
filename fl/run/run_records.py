"""The typed records a run hands over: its privacy statement (:class:`PrivacyStatement`),
the metrics of each round (:class:`RoundRecord`) and its summary (:class:`RunSummary`).

Inside the package they are read by attribute; :meth:`to_json` gives the JSON a user sees
(``train --json``, ``metrics.jsonl``, ``ckpt.pt``'s privacy statement and history, the
Flower server's status file) with the keys in the order they have always had.
:meth:`from_json` reads one back from a file (untrusted): a missing key or a value of the
wrong type is one :class:`~fedlap_privacy.errors.CheckpointError` line naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedlap_privacy.errors import CheckpointError

__all__ = ["PrivacyStatement", "RoundRecord", "RunSummary", "Scalar"]

#: a method-specific metric of a round (FedLAP-DP's ``radius``, ALI-DPFL's ``tau``, ...)
Scalar = float | int | None

_NUMBER = (int, float)


def _take(data: Mapping[str, Any], key: str, kinds: tuple[type, ...], what: str,
          optional: bool = False) -> Any:
    """``data[key]``, refused (one line) when missing or not one of ``kinds`` (a bool is
    not a number); ``optional``: None is allowed."""
    if key not in data:
        raise CheckpointError(f"{what} has no {key!r}")
    value = data[key]
    if value is None and optional:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise CheckpointError(f"{what}: {key!r} is {type(value).__name__}, not "
                              + " or ".join(k.__name__ for k in kinds))
    return value


def _numbers(value: Any, key: str, what: str) -> dict[str, float] | None:
    """A mapping of names to numbers (an epsilon by accountant or threat model), or None."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, _NUMBER) and not isinstance(v, bool)
            for k, v in value.items()):
        raise CheckpointError(f"{what}: {key!r} is not a mapping of names to numbers")
    return dict(value)


def _mapping(data: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise CheckpointError(f"{what} is {type(data).__name__}, not a JSON object")
    return data


@dataclass(frozen=True)
class PrivacyStatement:
    """The privacy statement of a run (``ckpt.pt``, the summary; built by
    :func:`fedlap_privacy.fl.run.privacy.privacy_statement`, which documents each field).

    ``epsilon`` holds against ``threat_model`` for the ``notion``; ``public`` lists what
    the run releases without noise; ``client_sampling`` (client level only) says how the
    cohort of a round is drawn and accounted.
    """

    notion: str
    epsilon: float | None
    threat_model: str | None
    epsilon_by_threat_model: dict[str, float] | None
    delta: float | None
    sigma: float | None
    accountant: str | None
    epsilon_by_accountant: dict[str, float] | None
    round_epsilon: float | None
    noise: str
    private: bool
    public: tuple[str, ...]
    selection: str
    client_sampling: str | None = None
    secure_aggregation: str | None = None  # the mechanism over secure aggregation, if any

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["public"] = list(self.public)
        for optional in ("client_sampling", "secure_aggregation"):
            if out[optional] is None:
                del out[optional]
        return out

    @classmethod
    def from_json(cls, data: Any, what: str = "the privacy statement") -> PrivacyStatement:
        data = _mapping(data, what)
        public = _take(data, "public", (list, tuple), what)
        if not all(isinstance(p, str) for p in public):
            raise CheckpointError(f"{what}: 'public' is not a list of strings")
        sampling, secure = data.get("client_sampling"), data.get("secure_aggregation")
        for key, value in (("client_sampling", sampling), ("secure_aggregation", secure)):
            if value is not None and not isinstance(value, str):
                raise CheckpointError(f"{what}: {key!r} is not a string")
        return cls(
            notion=_take(data, "notion", (str,), what),
            epsilon=_take(data, "epsilon", _NUMBER, what, optional=True),
            threat_model=_take(data, "threat_model", (str,), what, optional=True),
            epsilon_by_threat_model=_numbers(data.get("epsilon_by_threat_model"),
                                             "epsilon_by_threat_model", what),
            delta=_take(data, "delta", _NUMBER, what, optional=True),
            sigma=_take(data, "sigma", _NUMBER, what, optional=True),
            accountant=_take(data, "accountant", (str,), what, optional=True),
            epsilon_by_accountant=_numbers(data.get("epsilon_by_accountant"),
                                           "epsilon_by_accountant", what),
            round_epsilon=_take(data, "round_epsilon", _NUMBER, what, optional=True),
            noise=_take(data, "noise", (str,), what),
            private=_take(data, "private", (bool,), what),
            public=tuple(public),
            selection=_take(data, "selection", (str,), what),
            client_sampling=sampling,
            secure_aggregation=secure,
        )


#: the fields of a round a release withholds where the selection is hidden (None there;
#: :mod:`fedlap_privacy.fl.run.released_metrics`)
SELECTION_FIELDS = ("accesses", "clients", "replies", "upload_bytes", "seconds")


@dataclass(frozen=True)
class RoundRecord:
    """The metrics of one round (``metrics.jsonl``, ``ckpt.pt``): on public data (the test
    set), the ledger's numbers after the round, the learning rate, and what counts the
    selection (``accesses``: the most any client made; ``clients`` selected, ``replies``
    received, the mean ``upload_bytes``, ``seconds``), None where the release withholds
    it. ``extras``: the method's own server-step values, written flat after
    ``upload_bytes`` as they always were."""

    round: int
    test_accuracy: float
    test_loss: float
    epsilon: float | None
    delta: float | None
    rounds_spent: int
    local_steps: int | None  # the accounted T (None: a run without a Gaussian ledger)
    lr: float
    accesses: int | None = None
    clients: int | None = None
    replies: int | None = None
    upload_bytes: float | None = None
    seconds: float | None = None
    extras: dict[str, Scalar] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        ordered: dict[str, Any] = {
            "round": self.round, "test_accuracy": self.test_accuracy,
            "test_loss": self.test_loss, "epsilon": self.epsilon, "delta": self.delta,
            "rounds_spent": self.rounds_spent, "accesses": self.accesses,
            "local_steps": self.local_steps, "clients": self.clients, "replies": self.replies,
            "lr": self.lr, "upload_bytes": self.upload_bytes, **self.extras,
            "seconds": self.seconds,
        }
        return {k: v for k, v in ordered.items() if v is not None or k not in SELECTION_FIELDS}

    def withholding_selection(self, public_extras: tuple[str, ...] = ()) -> RoundRecord:
        """This round as released where the selection is hidden: the fields that count
        the selection withheld, of the extras only the ``public_extras``."""
        return dataclasses.replace(
            self, **dict.fromkeys(SELECTION_FIELDS),
            extras={k: v for k, v in self.extras.items() if k in public_extras},
        )

    @classmethod
    def from_json(cls, data: Any, what: str = "a round's metrics") -> RoundRecord:
        data = _mapping(data, what)
        known = {f.name for f in dataclasses.fields(cls)} - {"extras"}
        extras = {k: v for k, v in data.items() if k not in known}
        for key, value in extras.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, _NUMBER)):
                raise CheckpointError(f"{what}: {key!r} is {type(value).__name__}, not a number")
        counted = {k: _take(data, k, (int,) if k != "upload_bytes" and k != "seconds"
                            else _NUMBER, what) for k in SELECTION_FIELDS if k in data}
        return cls(
            round=_take(data, "round", (int,), what),
            test_accuracy=_take(data, "test_accuracy", _NUMBER, what),
            test_loss=_take(data, "test_loss", _NUMBER, what),
            epsilon=_take(data, "epsilon", _NUMBER, what, optional=True),
            delta=_take(data, "delta", _NUMBER, what, optional=True),
            rounds_spent=_take(data, "rounds_spent", (int,), what),
            local_steps=_take(data, "local_steps", (int,), what, optional=True),
            lr=_take(data, "lr", _NUMBER, what),
            extras=extras, **counted,
        )


@dataclass(frozen=True)
class RunSummary:
    """What a run reports when it returns (``train --json``): the method and dataset, the
    rounds run and why it stopped, the final test accuracy, the privacy statement (written
    flat, its keys among the summary's), whether sigma was planned for a target, the
    upload per client-round and in all, and the run folder (None: not saved).
    ``validation_accuracy``: the owner's view of the validation hold-out (from
    ``private.pt``, never released); written only when the run holds one out
    (``has_validation``)."""

    method: str
    dataset: str
    rounds_run: int
    test_accuracy: float | None
    privacy: PrivacyStatement
    sigma_planned: bool
    upload_bytes_mean: float | None
    upload_bytes_total: float
    stopped: str
    out: str | None
    validation_accuracy: float | None = None
    has_validation: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method, "dataset": self.dataset, "rounds_run": self.rounds_run,
            "test_accuracy": self.test_accuracy,
            **({"validation_accuracy": self.validation_accuracy} if self.has_validation
               else {}),
            **self.privacy.to_json(),
            "sigma_planned": self.sigma_planned,
            "upload_bytes_mean": self.upload_bytes_mean,
            "upload_bytes_total": self.upload_bytes_total,
            "stopped": self.stopped, "out": self.out,
        }

    @classmethod
    def from_json(cls, data: Any, what: str = "the run's summary") -> RunSummary:
        data = _mapping(data, what)
        return cls(
            method=_take(data, "method", (str,), what),
            dataset=_take(data, "dataset", (str,), what),
            rounds_run=_take(data, "rounds_run", (int,), what),
            test_accuracy=_take(data, "test_accuracy", _NUMBER, what, optional=True),
            privacy=PrivacyStatement.from_json(data, what),
            sigma_planned=_take(data, "sigma_planned", (bool,), what),
            upload_bytes_mean=_take(data, "upload_bytes_mean", _NUMBER, what, optional=True),
            upload_bytes_total=_take(data, "upload_bytes_total", _NUMBER, what),
            stopped=_take(data, "stopped", (str,), what),
            out=_take(data, "out", (str,), what, optional=True),
            validation_accuracy=(_take(data, "validation_accuracy", _NUMBER, what,
                                       optional=True) if "validation_accuracy" in data
                                 else None),
            has_validation="validation_accuracy" in data,
        )
