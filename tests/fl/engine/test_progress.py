"""The progress contract: step t of T inside each client, the round's estimate, and the
one-step timing before round 1 (fl/engine/progress.py)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import tiny

from fedlap_privacy.fl.engine.progress import RoundClock, report_step, reporting
from fedlap_privacy.fl.engine.simulation import train


def _events(cfg, **kw) -> tuple[list[tuple[str, dict[str, Any]]], Any]:
    seen: list[tuple[str, dict[str, Any]]] = []
    result = train(cfg, None, device="cpu", callback=lambda e, i: seen.append((e, i)), **kw)
    return seen, result


def test_fedlap_reports_each_access_of_each_client_in_order_with_an_estimate() -> None:
    cfg = tiny(method="fedlap-dp", clients=2, rounds=1, max_loops=2, real_batches=2,
               radius=100.0)  # no early stop at the radius: every client makes its T = 4
    seen, _ = _events(cfg, estimate=True)
    names = [e for e, _ in seen]
    assert names.index("estimate") < names.index("round_start")
    estimate = dict(seen)["estimate"]
    assert estimate["accesses"] == 4 and estimate["clients"] == 2
    assert estimate["round_s"] == pytest.approx(estimate["access_s"] * 4 * 2)
    assert estimate["access_s"] > 0 and estimate["long"] is False  # a tiny run
    steps = [i for e, i in seen if e == "client_step"]
    assert [(s["position"], s["step"], s["steps"]) for s in steps] == [
        (p, t, 4) for p in (0, 1) for t in (1, 2, 3, 4)]
    assert [s["client"] for s in steps] == [0] * 4 + [1] * 4
    assert all(s["round_estimate_s"] >= s["elapsed_s"] > 0 for s in steps)
    # each client's steps come before its client_done
    done = [n for n, (e, _) in enumerate(seen) if e == "client_done"]
    step_at = [n for n, (e, _) in enumerate(seen) if e == "client_step"]
    assert max(step_at[:4]) < done[0] < min(step_at[4:]) and max(step_at) < done[1]


def test_the_timing_before_round_1_changes_nothing_in_the_run() -> None:
    cfg = tiny(method="fedavg", clients=3, split="iid", split_seed=0, cohort_training="loop")
    timed, a = _events(cfg, estimate=True)
    untimed, b = _events(cfg)
    assert "estimate" in dict(timed) and "estimate" not in dict(untimed)
    assert [h.test_accuracy for h in a.history] == [h.test_accuracy for h in b.history]
    steps = [(i["position"], i["step"]) for e, i in timed if e == "client_step" and
             i["round"] == 1]
    assert steps == [(p, t) for p in range(3) for t in (1, 2, 3)]  # local_steps 3


def test_the_clock_estimates_from_the_fraction_done() -> None:
    clock = RoundClock(round=1, clients=4, start=0.0)
    seen = []
    with reporting(lambda t, total: seen.append((t, total))):
        report_step(1, 5)
    report_step(2, 5)  # outside the block: nobody listens
    assert seen == [(1, 5)]
    event = clock.step(1, 7, 5, 10)  # 1.5 of 4 clients done
    assert event["client"] == 7
    assert event["round_estimate_s"] == pytest.approx(event["elapsed_s"] * 4 / 1.5)
