"""Time the accountant (docs/accounting.md#theorem-58) against Opacus and dp-accounting, in one run.

Three operations on the reference configuration (B 256, N_k 10,000, T 200, C 1, delta 1e-5;
sigma 1 and 30 rounds; target epsilon 10), all on the same RDP orders (DEFAULT_ORDERS):

* epsilon      ours ``epsilon``; Opacus ``RDPAccountant`` with the two-entry history
               [(sigma, q1, M), (sigma, q2, M (T-1))] + ``get_epsilon``; dp-accounting
               ``RdpAccountant`` composing (SGM(q1) o SGM(q2)^(T-1))^M as DpEvents;
* plan sigma   ours ``plan_sigma`` (relative precision 1e-4); Opacus
               ``get_noise_multiplier`` (its default epsilon tolerance 0.01; q1 == q2 here, so
               one sample rate and M T steps is the same composition); dp-accounting
               ``calibrate_dp_mechanism`` over sigma (tol 1e-4, like ours);
* plan rounds  ours ``plan_rounds``; Opacus: the natural loop, M = 1, 2, ... until
               ``get_epsilon`` exceeds the target; dp-accounting ``calibrate_dp_mechanism``
               over M with ``discrete=True``.

First checks that the answers agree (epsilon to 1e-3 relative, sigma to 1%, rounds equal;
dp-accounting's RDP epsilon is ~0.2% high on fractional orders -- it bounds the signed series
by its absolute values -- which the check explains by re-running it on integer orders, where
all are exact),
then, after one untimed warm-up call of each, times the implementations interleaved (so that
all see the same machine load) and prints the median and best time of each and the ratios
theirs/ours of the medians.

Then the PLD rows (docs/accounting.md#pld-accounting): our PLD accountant against
dp-accounting's ``PLDAccountant`` on the same event, on the paper's schedule (15 rounds) and a
small-client one (B 64, N_k 1,600, T 50; 30 rounds): values, relative difference, seconds
(ours cold = per-step cache cleared before every call, ours warm = cached steps) and the
ratio dp-accounting / ours, against the target of 100x (cold); then plan sigma for epsilon
10 over 30 rounds (RDP, our PLD, dp-accounting's PLD through ``calibrate_dp_mechanism``,
once: it takes tens of seconds). Then Opacus' own accountants (RDP, PRV) on the PLD rows'
schedules, and ALI-DPFL's accounting with each accountant: its budget Rc, planned once per
run, and the per-round target check plus ledger record of rounds with varying tau.

    python benchmarks/speed/accountant.py [--repeats 5] [--ours-repeats 50] [--pld-repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import dp_accounting as dpa
from dp_accounting.rdp import RdpAccountant
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from fedlap_privacy.accountant import (
    DEFAULT_ORDERS,
    FedLAPSchedule,
    epsilon,
    plan_rounds,
    plan_sigma,
)

SCHEDULE = FedLAPSchedule(batch_size=256, client_size=10000, local_steps=200)
SIGMA, ROUNDS, DELTA, TARGET_EPS = 1.0, 30, 1e-5, 10.0
ORDERS = [float(a) for a in DEFAULT_ORDERS]
TARGET_SPEEDUP = 20.0
#: PLD rows: ours (cold and warm) at least this much faster than dp-accounting's PLD.
TARGET_PLD_SPEEDUP = 100.0


# ----------------------------------------------------------------------------- Opacus


def opacus_epsilon(sigma: float = SIGMA, rounds: int = ROUNDS) -> float:
    accountant = RDPAccountant()
    accountant.history = [
        (sigma, SCHEDULE.q1, rounds),
        (sigma, SCHEDULE.q2, rounds * (SCHEDULE.local_steps - 1)),
    ]
    return float(accountant.get_epsilon(delta=DELTA, alphas=ORDERS))


def opacus_plan_sigma() -> float:
    assert SCHEDULE.q1 == SCHEDULE.q2  # one sample rate describes the composition
    return float(
        get_noise_multiplier(
            target_epsilon=TARGET_EPS,
            target_delta=DELTA,
            sample_rate=SCHEDULE.q2,
            steps=ROUNDS * SCHEDULE.local_steps,
            accountant="rdp",
            alphas=ORDERS,
        )
    )


def opacus_plan_rounds() -> int:
    rounds = 0
    while opacus_epsilon(SIGMA, rounds + 1) <= TARGET_EPS:
        rounds += 1
    return rounds


# ----------------------------------------------------------------------------- dp-accounting


def fedlap_event(sigma: float, rounds: int) -> dpa.DpEvent:
    gaussian = dpa.GaussianDpEvent(sigma)
    one_round = dpa.ComposedDpEvent(
        [
            dpa.PoissonSampledDpEvent(SCHEDULE.q1, gaussian),
            dpa.SelfComposedDpEvent(
                dpa.PoissonSampledDpEvent(SCHEDULE.q2, gaussian), SCHEDULE.local_steps - 1
            ),
        ]
    )
    return dpa.SelfComposedDpEvent(one_round, rounds)


def dpa_epsilon(sigma: float = SIGMA, rounds: int = ROUNDS) -> float:
    accountant = RdpAccountant(ORDERS)
    accountant.compose(fedlap_event(sigma, rounds))
    return float(accountant.get_epsilon(DELTA))


def dpa_plan_sigma() -> float:
    return float(
        dpa.calibrate_dp_mechanism(
            lambda: RdpAccountant(ORDERS),
            lambda sigma: fedlap_event(sigma, ROUNDS),
            TARGET_EPS,
            DELTA,
            bracket_interval=dpa.LowerEndpointAndGuess(0.1, 1.0),
            tol=1e-4,
        )
    )


def dpa_plan_rounds() -> int:
    return int(
        dpa.calibrate_dp_mechanism(
            lambda: RdpAccountant(ORDERS),
            lambda rounds: fedlap_event(SIGMA, rounds),
            TARGET_EPS,
            DELTA,
            bracket_interval=dpa.LowerEndpointAndGuess(1, 2),  # 0 rounds is not an event
            discrete=True,
        )
    )


# ----------------------------------------------------------------------------- ours


def ours_epsilon() -> float:
    return epsilon(SCHEDULE, SIGMA, ROUNDS, DELTA)


def ours_plan_sigma() -> float:
    return plan_sigma(SCHEDULE, ROUNDS, TARGET_EPS, DELTA)


def ours_plan_rounds() -> int:
    return plan_rounds(SCHEDULE, SIGMA, TARGET_EPS, DELTA)


OPERATIONS: dict[str, dict[str, Callable[[], float]]] = {
    "epsilon": {"ours": ours_epsilon, "opacus": opacus_epsilon, "dp-accounting": dpa_epsilon},
    "plan sigma": {
        "ours": ours_plan_sigma,
        "opacus": opacus_plan_sigma,
        "dp-accounting": dpa_plan_sigma,
    },
    "plan rounds": {
        "ours": ours_plan_rounds,
        "opacus": opacus_plan_rounds,
        "dp-accounting": dpa_plan_rounds,
    },
}


def check_agreement() -> list[str]:
    """Answers of the three libraries; returns the lines of the agreement report."""
    lines, ok = [], True
    results = {op: {lib: fn() for lib, fn in fns.items()} for op, fns in OPERATIONS.items()}
    eps = results["epsilon"]
    rel = abs(eps["opacus"] / eps["ours"] - 1)
    ok &= rel <= 1e-3
    lines.append(
        f"epsilon({ROUNDS} rounds)  ours {eps['ours']:.6f}  opacus {eps['opacus']:.6f}"
        f"  rel diff {rel:.1e}  (<= 1e-3)"
    )
    rel = eps["dp-accounting"] / eps["ours"] - 1
    lines.append(
        f"epsilon({ROUNDS} rounds)  ours {eps['ours']:.6f}  dp-accounting "
        f"{eps['dp-accounting']:.6f}  rel diff {rel:+.1e}"
    )
    if abs(rel) > 1e-3:
        # explained only if dp-accounting is above (it sums |terms| of the fractional series,
        # an upper bound, docs/accounting.md#fractional-orders), by < 2%, and agrees exactly
        # on integer orders
        int_orders = [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, *ORDERS[ORDERS.index(12.0) :]]
        accountant = RdpAccountant(int_orders)
        accountant.compose(fedlap_event(SIGMA, ROUNDS))
        theirs_int = float(accountant.get_epsilon(DELTA))
        ours_int = epsilon(SCHEDULE, SIGMA, ROUNDS, DELTA, orders=int_orders)
        rel_int = abs(theirs_int / ours_int - 1)
        explained = 0 < rel <= 0.02 and rel_int <= 1e-6
        ok &= explained
        lines.append(
            f"  {'explained' if explained else 'NOT explained'}: dp-accounting sums absolute "
            f"values of the fractional-order series (an upper bound); on integer orders "
            f"2..63 only: ours {ours_int:.6f}, dp-accounting {theirs_int:.6f}, "
            f"rel diff {rel_int:.1e} (<= 1e-6)"
        )
    sig = results["plan sigma"]
    for lib in ("opacus", "dp-accounting"):
        rel = abs(sig[lib] / sig["ours"] - 1)
        ok &= rel <= 1e-2
        lines.append(
            f"plan sigma (eps {TARGET_EPS:g})  ours {sig['ours']:.5f}  {lib} "
            f"{sig[lib]:.5f}  rel diff {rel:.1e}  (<= 1e-2)"
        )
    # every planned sigma must meet the target under our (exact) accounting
    for s in sig.values():
        ok &= epsilon(SCHEDULE, s, ROUNDS, DELTA) <= TARGET_EPS * (1 + 1e-3)
    rnd = results["plan rounds"]
    ok &= len(set(rnd.values())) == 1
    lines.append(
        f"plan rounds (eps {TARGET_EPS:g}, sigma {SIGMA:g})  "
        + "  ".join(f"{lib} {m}" for lib, m in rnd.items())
    )
    lines.append("agreement: " + ("OK" if ok else "FAILED"))
    if not ok:
        print("\n".join(lines))
        sys.exit("the libraries disagree; timings would be meaningless")
    return lines


def time_all(repeats: int, ours_repeats: int) -> dict[str, dict[str, list[float]]]:
    times: dict[str, dict[str, list[float]]] = {
        op: {lib: [] for lib in fns} for op, fns in OPERATIONS.items()
    }
    for fns in OPERATIONS.values():  # warm-up: first-call overheads excluded
        for fn in fns.values():
            fn()
    for _ in range(repeats):  # interleaved: every library sees the same load
        for op, fns in OPERATIONS.items():
            for lib, fn in fns.items():
                n = ours_repeats // repeats if lib == "ours" else 1
                for _ in range(max(n, 1)):
                    start = time.perf_counter()
                    fn()
                    times[op][lib].append(time.perf_counter() - start)
    return times


def report(times: dict[str, dict[str, list[float]]]) -> bool:
    print(
        f"\n{'operation':<12} {'library':<14} {'median':>11} {'best':>11} {'n':>4}"
        f" {'theirs/ours (median)':>22}"
    )
    all_fast = True
    for op, libs in times.items():
        ours_med = statistics.median(libs["ours"])
        for lib, ts in libs.items():
            med = statistics.median(ts)
            ratio = "" if lib == "ours" else f"{med / ours_med:,.0f}x"
            print(
                f"{op:<12} {lib:<14} {med * 1e3:9.2f}ms {min(ts) * 1e3:9.2f}ms {len(ts):>4}"
                f" {ratio:>22}"
            )
        fastest = min(statistics.median(ts) for lib, ts in libs.items() if lib != "ours")
        speedup = fastest / ours_med
        all_fast &= speedup >= TARGET_SPEEDUP
        print(f"{'':<12} {'-> vs faster':<14} {'':>11} {'':>11} {'':>4} {speedup:>21,.0f}x")
    print(
        f"\ntarget: ours >= {TARGET_SPEEDUP:g}x faster than the faster of Opacus and "
        f"dp-accounting for every operation: {'met' if all_fast else 'NOT met'}"
    )
    return all_fast


# ----------------------------------------------------------------------------- PLD

PLD_SCHEDULES = {
    "paper (B 256, N_k 10,000, T 200), 15 rounds": (SCHEDULE, 15),
    "small client (B 64, N_k 1,600, T 50), 30 rounds": (
        FedLAPSchedule(batch_size=64, client_size=1600, local_steps=50), 30),
}


def _timed(fn: Callable[[], float], repeats: int, before: Callable[[], None] | None = None):
    times, value = [], math.nan
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return value, statistics.median(times)


def pld_report(repeats: int) -> None:
    from dp_accounting.pld import PLDAccountant

    from fedlap_privacy.accountant.dp_events import schedule_event
    from fedlap_privacy.accountant.pld_sgm import sgm_pld

    def theirs(schedule: FedLAPSchedule, rounds: int, sigma: float = SIGMA) -> float:
        acc = PLDAccountant()
        acc.compose(schedule_event(schedule, sigma, rounds))
        return float(acc.get_epsilon(DELTA))

    print(f"\nPLD, sigma {SIGMA:g}, delta {DELTA:g} (medians of {repeats}; machine shared)")
    print(f"{'schedule':<50} {'RDP':>8} {'RDP time':>8} {'ours PLD':>9} {'dp-acc PLD':>10}"
          f" {'rel':>8} {'ours cold':>10} {'ours warm':>10} {'dp-acc':>8} {'ratio cold':>10}"
          f" {'ratio warm':>10}")
    pld_fast = True
    for name, (schedule, rounds) in PLD_SCHEDULES.items():
        def ours(schedule: FedLAPSchedule = schedule, rounds: int = rounds) -> float:
            return epsilon(schedule, SIGMA, rounds, DELTA, accountant="pld")

        ours()  # warm-up (imports)
        value, cold = _timed(ours, repeats, sgm_pld.cache_clear)
        _, warm = _timed(ours, repeats)
        ref, slow = _timed(lambda s=schedule, r=rounds: theirs(s, r), repeats)
        rdp, rdp_time = _timed(lambda s=schedule, r=rounds: epsilon(s, SIGMA, r, DELTA), repeats)
        print(f"{name:<50} {rdp:8.4f} {rdp_time * 1e3:6.2f}ms {value:9.4f} {ref:10.4f}"
              f" {value / ref - 1:+8.1e} {cold * 1e3:8.1f}ms {warm * 1e3:8.1f}ms {slow:7.2f}s"
              f" {slow / cold:9.0f}x {slow / warm:9.0f}x")
        pld_fast &= slow / cold >= TARGET_PLD_SPEEDUP
    print(f"target: ours (cold) >= {TARGET_PLD_SPEEDUP:g}x faster than dp-accounting's PLD on "
          f"both schedules: {'met' if pld_fast else 'NOT met'}")
    opacus_report(repeats)
    ali_report()

    print(f"\nplan sigma (epsilon {TARGET_EPS:g}, {ROUNDS} rounds, paper schedule)")

    def ours_pld_plan() -> float:
        return plan_sigma(SCHEDULE, ROUNDS, TARGET_EPS, DELTA, accountant="pld")

    def dpa_pld_plan() -> float:
        return float(dpa.calibrate_dp_mechanism(
            PLDAccountant, lambda sigma: schedule_event(SCHEDULE, sigma, ROUNDS), TARGET_EPS,
            DELTA, bracket_interval=dpa.LowerEndpointAndGuess(0.5, 1.2), tol=1e-4))

    rows = [("RDP (ours)", ours_plan_sigma, repeats, None),
            ("PLD (ours, cold)", ours_pld_plan, repeats, sgm_pld.cache_clear),
            ("PLD (dp-accounting)", dpa_pld_plan, 1, None)]
    ours_time = math.nan
    for name, fn, n, before in rows:
        value, seconds = _timed(fn, n, before)
        if name.startswith("PLD (ours"):
            ours_time = seconds
        ratio = f"{seconds / ours_time:,.0f}x" if name.endswith("(dp-accounting)") else ""
        print(f"  {name:<22} sigma {value:.5f}  {seconds:8.3f}s  {ratio}")


def _opacus_history(schedule: FedLAPSchedule, rounds: int) -> list[tuple[float, float, int]]:
    """Opacus' history of one run: M first accesses at q1, M (T - 1) later ones at q2."""
    return [(SIGMA, schedule.q1, rounds), (SIGMA, schedule.q2, rounds * (schedule.local_steps - 1))]


