"""FedLAP-DP's client schedule, picked from the client size
(docs/algorithms.md#schedule-by-client-size).

Two schedules:

* ``small`` — train's defaults, tuned on the 8x8 digits (about 290 records per client):
  B 64, T = 1 x 5 x 2 = 10 accesses per client-round, network learning rate 0.05, server
  momentum 0.5. A digits run of 10 rounds takes about a minute on 2 cores.
* ``large`` — the authors' client schedule (the ``paper-dp`` preset's FedLAP knobs,
  docs/algorithms.md#default-configurations) with two changes: B 256, R_l 5, R_b 10, network
  learning rate 0.002, no server momentum as theirs, but

  - their R_i = 4 re-initialisations spread over the run, :func:`large_reinits`: R_i =
    max(1, 4 // rounds), so T = 200 accesses per client-round in a one-round run, 100 in a
    two-round run and 50 from three rounds on (the synthetic images persist across rounds,
    so a longer run keeps refining them; about 1.2 CPU minutes per client-round at 28x28
    with T = 50);
  - the server optimisation at ``server_lr`` = 10 times the round's rate, on a cosine that
    stays open in the last round (``cosine-open``): at the authors' rate (0.002) the server's
    100 epochs end at a quarter of the trust region's radius, and their cosine is at its
    floor (1e-6) in a run's last round, so that round's synthetic sets are never trained on.

  Both were chosen on a validation split of FashionMNIST at 1,600 records per client
  (training records no client holds; docs/results.md, "FashionMNIST by client size").

The rule (``auto``): ``large`` when the clients hold at least :data:`LARGE_MIN_RECORDS` =
4 x 256 records on average, so that its batches are at most a quarter of a client (a
Poisson rate of at most 0.25, where subsampling still amplifies), else ``small``. The
average is computed before any record is read, so the simulation, ``compare`` and the
Flower run config all carry the same explicit values: the dataset's standard training-set
size (:data:`fedlap_privacy.data.datasets.TRAIN_RECORDS`) less the validation records, over the
clients, capped by ``client_records``. For a user's records (``--data``) the size is read
from the files' array headers (and a ``client`` array), less the share held out for
evaluation without a test set (:meth:`fedlap_privacy.data.user_data.DataLayout.training_records`),
over the natural partition's clients, or ``clients`` when the records are split. The
schedule fills the keys it sets under the preset and everything the user gave
(``--batch-size``, ``--set``).

Cross-device defaults (every method but the FedLAP family, which keeps its ConvNet and
schedule): a run of at least :data:`CROSS_DEVICE_MIN_CLIENTS` = 1,000 clients holding fewer
than :data:`CROSS_DEVICE_MAX_RECORDS` = 100 records each on average (the same mean as
above, before any record is read) gets :data:`CROSS_DEVICE`: the small CNN (ConvNet width 32,
depth 2, about 12x fewer weights than the 128-channel, 3-block one: a 100-client round of
the packed cohort takes about a second on 2 cores, and client-level noise, whose norm grows
with the square root of the weights, costs less accuracy), B 10 (a 20-record client's
batches are Poisson at rate 0.5; B 64 would take every record every step), 10 local steps
at learning rate 0.1: the values of docs/train.md's measured cross-device runs (FashionMNIST,
3,000 clients). The model keys apply to the built-in image datasets without ``--model``.
Like the FedLAP schedule, these fill the keys under the preset and everything the user
gave (``--set width=128`` wins).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedlap_privacy.data.datasets import CUSTOM
from fedlap_privacy.errors import ConfigError

__all__ = [
    "AUTHORS_DP", "CROSS_DEVICE", "CROSS_DEVICE_MAX_RECORDS", "CROSS_DEVICE_MIN_CLIENTS",
    "LARGE_MIN_RECORDS", "SCHEDULED_METHOD", "SCHEDULES", "SCHEDULE_CHOICES", "ClientSchedule",
    "CrossDevice", "choose_schedule", "client_scale", "cross_device", "large_reinits",
    "mean_client_records",
]

#: FedLAP's knobs of the authors' DP run (the ``paper-dp`` preset's values)
AUTHORS_DP: dict[str, Any] = dict(
    reinits=4, max_loops=5, real_batches=10, syn_steps=5, local_model_steps=2, ipc=10,
    init="noise", reinit_each_round=False, mse_weight=0.0, lr_img=100.0, lr_net=0.002,
    radius=1.5, radius_rule="fixed", server_epochs=100, server_batch=512, server_momentum=0.0,
    batch_size=256, server_lr=1.0, lr_schedule="cosine",
)
#: FedLAP's knobs of each schedule: ``small`` is TrainConfig's defaults (nothing to set);
#: ``large`` is the authors' DP run with the server's rate tuned, and its ``reinits`` set by
#: the round count (:meth:`ClientSchedule.values`)
SCHEDULES: dict[str, dict[str, Any]] = {
    "small": {},
    "large": {**AUTHORS_DP, "server_lr": 10.0, "lr_schedule": "cosine-open"},
}
SCHEDULE_CHOICES = ("auto", *SCHEDULES)
#: the one method that has a schedule
SCHEDULED_METHOD = "fedlap-dp"
#: the smallest mean client size that gets the large schedule: 4 of its batches
LARGE_MIN_RECORDS = 4 * SCHEDULES["large"]["batch_size"]

#: the cross-device rule: at least this many clients ...
CROSS_DEVICE_MIN_CLIENTS = 1_000
#: ... holding fewer than this many records each on average (module docstring)
CROSS_DEVICE_MAX_RECORDS = 100
#: the model keys of the cross-device defaults: the small CNN (built-in image datasets)
CROSS_DEVICE_MODEL: dict[str, Any] = {"width": 32, "depth": 2}
#: the cross-device defaults (docs/train.md, "Cross-device scale")
CROSS_DEVICE: dict[str, Any] = {**CROSS_DEVICE_MODEL, "batch_size": 10, "local_steps": 10,
                                "lr_local": 0.1}


@dataclass(frozen=True)
class ClientSchedule:
    """A schedule and why: ``records`` is the mean client size the rule used (None when the
    user named the schedule)."""

    name: str
    records: int | None

    def values(self, rounds: int) -> dict[str, Any]:
        """The keys this schedule sets for a run of ``rounds`` rounds."""
        if self.name == "large":
            return {**SCHEDULES["large"], "reinits": large_reinits(rounds)}
        return SCHEDULES[self.name]

    def describe(self, batch_size: int, accesses: str) -> str:
        """One line for the console, with the run's resolved B and T (keys a user set win
        over the schedule's)."""
        what = {"small": "train's defaults", "large": "the authors', tuned"}[self.name]
        head = f"FedLAP-DP schedule: {self.name} ({what}; this run: B {batch_size}, T = {accesses})"
        if self.records is None:
            return f"{head}, as asked"
        side = ">=" if self.name == "large" else "<"
        other = "small" if self.name == "large" else "large"
        return (f"{head}: clients hold {self.records:,} records on average ({side} "
                f"{LARGE_MIN_RECORDS:,}); --schedule {other} for the other one")


