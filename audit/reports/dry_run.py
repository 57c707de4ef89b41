"""``audit --dry-run``: what an audit would read, test and cost, without running it.

A checkpoint written by ``train``: the checkpoint and its private state are loaded and
checked as the audit loads them (a factory-built model without ``--model-factory`` refused
as the audit refuses it; a named factory parsed or located, never imported), the dataset
read and validated, the member / non-member
sets drawn (their sizes), the claim recomputed from the ledger. A model trained elsewhere:
the model file must exist, the record files are checked by their headers only (shapes and
counts of the ``.npz`` arrays, IDX dimensions; no record is read), a ``file.py:function``
factory is parsed (not run) for the function, a ``module:function`` one located (not
imported). The time estimate times the audit's features on RANDOM records of the model's
input shape (:func:`time_features`), never on members or non-members.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import struct
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fedlap_privacy.audit.bounds.claim import privacy_claim
from fedlap_privacy.audit.inference.features import compute_features
from fedlap_privacy.audit.inference.membership import make_membership_split
from fedlap_privacy.audit.inference.report import load_run_records, parse_attacks, rebuilt_model
from fedlap_privacy.data.dataset_files import IDX_IMAGE_MAGIC, IDX_LABEL_MAGIC
from fedlap_privacy.data.user_data import record_headers
from fedlap_privacy.errors import ConfigError, DataError
from fedlap_privacy.model_factory import BUILTIN_FACTORIES

__all__ = ["AuditPlan", "RecordFile", "plan_audit", "plan_external_audit", "time_features"]

#: records per feature timing (random data)
TIMING_RECORDS = 64


@dataclass(frozen=True)
class RecordFile:
    """A records file by its header: ``count`` records of ``shape`` (None: not in the header,
    e.g. an IDX label file)."""

    spec: str
    count: int
    shape: tuple[int, ...] | None


@dataclass(frozen=True)
class AuditPlan:
    """What an audit would do. ``per_half``: records in each of the four sets (None: drawn at
    run time from the record files); ``claim``: the promise it tests."""

    source: str
    attacks: tuple[str, ...]
    claim: dict[str, Any]
    records: str  # where members and non-members come from
    per_half: int | None
    canaries: bool
    seconds: float | None
    out: str | None

    def to_json(self) -> dict[str, Any]:
        return {"dry_run": True, **asdict(self)}


def time_features(model: torch.nn.Module, shape: Sequence[int], num_classes: int,
                  attacks: Sequence[str], records: int) -> float:
    """Seconds the features of ``records`` records would take: timed on
    :data:`TIMING_RECORDS` random records of ``shape`` and scaled."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((TIMING_RECORDS, *shape), generator=gen).numpy()
    y = torch.randint(0, num_classes, (TIMING_RECORDS,), generator=gen).numpy()
    start = time.perf_counter()
    compute_features(model, x, y, attacks)
    return (time.perf_counter() - start) * records / TIMING_RECORDS


def plan_audit(checkpoint: Path, data_dir: Path | None, attacks: str, seed: int,
               max_per_half: int | None, out: Path | None, factory: str | None = None
               ) -> AuditPlan:
    """The plan of ``audit --model CHECKPOINT`` (module docstring). A factory-built model is
    refused as the audit refuses it unless the user names its factory (``factory``); a
    named factory is parsed or located, never imported, and the time is then not estimated
    (only the ConvNet and the package's own factories are built to time the features)."""
    names = parse_attacks(attacks)
    target = load_run_records(checkpoint, data_dir, factory)
    claim = privacy_claim(target.release.privacy, target.release.ledger,
                          target.private.ledger_digest)
    data = target.dataset
    split = make_membership_split(target.members, data.y_train, data.y_test, seed=seed,
                                  max_per_half=max_per_half)
    spec = target.release.factory_to_build(factory, str(checkpoint))
    seconds = None
    if spec is None or spec.factory in BUILTIN_FACTORIES:
        model = rebuilt_model(target.release, checkpoint, factory)
        seconds = time_features(model, data.x_train.shape[1:], data.num_classes, names,
                                4 * split.per_half)
    else:
        _check_factory(spec.factory)
    return AuditPlan(
        str(checkpoint), names, asdict(claim),
        f"{data.name}: {len(target.members):,} members of {len(data.y_train):,} training "
        f"records, non-members from {len(data.y_test):,} test records",
        split.per_half, target.private.canaries is not None, seconds,
        None if out is None else str(out))