def opacus_report(repeats: int) -> None:
    """Opacus' own accountants on the PLD rows' schedules: RDP (its default orders) and PRV
    (Gopi et al. 2021, its default eps_error 0.01), values and seconds, same machine state."""
    from opacus.accountants import PRVAccountant
    from opacus.accountants import RDPAccountant as OpacusRDP

    def run(cls: type, schedule: FedLAPSchedule, rounds: int) -> float:
        accountant = cls()
        accountant.history = _opacus_history(schedule, rounds)
        return float(accountant.get_epsilon(delta=DELTA))

    print(f"\nOpacus' accountants on the same schedules (sigma {SIGMA:g}, delta {DELTA:g})")
    print(f"{'schedule':<50} {'Opacus RDP':>10} {'seconds':>9} {'Opacus PRV':>10} {'seconds':>9}")
    for name, (schedule, rounds) in PLD_SCHEDULES.items():
        cells = []
        for cls in (OpacusRDP, PRVAccountant):
            try:
                value, seconds = _timed(lambda c=cls, s=schedule, r=rounds: run(c, s, r), repeats)
                cells.append(f"{value:10.4f} {seconds:8.3f}s")
            except Exception as exc:  # PRV fails on some schedules (Opacus 601, 604): say so
                cells.append(f"{'failed':>10} {type(exc).__name__:>9}")
        print(f"{name:<50} {' '.join(cells)}")


