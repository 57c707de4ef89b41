"""The two files of a run as typed records: the releasable model and the private run state.

``ckpt.pt`` (:class:`ModelRelease`, format ``fedlap-privacy/2``) may be shared like the
model: weights and model shape (the ConvNet's ``model_config``, or for a factory-built model
its ``model_factory`` spec: the factory's name, input shape and classes, never code), the
dataset's name, the public configuration (every
setting but the seed and the data folder), the privacy statement, the ledger entries and
the per-round metrics on public data (test set, epsilon, ...); both without the selection
of clients where the threat model assumes it hidden. ``private.pt``
(:class:`PrivateRunState`, format ``fedlap-privacy-private/1``) never leaves the run's
owner: the full configuration, the split seed, each client's member indices, content hashes
of the data and of each partition (``fingerprints``), the ledger's fingerprint, whether
sigma was planned, the methods' node-local and server states, the canaries
(:mod:`fedlap_privacy.state.canary_state`) and the per-round scores on the validation hold-out
(:class:`ValidationScore`: private records, released by nothing) and, where the threat
model assumes the selection hidden, the full ledger and per-round metrics that ``ckpt.pt``
releases without the selection (:mod:`fedlap_privacy.state.ledger`).

What never changes within a format version: the field names and meanings above; a new
field gets a default so that older files of the same version stay readable. Every defect
of a file, missing field or wrong type, is one :class:`~fedlap_privacy.errors.CheckpointError`
line. Both records hold plain data only (loaded with ``weights_only=True``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from fedlap_privacy.errors import CheckpointError, ConfigError
from fedlap_privacy.models import build_model
from fedlap_privacy.state.checkpoint import (
    FORMAT,
    PRIVATE_FORMAT,
    load_checkpoint,
    save_checkpoint,
)

if TYPE_CHECKING:
    from fedlap_privacy.model_factory import FactorySpec

__all__ = ["ModelRelease", "PrivateRunState", "ValidationScore"]


def _fields_of(record: Any) -> dict[str, Any]:
    """A record's fields, shallow (tensors are not copied)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


def _from_payload(cls: type, payload: dict[str, Any], path: Path, required: tuple[str, ...],
                  types: dict[str, type | tuple[type, ...]]) -> Any:
    """``cls(**payload)`` after checking the required fields and the types of all."""
    for key in required:
        if key not in payload:
            raise CheckpointError(f"checkpoint {path} lacks {key!r}; was it written by train?")
    known = {f.name for f in fields(cls)}
    values = {k: v for k, v in payload.items() if k in known}
    for key, kind in types.items():
        if key in values and values[key] is not None and not isinstance(values[key], kind):
            raise CheckpointError(f"checkpoint {path}: {key!r} is a "
                                  f"{type(values[key]).__name__}, not what train writes")
    return cls(**values)


