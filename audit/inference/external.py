"""Audit a model trained elsewhere: any torch model, with the member and non-member records
its owner supplies.

The same membership-inference audit as for this package's checkpoints (loss and gradient
norm features, MLP and threshold attacks, ROC, TPR at low FPR, the epsilon lower bound;
RMIA / LiRA when reference models are given), on a model loaded by
:func:`load_external_model`:

* an exported program (``torch.export.save``, a ``.pt2`` file): read by
  :func:`fedlap_privacy.audit.readers.exported.load_exported_program`, which unpickles and evaluates
  nothing from the file (``torch.export.load`` would: pickled weights and constants run
  code), and runs its graph's aten operators itself;
* a TorchScript module (``torch.jit.save``): loaded with ``torch.jit.load``, which runs the
  file's TorchScript code (``__setstate__``) as it loads: audit only TorchScript files you
  trust. It is wrapped in a plain module (:class:`_Scripted`) so that ``torch.func`` can take
  per-record gradients through it (the grad-norm attack);
* a plain state dict (saved with ``torch.save(model.state_dict(), path)``): read with
  ``weights_only=True`` (no code runs) into the module a FACTORY builds, given as
  ``module:function`` or ``path/to/file.py:function``: your own code, which is imported.

Members and non-members come as arrays (Python) or files (:func:`fedlap_privacy.data.user_data.
load_records`: ``.npz`` with ``x`` and ``y``, or a pair of IDX files). As in the paper's
protocol, each set is cut into two halves: one trains the attacks, the other is audited.
A claimed ``(epsilon, delta)`` is what the model's owner promises; the audit flags a
violation when its lower bound exceeds it.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedlap_privacy.audit.inference.features import FEATURES, compute_features
from fedlap_privacy.audit.inference.reference_audit import ReferenceModel
from fedlap_privacy.audit.inference.report import AuditTarget, audit_target, parse_attacks
from fedlap_privacy.audit.readers.exported import load_exported_program
from fedlap_privacy.audit.reports.results import AuditReport, PrivacyClaim
from fedlap_privacy.data.datasets import Dataset
from fedlap_privacy.data.user_data import load_records
from fedlap_privacy.errors import CheckpointError, ConfigError, FedlapError
from fedlap_privacy.state.checkpoint import load_checkpoint_data
from fedlap_privacy.vocabulary import Notion

__all__ = ["audit_model", "audit_model_files", "claimed_privacy", "load_external_model"]

Records = tuple[np.ndarray, np.ndarray]


def claimed_privacy(epsilon: float | None, delta: float | None) -> PrivacyClaim:
    """The claim record of a model trained elsewhere: what its owner promises (or nothing)."""
    if epsilon is None:
        return PrivacyClaim(Notion.NONE.value, None, None, "no claim given: nothing to test")
    d = 1e-5 if delta is None else delta
    if not (math.isfinite(epsilon) and epsilon >= 0 and 0 <= d < 1):
        raise ConfigError(f"claimed (epsilon, delta) = ({epsilon}, {d}) is not a DP claim")
    return PrivacyClaim(Notion.RECORD.value, epsilon, d,
                        "record-level DP claimed by the model's owner", epsilon, d)


def _is_torchscript(path: Path) -> bool:
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.split("/", 2)[1:2] == ["code"] for name in archive.namelist())


def _factory(spec: str) -> Callable[[], nn.Module]:
    """``module:function`` or ``file.py:function`` -> the function (user code, imported)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"--model-factory {spec!r}: expected module:function or file.py:function")
    try:
        if where.endswith(".py"):
            location = importlib.util.spec_from_file_location("fedlap_model_factory", where)
            if location is None or location.loader is None:
                raise ImportError(f"cannot load {where}")
            module = importlib.util.module_from_spec(location)
            location.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        function = getattr(module, name)
    except (ImportError, AttributeError, FileNotFoundError) as exc:
        raise ConfigError(f"--model-factory {spec!r}: {exc}") from None
    return function


