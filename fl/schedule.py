"""FedLAP-DP's client schedule, picked from the client size
(docs/algorithms.md#schedule-by-client-size).

Two schedules:

* ``small`` — train's defaults, tuned on the 8x8 digits (about 290 records per client):
  B 64, T = 1 x 5 x 2 = 10 accesses per client-round, network learning rate 0.05, server
  momentum 0.5. A digits run of 10 rounds takes about a minute on 2 cores.
* ``large`` — the authors' client schedule (the ``paper-dp`` preset's FedLAP knobs,
  docs/algorithms.md#default-configurations): B 256, T = 4 x 5 x 10 = 200, network
  learning rate 0.002, no server momentum. On FashionMNIST it wins against DP-FedAvg after
  one round at epsilon 3 both with 12,000 (one seed) and with 1,600 records per client
  (three seeds), where the small schedule loses by 18 to 24 points; after 3 rounds it still
  trails (README: "FashionMNIST by client size"). It costs
  about 20 times the small one per round (about 5 CPU minutes per client-round at 28x28).

The rule (``auto``): ``large`` when the clients hold at least :data:`LARGE_MIN_RECORDS` =
4 x 256 records on average, so that its batches are at most a quarter of a client (a
Poisson rate of at most 0.25, where subsampling still amplifies), else ``small``. The
average is computed from the configuration alone, before any data is read, so the
simulation, ``compare`` and the Flower run config all carry the same explicit values: the
dataset's standard training-set size (:data:`fedlap_privacy.data.TRAIN_RECORDS`) less the
validation records, over the clients, capped by ``client_records``. The schedule fills the
keys it sets under the preset and everything the user gave (``--batch-size``, ``--set``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedlap_privacy.errors import ConfigError

__all__ = [
    "LARGE_MIN_RECORDS", "SCHEDULED_METHOD", "SCHEDULES", "SCHEDULE_CHOICES", "ClientSchedule",
    "choose_schedule", "mean_client_records",
]

#: FedLAP's client knobs of each schedule: ``small`` is TrainConfig's defaults (nothing to
#: set); ``large`` is the authors' DP run (also the ``paper-dp`` preset's values)
SCHEDULES: dict[str, dict[str, Any]] = {
    "small": {},
    "large": dict(
        reinits=4, max_loops=5, real_batches=10, syn_steps=5, local_model_steps=2, ipc=10,
        init="noise", reinit_each_round=False, mse_weight=0.0, lr_img=100.0, lr_net=0.002,
        radius=1.5, radius_rule="fixed", server_epochs=100, server_batch=512,
        server_momentum=0.0, batch_size=256,
    ),
}
SCHEDULE_CHOICES = ("auto", *SCHEDULES)
#: the one method that has a schedule
SCHEDULED_METHOD = "fedlap-dp"
#: the smallest mean client size that gets the large schedule: 4 of its batches
LARGE_MIN_RECORDS = 4 * SCHEDULES["large"]["batch_size"]


@dataclass(frozen=True)
class ClientSchedule:
    """A schedule and why: ``records`` is the mean client size the rule used (None when the
    user named the schedule)."""

    name: str
    records: int | None

    @property
    def values(self) -> dict[str, Any]:
        return SCHEDULES[self.name]

    def describe(self, batch_size: int, accesses: int) -> str:
        """One line for the console, with the run's resolved B and T (keys a user set win
        over the schedule's)."""
        what = {"small": "train's defaults", "large": "the authors'"}[self.name]
        head = f"FedLAP-DP schedule: {self.name} ({what}; this run: B {batch_size}, T = {accesses})"
        if self.records is None:
            return f"{head}, as asked"
        side = ">=" if self.name == "large" else "<"
        other = "small" if self.name == "large" else "large"
        return (f"{head}: clients hold {self.records:,} records on average ({side} "
                f"{LARGE_MIN_RECORDS:,}); --schedule {other} for the other one")


def mean_client_records(dataset: str, clients: int, client_records: int | None = None,
                        validation_records: int = 0) -> int:
    """The mean number of records a client holds, from the dataset's standard size."""
    from fedlap_privacy.data import TRAIN_RECORDS

    if dataset not in TRAIN_RECORDS:
        raise ConfigError(f"dataset {dataset!r} must be one of {', '.join(TRAIN_RECORDS)}")
    mean = max(TRAIN_RECORDS[dataset] - validation_records, 0) // max(clients, 1)
    return mean if client_records is None else min(mean, client_records)


def choose_schedule(requested: str, dataset: str, clients: int, client_records: int | None = None,
                    validation_records: int = 0) -> ClientSchedule:
    """``requested`` (``auto``, ``small`` or ``large``) resolved by the module's rule."""
    if requested not in SCHEDULE_CHOICES:
        raise ConfigError(f"schedule {requested!r} must be one of {', '.join(SCHEDULE_CHOICES)}")
    if requested != "auto":
        return ClientSchedule(requested, None)
    records = mean_client_records(dataset, clients, client_records, validation_records)
    return ClientSchedule("large" if records >= LARGE_MIN_RECORDS else "small", records)