def large_reinits(rounds: int) -> int:
    """R_i of the large schedule: the authors' 4 re-initialisations spread over a run of
    ``rounds`` rounds, at least one per round (a count below 1 is refused later by the
    configuration's validation)."""
    return max(1, AUTHORS_DP["reinits"] // max(rounds, 1))


@dataclass(frozen=True)
class CrossDevice:
    """The cross-device defaults chosen for a run, and why: its ``clients`` hold ``records``
    each on average; ``model``: the small CNN's keys apply (a built-in image dataset
    without ``--model``)."""

    clients: int
    records: int
    model: bool

    def values(self) -> dict[str, Any]:
        """The keys the defaults set (under everything the user gave)."""
        if self.model:
            return dict(CROSS_DEVICE)
        return {k: v for k, v in CROSS_DEVICE.items() if k not in CROSS_DEVICE_MODEL}

    def describe(self, cfg: Any) -> str:
        """One line for the console with the run's resolved values (a user's win)."""
        model = f"ConvNet width {cfg.width}, depth {cfg.depth}; " if self.model else ""
        return (f"Cross-device defaults: {self.clients:,} clients of {self.records:,} records on "
                f"average (>= {CROSS_DEVICE_MIN_CLIENTS:,} clients, < "
                f"{CROSS_DEVICE_MAX_RECORDS} records each); this run: {model}B {cfg.batch_size}, "
                f"{cfg.local_steps} local steps at lr {cfg.lr_local:g} (--set KEY=VALUE "
                "overrides any)")


def cross_device(method: str, dataset: str, clients: int, client_records: int | None = None,
                 validation_records: int = 0, data: str | None = None,
                 model: str | None = None) -> CrossDevice | None:
    """The cross-device defaults of a run (module docstring), None where the rule does not
    pick them: a FedLAP method, fewer clients or larger ones."""
    from fedlap_privacy.data.datasets import TRAIN_RECORDS
    from fedlap_privacy.fl.methods.method_table import METHOD_TABLE

    spec = METHOD_TABLE.get(method)
    if spec is None or spec.fedlap:
        return None
    count, records = client_scale(dataset, clients, client_records, validation_records, data)
    if count < CROSS_DEVICE_MIN_CLIENTS or records >= CROSS_DEVICE_MAX_RECORDS:
        return None
    return CrossDevice(count, records, model is None and dataset in TRAIN_RECORDS)


def mean_client_records(dataset: str, clients: int, client_records: int | None = None,
                        validation_records: int = 0, data: str | None = None) -> int:
    """The mean number of records a client holds, from the dataset's standard size, or the
    sizes a user's files declare (``data``; module docstring)."""
    return client_scale(dataset, clients, client_records, validation_records, data)[1]


def client_scale(dataset: str, clients: int, client_records: int | None = None,
                 validation_records: int = 0, data: str | None = None) -> tuple[int, int]:
    """(clients, the mean number of records a client holds), before any record is read:
    a user's natural partition sets the clients (module docstring)."""
    from fedlap_privacy.data.datasets import TRAIN_RECORDS

    if dataset == CUSTOM:
        from fedlap_privacy.data.user_data import probe

        if data is None:
            raise ConfigError(f"dataset {CUSTOM!r} means a user's records: it needs data=PATH")
        layout = probe(data)
        total = layout.training_records()
        if layout.natural:
            clients = len(layout.sizes)
    elif dataset in TRAIN_RECORDS:
        total = TRAIN_RECORDS[dataset]
    else:
        raise ConfigError(f"dataset {dataset!r} must be one of {', '.join(TRAIN_RECORDS)}")
    mean = max(total - validation_records, 0) // max(clients, 1)
    return clients, mean if client_records is None else min(mean, client_records)


def choose_schedule(requested: str, dataset: str, clients: int, client_records: int | None = None,
                    validation_records: int = 0, data: str | None = None) -> ClientSchedule:
    """``requested`` (``auto``, ``small`` or ``large``) resolved by the module's rule."""
    if requested not in SCHEDULE_CHOICES:
        raise ConfigError(f"schedule {requested!r} must be one of {', '.join(SCHEDULE_CHOICES)}")
    if requested != "auto":
        return ClientSchedule(requested, None)
    records = mean_client_records(dataset, clients, client_records, validation_records, data)
    return ClientSchedule("large" if records >= LARGE_MIN_RECORDS else "small", records)