def ali_report() -> None:
    """ALI-DPFL's accounting with each accountant (fl/methods/alidpfl.py): its budget Rc (iterations
    within epsilon 10, planned once per run, per-step cache cleared) and, per round, the
    driver's target check plus the ledger's record of a round with its own tau (30 rounds,
    tau drawn in 1..100, 5 clients all selected: the ledger composes every distinct tau)."""
    import random

    from fedlap_privacy.accountant.pld_sgm import sgm_pld
    from fedlap_privacy.fl.methods.alidpfl import privacy_iterations
    from fedlap_privacy.state.ledger import PrivacyLedger

    print(f"\nALI-DPFL accounting (sigma {SIGMA:g}, target epsilon {TARGET_EPS:g}, delta "
          f"{DELTA:g}; 30 rounds, tau in 1..100)")
    print(f"{'schedule':<24} {'acc':>4} {'Rc':>6} {'plan Rc':>9} {'round median':>13}"
          f" {'round max':>10} {'epsilon':>8}")
    for name, (b, n) in (("digits B 64, N_k 281", (64, 281)),
                         ("paper B 256, N_k 10,000", (256, 10000))):
        schedule = FedLAPSchedule(batch_size=b, client_size=n, local_steps=100)
        for acc in ("pld", "rdp"):
            sgm_pld.cache_clear()
            ledger = PrivacyLedger("record-level", schedule, SIGMA, DELTA, acc, clients=5)
            start = time.perf_counter()
            rc = privacy_iterations(ledger, TARGET_EPS)
            plan = time.perf_counter() - start
            rng, times = random.Random(0), []
            for m in range(1, 31):
                tau = rng.randint(1, 100)
                start = time.perf_counter()
                ledger.projected_epsilon(tau)
                ledger.record(m, tau, list(range(5)), local_steps=tau)
                times.append(time.perf_counter() - start)
            print(f"{name:<24} {acc:>4} {rc:6d} {plan * 1e3:7.0f}ms"
                  f" {statistics.median(times) * 1e3:11.1f}ms {max(times) * 1e3:8.1f}ms"
                  f" {ledger.epsilon:8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each library")
    parser.add_argument("--ours-repeats", type=int, default=50, help="timed calls of ours")
    parser.add_argument("--pld-repeats", type=int, default=3, help="timed calls in PLD rows")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("absl").setLevel(logging.ERROR)
    print(
        f"reference: B {SCHEDULE.batch_size:g}, N_k {SCHEDULE.client_size}, "
        f"T {SCHEDULE.local_steps}, C {SCHEDULE.client_fraction:g}, sigma {SIGMA:g}, "
        f"{ROUNDS} rounds, delta {DELTA:g}, target epsilon {TARGET_EPS:g}, "
        f"{len(ORDERS)} orders"
    )
    start = time.perf_counter()
    print("\n".join(check_agreement()))
    report(time_all(args.repeats, args.ours_repeats))
    pld_report(args.pld_repeats)
    print(f"\ntotal run time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