class _Scripted(nn.Module):
    """A TorchScript module inside a plain one: ``torch.func.functional_call`` refuses a
    scripted module at the top ("stateless API can't be used with Jitted modules") but swaps
    the parameters of one held as a child, which the grad-norm attack needs."""

    def __init__(self, inner: torch.jit.ScriptModule) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def load_external_model(path: str | Path, factory: str | None = None) -> nn.Module:
    """A model from a TorchScript file, or a state dict plus a ``factory`` (module doc)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no such model file: {path}")
    if factory is None and path.suffix == ".pt2":
        return load_exported_program(path)
    if factory is None:
        if not _is_torchscript(path):
            raise ConfigError(f"{path} is neither an exported program (.pt2) nor TorchScript: "
                              "for a state dict, give --model-factory module:function")
        try:
            return _Scripted(torch.jit.load(str(path), map_location="cpu"))
        except RuntimeError as exc:
            first = (str(exc).strip().splitlines() or ["?"])[0][:160]
            raise CheckpointError(f"cannot load TorchScript {path}: {first}") from None
    state = load_checkpoint_data(path)
    build = _factory(factory)
    try:
        model = build()
    except TypeError as exc:  # a run's factory make(shape, k), given with --members
        first = (str(exc).strip().splitlines() or ["?"])[0][:160]
        raise ConfigError(f"--model-factory {factory!r} cannot be called without arguments "
                          f"({first}): a model trained elsewhere is built by a function of no "
                          "arguments; a run's ckpt.pt is audited without --members") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model-factory {factory!r} returned a {type(model).__name__}, "
                          "not a torch module")
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as exc:
        first = (str(exc).strip().splitlines() or ["?"])[0][:160]
        raise CheckpointError(f"{path} does not fit the factory's model: {first}") from None
    return model


def _probe(model: nn.Module, x: np.ndarray, y: np.ndarray, attacks: Sequence[str]) -> None:
    """Each attack's feature on two records before the audit, so that a model an attack cannot
    run on (e.g. a TorchScript module torch.func cannot trace, a program that does not take
    the records' shape) gets one line naming the attack, not a traceback from deep inside."""
    scripted = any(isinstance(m, torch.jit.ScriptModule) for m in model.modules())
    for attack in attacks:
        try:
            compute_features(model, x, y, (attack,))
        except FedlapError:
            raise
        except (RuntimeError, TypeError, ValueError, AttributeError, IndexError,
                NotImplementedError) as exc:
            what = ("this TorchScript module (torch.func's per-record gradients cannot trace "
                    "it)" if scripted and attack == "grad-norm" else "this model")
            hint = ("; audit with --attacks loss" + (
                ", or export the model with torch.export (.pt2)" if scripted else "")
                if attack == "grad-norm" else "")
            raise ConfigError(f"the {attack} attack cannot run on {what}: {_reason(exc)}{hint}"
                              ) from None


def _reason(exc: BaseException) -> str:
    """One line of an error: its first, or for the TorchScript interpreter's (a script
    traceback first) its last."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    line = lines[-1] if lines[0].startswith("The following operation failed") else lines[0]
    return line.removeprefix("RuntimeError: ")[:160]


def audit_model(
    model: nn.Module,
    members: Records,
    nonmembers: Records,
    *,
    claimed_epsilon: float | None = None,
    delta: float | None = None,
    attacks: str | Sequence[str] = FEATURES,
    seed: int = 0,
    max_per_half: int | None = None,
    device: str | None = None,
    out_dir: str | Path | None = None,
    reference_models: Sequence[ReferenceModel] = (),
    name: str = "external model",
) -> AuditReport:
    """Membership-inference audit of ``model`` on the given members and non-members.

    Returns the report of :func:`fedlap_privacy.audit.inference.report.run_audit` (``report.json``
    and ``roc.png`` in ``out_dir`` when given). ``claimed_epsilon`` / ``delta``: the promise
    to test (none by default: the audit then only measures).
    """
    (xm, ym), (xn, yn) = members, nonmembers
    if xm.shape[1:] != xn.shape[1:]:
        raise ConfigError(f"members are {xm.shape[1:]}, non-members {xn.shape[1:]}: the same "
                          "records shape is needed")
    classes = int(max(ym.max(), yn.max())) + 1
    _check_model_scores(model, xm, classes)
    dataset = Dataset("external", np.asarray(xm, np.float32), np.asarray(ym, np.int64),
                      np.asarray(xn, np.float32), np.asarray(yn, np.int64), classes, (), ())
    model.eval()
    wanted = parse_attacks(attacks)
    _probe(model, dataset.x_train[:2], dataset.y_train[:2], wanted)
    target = AuditTarget(model, dataset, np.arange(len(ym)))
    return audit_target(target, claimed_privacy(claimed_epsilon, delta), name, wanted, seed,
                        out_dir, max_per_half, device, reference_models)


def _check_model_scores(model: nn.Module, x: np.ndarray, classes: int) -> None:
    """Refuse (one line) records the model cannot score, before the audit: one forward pass
    on one record must give (1, K) logits with K covering every label (a label of K or more
    used to end the audit in a traceback from the loss)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.as_tensor(np.asarray(x[:1], np.float32), device=device))
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        first = (str(exc).strip().splitlines() or ["?"])[0][:160]
        raise ConfigError(f"the model cannot score records of shape {tuple(x.shape[1:])}: "
                          f"{first}") from None
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != 1:
        raise ConfigError(f"the model's output for one record is {shape}: expected logits "
                          "of shape (1, classes)")
    if classes > out.shape[1]:
        raise ConfigError(f"labels run up to {classes - 1}, but the model outputs "
                          f"{out.shape[1]} classes: labels must lie in 0..{out.shape[1] - 1}")


def audit_model_files(
    model_path: str | Path,
    members: str,
    nonmembers: str,
    *,
    factory: str | None = None,
    normalise: tuple[float, float] | None = None,
    **options: Any,
) -> AuditReport:
    """:func:`audit_model` on files: the model (:func:`load_external_model`) and the
    records (:func:`fedlap_privacy.data.user_data.load_records`); ``options`` as for audit_model."""
    model = load_external_model(model_path, factory)
    inside, outside = load_records(members, normalise), load_records(nonmembers, normalise)
    return audit_model(model, (inside.x, inside.y), (outside.x, outside.y),
                       name=str(model_path), **options)
