"""The progress contract: step t of T inside each client, the round's estimate, and the
one-step timing before round 1 (fl/engine/progress.py)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import tiny

from fedlap_privacy.fl.engine.events import (
    ClientDone,
    ClientStep,
    RoundEstimate,
    RoundStarted,
    RunEvent,
)
from fedlap_privacy.fl.engine.progress import RoundClock, report_step, reporting
from fedlap_privacy.fl.engine.simulation import train


def _events(cfg, **kw) -> tuple[list[RunEvent], Any]:
    seen: list[RunEvent] = []
    result = train(cfg, None, device="cpu", callback=seen.append, **kw)
    return seen, result


def _at(seen: list[RunEvent], kind: type) -> list[int]:
    return [n for n, e in enumerate(seen) if isinstance(e, kind)]


def test_fedlap_reports_each_access_of_each_client_in_order_with_an_estimate() -> None:
    cfg = tiny(method="fedlap-dp", clients=2, rounds=1, max_loops=2, real_batches=2,
               radius=100.0)  # no early stop at the radius: every client makes its T = 4
    seen, _ = _events(cfg, estimate=True)
    assert _at(seen, RoundEstimate)[0] < _at(seen, RoundStarted)[0]
    (estimate,) = [e for e in seen if isinstance(e, RoundEstimate)]
    assert estimate.accesses == 4 and estimate.clients == 2
    assert estimate.round_s == pytest.approx(estimate.access_s * 4 * 2)
    assert estimate.access_s > 0 and estimate.long is False  # a tiny run
    steps = [e for e in seen if isinstance(e, ClientStep)]
    assert [(s.position, s.step, s.steps) for s in steps] == [
        (p, t, 4) for p in (0, 1) for t in (1, 2, 3, 4)]
    assert [s.client for s in steps] == [0] * 4 + [1] * 4
    assert all(s.round_estimate_s >= s.elapsed_s > 0 for s in steps)
    # each client's steps come before its ClientDone
    done, step_at = _at(seen, ClientDone), _at(seen, ClientStep)
    assert max(step_at[:4]) < done[0] < min(step_at[4:]) and max(step_at) < done[1]


def test_the_timing_before_round_1_changes_nothing_in_the_run() -> None:
    cfg = tiny(method="fedavg", clients=3, split="iid", split_seed=0, cohort_training="loop")
    timed, a = _events(cfg, estimate=True)
    untimed, b = _events(cfg)
    assert _at(timed, RoundEstimate) and not _at(untimed, RoundEstimate)
    assert [h.test_accuracy for h in a.history] == [h.test_accuracy for h in b.history]
    steps = [(e.position, e.step) for e in timed if isinstance(e, ClientStep) and e.round == 1]
    assert steps == [(p, t) for p in range(3) for t in (1, 2, 3)]  # local_steps 3


def test_the_clock_estimates_from_the_fraction_done() -> None:
    clock = RoundClock(round=1, clients=4, start=0.0)
    seen = []
    with reporting(lambda t, total: seen.append((t, total))):
        report_step(1, 5)
    report_step(2, 5)  # outside the block: nobody listens
    assert seen == [(1, 5)]
    event = clock.step(1, 7, 5, 10)  # 1.5 of 4 clients done
    assert event.client == 7
    assert event.round_estimate_s == pytest.approx(event.elapsed_s * 4 / 1.5)
