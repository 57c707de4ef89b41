"""The model a SuperNode trains: the run's factory, imported from the node's own installation.

Contract (docs/threat-model.md, "Cross-silo deployment"): the server names the model only as
data, the run config's ``model`` (a factory spec, never code; empty: the built-in ConvNet for
images, :data:`~fedlap_privacy.model_factory.DEFAULT_TABULAR` for feature rows), and sends
the model's public shape with every instruction (:class:`ModelShape`, the ``model`` record:
``input-shape`` and ``num-classes``). The node

1. refuses a factory its policy's ``allowed-models`` does not list, before importing anything
   (:meth:`NodePolicy.check_factory`);
2. refuses records that do not fit the server's model (:func:`check_records`): another
   input shape, a label of no class, another declared ``num_classes``;
3. builds the model with :func:`fedlap_privacy.fl.run.user_runs.run_model` (the in-process
   engine's own rule) and refuses broadcast weights that are not that model's
   (:func:`load_weights`: other parameter names or shapes, e.g. another version of the
   factory installed on the node).

Each refusal is one line (a :class:`PolicyRefusal`, :class:`ConfigError` or
:class:`DataError`), which the ClientApp returns as its reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ConfigRecord, RecordDict
from torch import Tensor, nn

from fedlap_privacy.data.user_data import describe_shape
from fedlap_privacy.errors import ConfigError, DataError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.flower.policy import NodePolicy
from fedlap_privacy.fl.run.user_runs import factory_spec, run_model

__all__ = ["MODEL_RECORD", "ModelShape", "build_node_model", "check_records", "load_weights"]

#: the instruction's record holding the model's public shape
MODEL_RECORD = "model"
_SAME_FACTORY = "check that every node has the same model factory installed"


def _dims(values: Any) -> tuple[int, ...] | None:
    if not isinstance(values, list | tuple) or not values:
        return None
    ok = all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in values)
    return tuple(values) if ok else None


@dataclass(frozen=True)
class ModelShape:
    """The public shape of the run's model: its records' shape and its classes."""

    input_shape: tuple[int, ...]
    num_classes: int

    def to_record(self) -> ConfigRecord:
        return ConfigRecord({"input-shape": list(self.input_shape),
                             "num-classes": self.num_classes})

    @classmethod
    def from_content(cls, content: RecordDict) -> ModelShape:
        """The shape an instruction carries, type-checked (the server's values are data)."""
        record = content.config_records.get(MODEL_RECORD)
        if record is None:
            raise ConfigError("the instruction has no model record (input-shape, num-classes)")
        shape = _dims(record.get("input-shape"))
        classes = record.get("num-classes")
        if (shape is None or len(shape) not in (1, 3) or not isinstance(classes, int)
                or isinstance(classes, bool) or classes < 2):
            raise ConfigError("the instruction's model record is malformed (input-shape: 1 or "
                              "3 positive integers, num-classes: an integer >= 2)")
        return cls(shape, classes)


def check_records(shape: ModelShape, input_shape: tuple[int, ...], y: Tensor,
                  declared_classes: int | None, where: str) -> None:
    """Refuse records (of ``where``) that the server's model cannot take (module doc, 2)."""
    if tuple(input_shape) != shape.input_shape:
        raise DataError(f"{where} holds {describe_shape(tuple(input_shape))}, the server's model "
                        f"takes {describe_shape(shape.input_shape)}")
    if declared_classes is not None and declared_classes != shape.num_classes:
        raise DataError(f"{where} declares num_classes {declared_classes}, the server's model "
                        f"has {shape.num_classes} classes")
    top = int(y.max()) if y.numel() else 0
    if top >= shape.num_classes:
        raise DataError(f"{where}: label {top} is out of range for the server's model "
                        f"(classes 0..{shape.num_classes - 1})")


def build_node_model(cfg: TrainConfig, shape: ModelShape, policy: NodePolicy) -> nn.Module:
    """The run's model on this node (module doc, 1 and 3): the policy first, then the import."""
    spec = factory_spec(cfg, shape.input_shape, shape.num_classes)
    if spec is not None:
        policy.check_factory(spec.factory)
    return run_model(cfg, shape.input_shape, shape.num_classes).model


def load_weights(model: nn.Module, weights: dict[str, Tensor], device: torch.device) -> None:
    """Load the broadcast ``weights`` into ``model``; refuse weights of another model."""
    own = model.state_dict()
    if set(own) != set(weights):
        extra, missing = sorted(set(weights) - set(own)), sorted(set(own) - set(weights))
        name = (f"parameter {extra[0]!r} is not in this node's model" if extra
                else f"parameter {missing[0]!r} is missing")
        raise ConfigError(f"the server's weights are not this node's model ({name}): "
                          f"{_SAME_FACTORY}")
    for key, value in own.items():
        if tuple(weights[key].shape) != tuple(value.shape):
            raise ConfigError(f"the server's weights are not this node's model (parameter "
                              f"{key!r} is {tuple(weights[key].shape)} from the server, "
                              f"{tuple(value.shape)} here): {_SAME_FACTORY}")
    model.load_state_dict({k: v.to(device) for k, v in weights.items()})