@dataclass(frozen=True)
class ModelRelease:
    """``ckpt.pt``: what may be shared (module docstring)."""

    model_state: dict[str, Any]
    model_config: dict[str, int]
    dataset: str
    method: str = ""
    privacy: dict[str, Any] = field(default_factory=dict)
    ledger: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    round: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    #: a model built by a factory (``--model``, or the default of tabular data): its spec,
    #: :class:`fedlap_privacy.model_factory.FactorySpec` as a dict (never code); None: the
    #: ConvNet of ``model_config``
    model_factory: dict[str, Any] | None = None

    def build_model(self, factory: str | None = None, where: str = "ckpt.pt") -> nn.Module:
        """The model with the saved weights: the ConvNet of ``model_config``, or a
        factory-built model. The recorded factory is never imported on its own (``where``:
        the file it was read from, as the refusal names it): ``factory``, the spec the USER
        names (``--model-factory``), builds it; without one only a recorded package factory
        (:func:`fedlap_privacy.model_factory.named_factory`). One line if they do not fit:
        a checkpoint is data to check, never to obey."""
        if self.model_factory is not None:
            return self._factory_model(factory, where)
        config = self.model_config
        try:
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in config.values()):
                raise TypeError("model_config is not a dict of integers")
            model = build_model(dict(config))
            model.load_state_dict(self.model_state)
        except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            raise CheckpointError(f"checkpoint: cannot rebuild its model ({first})") from None
        return model

    def factory_to_build(self, factory: str | None = None, where: str = "ckpt.pt"
                         ) -> FactorySpec | None:
        """The factory spec :meth:`build_model` would build with (None: the ConvNet), nothing
        imported: ``factory`` (the user's) replaces the recorded name, which alone serves only
        for a package factory; else one line showing it (``where``: the file read)."""
        from fedlap_privacy.model_factory import FactorySpec, named_factory

        if self.model_factory is None:
            return None
        try:
            spec = FactorySpec.from_dict(self.model_factory)
        except ConfigError as exc:
            raise CheckpointError(f"checkpoint: {exc}") from None
        chosen = named_factory(spec.factory, factory, where, "--model-factory")
        return FactorySpec(chosen, spec.input_shape, spec.num_classes)

    def _factory_model(self, factory: str | None, where: str) -> nn.Module:
        from fedlap_privacy.model_factory import build_model as build_from_factory

        spec = self.factory_to_build(factory, where)
        assert spec is not None
        try:
            model = build_from_factory(spec)
        except ConfigError as exc:
            raise ConfigError(
                f"the model factory {spec.factory!r} cannot rebuild the run's model ({exc}); "
                "--model-factory FILE.py:FUNC or module:FUNC names the run's factory here"
            ) from None
        try:
            model.load_state_dict(self.model_state)
        except (RuntimeError, TypeError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            raise CheckpointError(f"checkpoint: its weights do not fit the model of "
                                  f"{spec.factory!r} ({first})") from None
        return model

    def save(self, path: str | Path) -> None:
        payload = _fields_of(self)
        payload["dataset"] = {"name": self.dataset}
        save_checkpoint(path, payload, FORMAT)

    @classmethod
    def load(cls, path: str | Path) -> ModelRelease:
        path = Path(path)
        payload = dict(load_checkpoint(path, FORMAT))
        info = payload.get("dataset")
        if "dataset" in payload:
            payload["dataset"] = info.get("name") if isinstance(info, dict) else None
        return _from_payload(cls, payload, path, ("model_state", "model_config", "dataset"), {
            "model_state": dict, "model_config": dict, "dataset": str, "method": str,
            "privacy": dict, "ledger": list, "config": dict, "round": int, "history": list,
            "model_factory": dict,
        })


@dataclass(frozen=True)
class ValidationScore:
    """A round's accuracy and mean loss on the validation hold-out: training records of
    the private data, so kept in ``private.pt`` (with one held-out record, its label follows
    from the loss)."""

    round: int
    accuracy: float
    loss: float

    def to_dict(self) -> dict[str, Any]:
        """The plain form stored in ``private.pt`` (the names of the summary's keys)."""
        return {"round": self.round, "validation_accuracy": self.accuracy,
                "validation_loss": self.loss}

    @classmethod
    def from_dict(cls, values: Any) -> ValidationScore:
        """One stored score; one :class:`CheckpointError` line if it is not one."""
        try:
            return cls(int(values["round"]), float(values["validation_accuracy"]),
                       float(values["validation_loss"]))
        except (TypeError, KeyError, ValueError):
            raise CheckpointError("private.pt: a validation score is malformed") from None


@dataclass(frozen=True)
class PrivateRunState:
    """``private.pt``: what never leaves the run's owner (module docstring)."""

    config: dict[str, Any]
    client_indices: list[Any]
    fingerprints: dict[str, Any] = field(default_factory=dict)
    ledger_digest: str | None = None
    sigma_planned: bool = False
    round: int = 0
    client_state: list[Any] = field(default_factory=list)
    server_state: dict[str, Any] = field(default_factory=dict)
    canaries: dict[str, Any] | None = None
    #: the seed of the split, hold-out and subsets (None: a file from before split seeds,
    #: whose split followed from the configuration's seed)
    split_seed: int | None = None
    #: one :meth:`ValidationScore.to_dict` per round (none without a validation hold-out)
    validation: list[dict[str, Any]] = field(default_factory=list)
    #: the full ledger entries, selection included, where ``ckpt.pt`` withholds it
    #: (:meth:`fedlap_privacy.state.ledger.PrivacyLedger.released_entries`); empty otherwise
    ledger: list[dict[str, Any]] = field(default_factory=list)
    #: the full per-round metrics where ``ckpt.pt`` releases fewer; empty otherwise
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def validation_scores(self) -> list[ValidationScore]:
        """The stored validation scores as records."""
        return [ValidationScore.from_dict(v) for v in self.validation]

    def save(self, path: str | Path) -> None:
        save_checkpoint(path, _fields_of(self), PRIVATE_FORMAT)

    @classmethod
    def load(cls, path: str | Path) -> PrivateRunState:
        path = Path(path)
        payload = load_checkpoint(path, PRIVATE_FORMAT)
        return _from_payload(cls, payload, path, ("config", "client_indices"), {
            "config": dict, "client_indices": list, "fingerprints": dict, "ledger_digest": str,
            "sigma_planned": bool, "round": int, "client_state": list, "server_state": dict,
            "ledger": list, "history": list,
            "canaries": dict, "split_seed": int, "validation": list,
        })
