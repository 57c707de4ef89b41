"""Reference models for the offline membership attacks (LiRA, RMIA) of ``fedlap-privacy audit``.

Both reference-model attacks calibrate a record's score with models trained like the target
but WITHOUT the record: LiRA (N. Carlini, S. Chien, M. Nasr, S. Song, A. Terzis, F. Tramer,
"Membership inference attacks from first principles", IEEE S&P 2022, offline variant) and
RMIA (S. Zarifzadeh, P. Liu, R. Shokri, "Low-cost high-power membership inference attacks",
ICML 2024, offline variant). :func:`train_reference_models` trains them with the audited
run's own pipeline:

* **configuration**: the run's own (:func:`~fedlap_privacy.fl.run.run_files.load_run_config`,
  from its private state), with a different public seed per reference model (``seed =``
  :data:`REFERENCE_SEED` ``+ i``: another split and another initialisation), no canaries,
  and as many rounds as the audited checkpoint completed (a sigma that was planned for a
  target epsilon is kept as is, so each reference runs those rounds at that sigma);
* **population data**: every record of the audited dataset, training and test records
  alike, minus the records the audit scores (``exclude``: its audited members and
  non-members and RMIA's population sample), i.e. records from the target's distribution,
  none of which is under audit. Records are named by one id over both sets (:func:`record_ids`:
  train record ``i`` is ``i``, test record ``j`` is ``n_train + j``). Each reference model
  trains on its own random subset of the population (drawn with its seed) of the target's
  size (its number of training records), at most half the population, as in both papers
  (same-size reference sets, a smaller set sampled at the target's batch rate:
  :func:`_same_rate`; the subsets differ, so one reference model can play the
  target for the others when RMIA's ``a`` is tuned). Every audited record is OUT for every
  reference model: the offline setting. The population includes target members that are
  not under audit (same distribution: all an offline reference needs). A run on a user's
  records (``--data``) is imitated on those records, read again as the run read them
  (:func:`fedlap_privacy.data.user_data.load_run_data`), with the run's model factory; with a
  natural partition each population record that a client trained on stays with that
  client, and the test records (which no client holds) are dealt to the clients at random
  (the reference's seed) in proportion to the clients' sizes (:func:`population_data`);
* **files**: reference ``i`` is an ordinary run in ``run_dir/reference/<i>/`` (``ckpt.pt``,
  ``private.pt``, its own ledger over its own records: it is trained on the owner's private
  records, so it is kept private like the run) plus :data:`MANIFEST`, which names its
  records (ids as above), the data's content hash and the configuration.

Cost: one full training per reference model (``n`` trainings, each on as many records as
the target's). They are cached: a rerun reuses a finished reference whose configuration is
the run's and that never trained on a record now under audit, resumes an interrupted one,
and refuses (one line) a folder holding another configuration or trained on audited
records. :func:`load_reference_models` loads finished ones as modules for the audit.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from fedlap_privacy.data.datasets import Dataset, content_hash
from fedlap_privacy.data.user_data import load_run_data
from fedlap_privacy.errors import CheckpointError, ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.run.run_files import PENDING, holds_run, load_private, load_release
from fedlap_privacy.model_factory import named_factory
from fedlap_privacy.state.atomic import write_text_atomic
from fedlap_privacy.state.checkpoint import CHECKPOINT, PRIVATE
from fedlap_privacy.state.run_state import PrivateRunState

__all__ = [
    "MANIFEST", "REFERENCE_DIR", "REFERENCE_SEED", "ReferenceRun", "load_reference_models",
    "population_data", "record_ids", "reference_config", "reference_dirs",
    "train_reference_models",
]

#: the folder of a run's reference models: ``run_dir/reference/<i>/``
REFERENCE_DIR = "reference"
#: what a reference folder records beside its run files (JSON)
MANIFEST = "reference.json"
_MANIFEST_FORMAT = "fedlap-privacy-reference/1"
#: reference ``i`` trains with the public seed ``REFERENCE_SEED + i``
REFERENCE_SEED = 1000
#: configuration keys that may differ without making a reference another configuration
#: (where the records are read from; the records themselves are pinned by their hash)
_FREE_KEYS = ("data_dir", "data")


@dataclass(frozen=True)
class ReferenceRun:
    """A finished reference model: its folder, the rebuilt model (eval mode, on CPU), the
    ids (:func:`record_ids`) of the records it trained on, and its configuration."""

    path: Path
    model: nn.Module
    trained_on: np.ndarray
    config: TrainConfig


def reference_dirs(run_dir: str | Path, n: int) -> list[Path]:
    """``run_dir/reference/0 .. n-1``."""
    return [Path(run_dir) / REFERENCE_DIR / str(i) for i in range(n)]


def reference_config(run_dir: str | Path, index: int, factory: str | None = None
                     ) -> TrainConfig:
    """The configuration of reference model ``index`` of the run in ``run_dir`` (module
    docstring): the run's own, with seed ``REFERENCE_SEED + index``, no canaries, the
    audited checkpoint's rounds, and a planned sigma kept fixed. ``factory``: the model
    factory the user names for a run whose model a factory of theirs built (a recorded
    factory is never imported on its own: :func:`fedlap_privacy.model_factory.named_factory`)."""
    private = load_private(Path(run_dir))
    return _reference_config(private, index, factory, str(Path(run_dir) / PRIVATE))


def _reference_config(private: PrivateRunState, index: int, factory: str | None,
                      where: str) -> TrainConfig:
    cfg = TrainConfig.from_recorded(private.config)
    if cfg.model is not None:
        cfg = dataclasses.replace(
            cfg, model=named_factory(cfg.model, factory, where, "--model-factory"))
    rounds = private.round
    if rounds < 1:
        raise ConfigError("the audited run has not completed a round: nothing to imitate")
    planned = private.sigma_planned
    return dataclasses.replace(
        cfg, seed=REFERENCE_SEED + index, canaries=0, canary_kind=None, rounds=rounds,
        target_eps=None if planned else cfg.target_eps,
    )


def _comparable(cfg: TrainConfig) -> dict[str, Any]:
    return {k: v for k, v in cfg.to_dict().items() if k not in _FREE_KEYS}


def record_ids(n_train: int, train: np.ndarray | Sequence[int] = (),
               test: np.ndarray | Sequence[int] = ()) -> np.ndarray:
    """One id per record over a dataset's train and test sets: train record ``i`` is ``i``,
    test record ``j`` is ``n_train + j`` (sorted, unique)."""
    return np.unique(np.concatenate([np.asarray(train, np.int64),
                                     n_train + np.asarray(test, np.int64)]))


def population_data(data: Dataset, ids: np.ndarray, seed: int = REFERENCE_SEED) -> Dataset:
    """``data`` whose training records are the records ``ids`` (:func:`record_ids`) of its
    train and test sets together; its test set is kept, for the run's metrics only. A
    natural ``partition`` follows the records (module docstring; ``seed`` deals the test
    records to the clients)."""
    x = np.concatenate([data.x_train, data.x_test])
    y = np.concatenate([data.y_train, data.y_test])
    if data.partition is None:
        return dataclasses.replace(data, x_train=x[ids], y_train=y[ids])
    n_train = len(data.y_train)
    owner = np.empty(n_train, dtype=np.int64)
    for k, part in enumerate(data.partition):
        owner[part] = k
    sizes = np.array([len(p) for p in data.partition], dtype=np.float64)
    dealt = np.random.default_rng(seed).choice(len(sizes), size=len(ids), p=sizes / sizes.sum())
    client = np.where(ids < n_train, owner[np.minimum(ids, n_train - 1)], dealt)
    order = np.argsort(client, kind="stable")
    ids, client = ids[order], client[order]
    starts = np.searchsorted(client, np.arange(len(sizes) + 1))
    partition = tuple(np.arange(starts[k], starts[k + 1], dtype=np.int64)
                      for k in range(len(sizes)))
    if (empty := [k for k, p in enumerate(partition) if p.size == 0]):
        raise ConfigError(f"client {empty[0]} has no population record left to train a "
                          "reference model on: audit fewer records (--max-per-half)")
    return dataclasses.replace(data, x_train=x[ids], y_train=y[ids], partition=partition)


def _population_size(total: int, exclude: np.ndarray, size: int) -> int:
    """How many records each reference model trains on: the target's ``size``, at most half
    of the ``total`` records not in ``exclude``."""
    pool = total - exclude.size
    take = min(size, pool // 2)
    if take < 1:
        raise ConfigError(f"no population left to train reference models on: {pool} "
                          "records are not under audit")
    return take


def _same_rate(cfg: TrainConfig, take: int, size: int) -> TrainConfig:
    """A reference model trained on ``take`` < ``size`` (the target's) records samples its
    batches at the target's Poisson rate B / N_k: its B is the target's scaled by
    ``take / size`` (at least 1). Unchanged when the population is large enough."""
    if take >= size:
        return cfg
    return dataclasses.replace(cfg, batch_size=max(1, round(cfg.batch_size * take / size)))


def _population(total: int, exclude: np.ndarray, index: int, size: int) -> np.ndarray:
    """Reference ``index``'s records: ``size`` random ids of ``0 .. total-1`` not in
    ``exclude``, at most half of them (sorted; drawn with its public seed)."""
    pool = np.setdiff1d(np.arange(total, dtype=np.int64), exclude)
    take = _population_size(total, exclude, size)
    rng = np.random.default_rng(REFERENCE_SEED + index)
    return np.sort(rng.choice(pool, size=take, replace=False))


def _check_exclude(exclude: Sequence[int] | np.ndarray, total: int) -> np.ndarray:
    out = np.unique(np.asarray(exclude, dtype=np.int64))
    if out.size and (out[0] < 0 or out[-1] >= total):
        raise ConfigError(f"excluded record id {int(out[0] if out[0] < 0 else out[-1])} is "
                          f"out of range for a dataset of {total} records")
    return out


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        ok = (isinstance(manifest, dict) and manifest.get("format") == _MANIFEST_FORMAT
              and isinstance(manifest.get("trained_on"), list)
              and isinstance(manifest.get("config"), dict))
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path} is not a reference-model manifest")
    return manifest


def _write_manifest(folder: Path, cfg: TrainConfig, trained_on: np.ndarray, data_hash: str,
                    finished: bool) -> None:
    manifest = {
        "format": _MANIFEST_FORMAT,
        "config": cfg.to_dict(),
        "data": data_hash,
        "trained_on": trained_on.tolist(),
        "finished": finished,
    }
    write_text_atomic(folder / MANIFEST, json.dumps(manifest))


def train_reference_models(
    run_dir: str | Path,
    n: int,
    exclude: Sequence[int] | np.ndarray,
    device: str = "auto",
    data_dir: str | Path | None = None,
    callback: Any = None,
    factory: str | None = None,
) -> list[Path]:
    """Train (or reuse) ``n`` reference models of the run in ``run_dir``; their folders.

    ``exclude``: ids (:func:`record_ids`) of every record the audit scores; none of them is
    in any reference model's training data. ``data_dir`` overrides the run's data folder
    (or its ``--data`` path; the data must be the run's: checked against its content hash).
    ``callback`` is passed to the trainer (progress events). ``factory``: the model factory
    the user names (:func:`reference_config`); a reference folder is resumed only with it.
    See the module docstring for
    the configuration, the population data, the cache and the cost (``n`` full trainings).
    """
    from fedlap_privacy.fl.engine.simulation import resume, train

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"the number of reference models must be an integer >= 1, got {n!r}")
    run = Path(run_dir)
    private = load_private(run)
    configs = [_reference_config(private, i, factory, str(run / PRIVATE)) for i in range(n)]
    cfg0 = configs[0]
    data = load_run_data(cfg0.dataset, private.config, private.split_seed, data_dir)
    data_hash = content_hash(data.x_train, data.y_train, data.x_test, data.y_test)
    recorded = private.fingerprints.get("data")
    if recorded is not None and recorded != content_hash(data.x_train, data.y_train):
        raise ConfigError(f"the {cfg0.dataset} training data found is not the data the run "
                          f"in {run} trained on: pass the run's --data-dir")
    total = len(data.y_train) + len(data.y_test)
    excluded = _check_exclude(exclude, total)
    size = sum(len(p) for p in private.client_indices) or len(data.y_train)
    take = _population_size(total, excluded, size)
    paths = reference_dirs(run, n)
    for i, (folder, cfg) in enumerate(zip(paths, configs, strict=True)):
        cfg = _same_rate(cfg, take, size)
        if data_dir is not None:  # where the run's records are read from now
            if cfg.data is not None:
                cfg.data = str(data_dir)
            else:
                cfg.data_dir = str(data_dir)
        manifest = _read_manifest(folder)
        if manifest is not None:
            trained_on = _reusable(folder, manifest, cfg, excluded, data_hash)
            if manifest.get("finished"):
                continue
            if holds_run(folder):
                resume(folder, device=device, callback=callback,
                       data=population_data(data, trained_on, cfg.seed), model=cfg.model)
                _write_manifest(folder, cfg, trained_on, data_hash, finished=True)
                continue
        else:
            trained_on = _population(total, excluded, i, size)
            if folder.exists() and any(folder.iterdir()):
                raise ConfigError(f"{folder} holds files but no {MANIFEST}: it is not a "
                                  "reference model; move it away")
        folder.mkdir(parents=True, exist_ok=True)
        _write_manifest(folder, cfg, trained_on, data_hash, finished=False)
        train(cfg, folder, device=device, callback=callback,
              data=population_data(data, trained_on, cfg.seed))
        _write_manifest(folder, cfg, trained_on, data_hash, finished=True)
    return paths


def _reusable(folder: Path, manifest: dict[str, Any], cfg: TrainConfig, excluded: np.ndarray,
              data_hash: str) -> np.ndarray:
    """The population of a cached reference, if it may serve this audit; else one line."""
    try:
        saved = TrainConfig.from_recorded(manifest["config"])
    except (TypeError, ConfigError) as exc:
        raise CheckpointError(f"{folder / MANIFEST} has no valid configuration ({exc})") from None
    if _comparable(saved) != _comparable(cfg) or manifest.get("data") != data_hash:
        changed = sorted(k for k, v in _comparable(cfg).items() if _comparable(saved)[k] != v)
        what = f"configuration ({', '.join(changed)})" if changed else "training data"
        raise ConfigError(f"{folder} holds a reference model of another {what} than the "
                          "audited run's: move it away to train new ones")
    trained_on = np.asarray(manifest["trained_on"], dtype=np.int64)
    overlap = np.intersect1d(trained_on, excluded).size
    if overlap:
        raise ConfigError(f"{folder} trained on {overlap} of the records now under audit (it "
                          "was trained for another audit draw): audit with that draw's "
                          "--seed/--max-per-half, or move it away")
    return trained_on


def load_reference_models(paths: Sequence[str | Path], factory: str | None = None
                          ) -> list[ReferenceRun]:
    """The finished reference models in ``paths`` (written by :func:`train_reference_models`),
    each rebuilt from its ``ckpt.pt`` in eval mode on the CPU; a factory-built one by the
    ``factory`` the user names (its recorded factory is never imported on its own)."""
    out = []
    for folder in map(Path, paths):
        manifest = _read_manifest(folder)
        if manifest is None or not manifest.get("finished") or (folder / PENDING).exists():
            raise CheckpointError(f"{folder} holds no finished reference model: train it with "
                                  "train_reference_models (audit --reference-models)")
        try:
            model = load_release(folder).build_model(factory, str(folder / CHECKPOINT))
        except CheckpointError as exc:
            raise CheckpointError(f"{folder}: {exc}") from None
        model.eval()
        out.append(ReferenceRun(folder, model, np.asarray(manifest["trained_on"], np.int64),
                                TrainConfig.from_recorded(manifest["config"])))
    return out