def plan_external_audit(model: Path, members: str, nonmembers: str, factory: str | None,
                        claimed_eps: float | None, delta: float | None, attacks: str,
                        max_per_half: int | None, out: Path | None) -> AuditPlan:
    """The plan of ``audit --model FILE --members ... --nonmembers ...`` (module docstring)."""
    from fedlap_privacy.audit.inference.external import claimed_privacy

    names = parse_attacks(attacks)
    if not model.is_file():
        raise DataError(f"no such model file: {model}")
    if factory is not None:
        _check_factory(factory)
    if max_per_half is not None and max_per_half < 1:
        raise ConfigError(f"max_per_half must be a positive integer, got {max_per_half}")
    inside, outside = record_file(members), record_file(nonmembers)
    if inside.shape and outside.shape and inside.shape != outside.shape:
        raise DataError(f"members are {inside.shape}, non-members {outside.shape}: the same "
                        "shape is needed")
    n = min(inside.count // 2, outside.count // 2, max_per_half or inside.count)
    claim = claimed_privacy(claimed_eps, delta)
    return AuditPlan(
        str(model), names, asdict(claim),
        f"{inside.count:,} members ({members}), {outside.count:,} non-members ({nonmembers})"
        + ("" if inside.shape is None else f", records of {'x'.join(map(str, inside.shape))}"),
        n, False, None, None if out is None else str(out))


def _check_factory(spec: str) -> None:
    """``file.py:function`` defines the function (parsed, not run); ``module:function``'s
    module can be found (not imported)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"--model-factory {spec!r}: expected module:function or file.py:function")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"--model-factory {spec!r}: no such file {path}")
        try:
            tree = ast.parse(path.read_text(), str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"--model-factory {spec!r}: {path} does not parse ({exc})") from None
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        if name not in defined:
            raise ConfigError(f"--model-factory {spec!r}: {path} defines no {name}")
    elif importlib.util.find_spec(where.split(".")[0]) is None:
        raise ConfigError(f"--model-factory {spec!r}: no module {where.split('.')[0]}")


def record_file(spec: str) -> RecordFile:
    """A records file (an ``.npz`` or ``IMAGES,LABELS`` IDX files) by its headers only."""
    if "," in spec:
        images, labels = (Path(p.strip()) for p in spec.split(",", 1))
        dims = _idx_dims(images, IDX_IMAGE_MAGIC, 3)
        count = _idx_dims(labels, IDX_LABEL_MAGIC, 1)[0]
        if count != dims[0]:
            raise DataError(f"{labels}: {count} labels for {dims[0]} images in {images}")
        return RecordFile(spec, count, (1, dims[1], dims[2]))
    path = Path(spec)
    shapes = _npz_shapes(path)  # the reader refuses a missing or irregular file

    if "x" not in shapes or "y" not in shapes:
        raise DataError(f"{path}: an .npz of records needs arrays 'x' and 'y'")
    x, y = shapes["x"], shapes["y"]
    if len(x) != 4 or y != (x[0],) or x[0] == 0:
        raise DataError(f"{spec}: expected x of shape (N, C, H, W) and N labels, got {x} and {y}")
    return RecordFile(spec, x[0], tuple(x[1:]))


def _npz_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every array of an ``.npz``, from the .npy headers, checked as reading
    them would check them (no data read: :func:`fedlap_privacy.data.user_data.record_headers`)."""
    return {name: tuple(int(v) for v in header.shape)
            for name, header in record_headers(path).items()}


def _idx_dims(path: Path, magic: int, ndim: int) -> list[int]:
    """The dimensions in an IDX file's header (raw or gzipped)."""
    size = 4 + 4 * ndim
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
            header = f.read(size)
    except (OSError, EOFError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    if len(header) < size:
        raise DataError(f"{path}: truncated IDX header")
    found, *dims = struct.unpack(f">{1 + ndim}i", header)
    if found != magic or min(dims) < 1:
        raise DataError(f"{path}: not an IDX file of {ndim}-dimensional records")
    return dims
