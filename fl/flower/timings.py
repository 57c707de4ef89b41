"""Where a local Flower run's time goes: start-up, discovery, rounds, shutdown.

Contract: :func:`.runner.run_flower` measures the phases of ``train --engine flower`` on one
machine and writes them, after the deployment stopped, as :data:`TIMINGS` into the run
folder (a :class:`FlowerTimings` as JSON: seconds, public, no record of anyone's data). The
launcher's instants are its own clock's; the ServerApp's (:data:`SERVER_MARKS`, in the
status file it writes) are wall-clock instants of the same machine, so the two combine.
``benchmarks/speed/flower_local.py`` prints them beside the in-process run (docs/performance.md).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedlap_privacy.state.atomic import write_text_atomic

__all__ = ["SERVER_MARKS", "TIMINGS", "FlowerTimings", "LauncherMarks"]

#: written by ``train --engine flower`` into the run folder when the deployment stopped
TIMINGS = "flower-timings.json"
#: the ServerApp's instants (``time.time()``) in its status file: it began, every partition's
#: SuperNode answered discovery, the training ended
SERVER_MARKS = ("started", "discovered", "finished")


@dataclass
class LauncherMarks:
    """The launcher's instants (``time.time()``), in order: it began, the SuperLink served,
    the SuperNodes were started, ``flwr run`` was started,
    ``flwr run`` ended, every process was stopped."""

    begin: float = 0.0
    superlink: float = 0.0
    supernodes: float = 0.0
    flwr_run: float = 0.0
    run_end: float = 0.0
    closed: float = 0.0


@dataclass(frozen=True)
class FlowerTimings:
    """Seconds of each phase of one local Flower run (module docstring).

    ``superlink_s``: the SuperLink started until it served; ``supernodes_s``: the SuperNodes
    spawned (they connect in the background, during the next phases); ``serverapp_s``:
    ``flwr run`` started until the ServerApp began (the Flower App's packaging, the
    SuperLink's SuperExec, the ServerApp process's imports); ``discovery_s``: every
    partition's SuperNode answered (each node's first ClientApp process started and
    imported Flower, torch and this package); ``training_s``: discovery to the end
    of training, of which ``rounds_s`` are the rounds as ``metrics.jsonl`` recorded them;
    ``finish_s``: the training ended until ``flwr run`` returned; ``shutdown_s``: every
    process stopped; ``total_s``: the launcher's whole run."""

    superlink_s: float
    supernodes_s: float
    serverapp_s: float
    discovery_s: float
    training_s: float
    rounds_s: tuple[float, ...]
    finish_s: float
    shutdown_s: float
    total_s: float

    @classmethod
    def of(cls, marks: LauncherMarks, server: dict[str, float],
           rounds: list[float]) -> FlowerTimings:
        """The phases of ``marks`` and the ServerApp's instants ``server``
        (:data:`SERVER_MARKS`)."""
        started, discovered, finished = (float(server[key]) for key in SERVER_MARKS)
        return cls(
            superlink_s=marks.superlink - marks.begin,
            supernodes_s=marks.supernodes - marks.superlink,
            serverapp_s=started - marks.flwr_run,
            discovery_s=discovered - started,
            training_s=finished - discovered,
            rounds_s=tuple(rounds),
            finish_s=marks.run_end - finished,
            shutdown_s=marks.closed - marks.run_end,
            total_s=marks.closed - marks.begin,
        )

    def to_json(self) -> dict[str, Any]:
        return {key: (list(value) if isinstance(value, tuple) else round(value, 3))
                for key, value in asdict(self).items()}

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> FlowerTimings:
        return cls(**{key: (tuple(float(v) for v in value) if key == "rounds_s"
                            else float(value)) for key, value in values.items()})

    def write(self, out: Path) -> None:
        """Write :data:`TIMINGS` into the run folder ``out``."""
        write_text_atomic(out / TIMINGS, json.dumps(self.to_json()) + "\n")

    def line(self) -> str:
        """The phases in one line (seconds)."""
        rounds = ", ".join(f"{s:.1f}" for s in self.rounds_s)
        return (f"start-up {self.superlink_s + self.supernodes_s + self.serverapp_s:.1f} s "
                f"(SuperLink {self.superlink_s:.1f}, SuperNodes {self.supernodes_s:.1f}, "
                f"ServerApp {self.serverapp_s:.1f}), discovery {self.discovery_s:.1f} s, "
                f"training {self.training_s:.1f} s (rounds {rounds}), finish "
                f"{self.finish_s:.1f} s, shutdown {self.shutdown_s:.1f} s, total "
                f"{self.total_s:.1f} s")
