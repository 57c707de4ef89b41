"""Client-level DP at cross-device scale, measured: FashionMNIST in 3,000 shard clients.

The comparison of issue 37 ("Measured"): non-private FedAvg beside client-level DP-FedAvg
(McMahan et al. 2018) with fixed clipping, adaptive clipping (Andrew et al. 2021) and
fixed-size cohorts, DP-NormFedAvg and LDP-FL (Sun et al. 2021), each at epsilon 2
(delta 1e-5), over seeds. Every run is an ordinary ``fedlap-privacy train`` (the CLI, one
run at a time, in a subprocess), so each run folder under ``OUT/runs/`` is auditable. A run
whose result file ``OUT/results/METHOD-seedS.json`` exists is skipped, so an interrupted
comparison resumes and partial results are usable; a run folder without a result (a run
that was stopped) is trained again from the start.

Order: every method for the first seed, then every method for the next, so a partial
comparison stays balanced across methods.

Budgets: the client-level methods (``dp-fedavg-client``, ``dp-normfedavg``) plan sigma so
that the rounds spend epsilon 2 at delta 1e-5 (add/remove one client). LDP-FL has no
(epsilon, delta) over the rounds: its epsilon is LOCAL and per weight per round; it gets
2 / rounds per weight per round (as ``fedlap-privacy compare`` gives it), so a weight
reported in every round composes to 2 (pure, basic composition), while a client's whole
upload of d weights is d x that per round. Those epsilons do not compare with the
client-level ones; the table says which notion each row has.

    python benchmarks/experiments/cross_device_dp.py --data-dir data/fashion-mnist --out runs/xdev-dp
    python benchmarks/experiments/cross_device_dp.py --methods fedavg,dp-fedavg-fixed --seeds 0 --rounds 2

Writes ``OUT/cross_device_dp.json`` (each run's record and the per-method summary) and
prints a markdown table; ``--plot PATH`` saves the mean accuracy against rounds (PNG).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

TARGET_EPS = 2.0
DELTA = 1e-5
REPORT_ROUNDS = (1, 5, 10, 20, 30, 40, 50)


@dataclass(frozen=True)
class MethodRun:
    """One row of the comparison: its name, the CLI flags that make it, its privacy notion."""

    name: str
    label: str
    notion: str  # "none", "client-level", "local per weight per round"
    flags: tuple[str, ...]
    poisson: bool = True  # Poisson client sampling at --client-fraction (else fixed cohorts)
    ldp: bool = False  # LDP-FL: --ldp-epsilon TARGET / rounds


METHODS: dict[str, MethodRun] = {m.name: m for m in (
    MethodRun("fedavg", "`fedavg` (non-private)", "none", ("--method", "fedavg")),
    MethodRun("dp-fedavg-fixed", "`dp-fedavg-client`, fixed C 1", "client-level",
              ("--method", "dp-fedavg-client", "--set", "clip=1")),
    MethodRun("dp-fedavg-adaptive", "`dp-fedavg-client`, adaptive C (median, from 1)",
              "client-level",
              ("--method", "dp-fedavg-client", "--set", "clip=1", "--set", "clip_quantile=0.5")),
    MethodRun("dp-fedavg-cohort100", "`dp-fedavg-client`, fixed C 1, `--clients-per-round 100`",
              "client-level",
              ("--method", "dp-fedavg-client", "--set", "clip=1", "--clients-per-round", "100"),
              poisson=False),
    MethodRun("dp-normfedavg", "`dp-normfedavg`", "client-level", ("--method", "dp-normfedavg")),
    MethodRun("ldp-fl", "`ldp-fl`", "local, per weight per round", ("--method", "ldp-fl"),
              ldp=True),
)}


@dataclass
class RunResult:
    """One finished run: what the CLI's summary and metrics.jsonl report."""

    method: str
    seed: int
    rounds: int
    wall_s: float
    accuracy: list[float]  # test accuracy after each round
    epsilon: float | None  # the run's reported epsilon (its accountant: PLD by default)
    epsilon_by_accountant: dict[str, float] | None  # the same by every accountant (RDP, PLD)
    sigma: float | None  # the accounted noise multiplier
    round_epsilon: float | None  # LDP-FL: per weight per round
    client_sampling: str | None  # how the accountant prices the client selection
    command: list[str] = field(default_factory=list)
    stopped: bool = False  # stopped (SIGTERM, between rounds) before its rounds: partial

    @property
    def complete(self) -> bool:
        return not self.stopped and len(self.accuracy) == self.rounds


def _common_flags(args: argparse.Namespace, seed: int, out: Path) -> list[str]:
    return ["--dataset", "fashion-mnist", "--data-dir", str(args.data_dir), "--clients",
            str(args.clients), "--split", "shards", "--rounds", str(args.rounds),
            "--batch-size", "10", "--local-steps", "10", "--set", "lr_local=0.1",
            "--set", "width=32", "--set", "depth=2", "--set", f"split_seed={seed}",
            "--seed", str(seed), "--out", str(out), "--json"]


def command(method: MethodRun, args: argparse.Namespace, seed: int, out: Path) -> list[str]:
    """The ``fedlap-privacy train`` command line of one run."""
    cmd = [sys.executable, "-m", "fedlap_privacy.cli.main", "train", *method.flags,
           *_common_flags(args, seed, out)]
    if method.poisson:
        cmd += ["--client-fraction", f"{args.cohort / args.clients:.7f}"]
    if method.ldp:
        cmd += ["--ldp-epsilon", f"{TARGET_EPS / args.rounds:.6g}"]
    elif method.notion == "client-level":
        cmd += ["--target-eps", f"{TARGET_EPS:g}", "--delta", f"{DELTA:g}"]
    return cmd


def collect(method: MethodRun, args: argparse.Namespace, seed: int, run_dir: Path,
            wall: float, cmd: list[str]) -> RunResult:
    """A run's record from its folder: the accuracy of every round (``metrics.jsonl``) and
    the privacy statement of its committed checkpoint (loaded as plain data only)."""
    from fedlap_privacy.state.checkpoint import committed_file, load_checkpoint

    privacy = load_checkpoint(committed_file(run_dir, "ckpt.pt"))["privacy"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    accuracy = [float(r["test_accuracy"]) for r in rows if "test_accuracy" in r]
    return RunResult(
        method=method.name, seed=seed, rounds=args.rounds, wall_s=wall, accuracy=accuracy,
        epsilon=privacy.get("epsilon"),
        epsilon_by_accountant=privacy.get("epsilon_by_accountant"),
        sigma=privacy.get("sigma"), round_epsilon=privacy.get("round_epsilon"),
        client_sampling=privacy.get("client_sampling"),
        command=["python", *cmd[1:]], stopped=len(accuracy) < args.rounds,
    )


def run_one(method: MethodRun, args: argparse.Namespace, seed: int) -> RunResult:
    """Train one run (its folder emptied first) and read back its record. A run stopped by
    SIGTERM (``train`` stops between rounds) is recorded as stopped, with its rounds."""
    from fedlap_privacy.fl.engine.stop import STOP_EXIT_CODE

    run_dir = args.out / "runs" / f"{method.name}-seed{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a stopped run of ours: train it again from the start
    cmd = command(method, args, seed, run_dir)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, STOP_EXIT_CODE):
        raise RuntimeError(f"{method.name} seed {seed} exited {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return collect(method, args, seed, run_dir, wall, cmd)


def _cell(mean: float, sd: float, seeds: int) -> str:
    """``mean ± sd`` over several seeds, the value alone for one."""
    return f"{mean:.1f} ± {sd:.1f}" if seeds > 1 else f"{mean:.1f}"


def summarise(results: list[RunResult], rounds: int) -> list[dict[str, object]]:
    """Per method: seeds, epsilon, accuracy after the report rounds (mean, population sd)."""
    rows = []
    for name, method in METHODS.items():
        every = [r for r in results if r.method == name and r.rounds == rounds]
        if not every:
            continue
        # the complete runs; a method whose every run was stopped shows what they reached
        runs = [r for r in every if r.complete] or every
        at = {k: [100 * r.accuracy[k - 1] for r in runs if len(r.accuracy) >= k]
              for k in REPORT_ROUNDS if k <= rounds}
        final = [100 * r.accuracy[-1] for r in runs]
        eps = [r.epsilon for r in runs if r.epsilon is not None]
        rdp = [r.epsilon_by_accountant["rdp"] for r in runs
               if r.epsilon_by_accountant and "rdp" in r.epsilon_by_accountant]
        pld = [r.epsilon_by_accountant["pld"] for r in runs
               if r.epsilon_by_accountant and "pld" in r.epsilon_by_accountant]
        rows.append({
            "method": name, "label": method.label, "notion": method.notion,
            "seeds": sorted(r.seed for r in runs),
            "epsilon_mean": statistics.fmean(eps) if eps else None,
            "epsilon_rdp_mean": statistics.fmean(rdp) if rdp else None,
            "epsilon_pld_mean": statistics.fmean(pld) if pld else None,
            "client_sampling": runs[0].client_sampling,
            "sigma_mean": statistics.fmean([r.sigma for r in runs if r.sigma is not None])
            if any(r.sigma is not None for r in runs) else None,
            "ldp_epsilon": runs[0].round_epsilon if method.ldp else None,
            "accuracy_at": {k: (statistics.fmean(v), statistics.pstdev(v)) for k, v in at.items()
                            if v},
            "final_mean": statistics.fmean(final), "final_sd": statistics.pstdev(final),
            "mean_by_round": [statistics.fmean(100 * r.accuracy[i] for r in runs)
                              for i in range(min(len(r.accuracy) for r in runs))],
            "wall_s_mean": statistics.fmean(r.wall_s for r in runs),
            "stopped": {r.seed: len(r.accuracy) for r in every if not r.complete},
            "partial": not any(r.complete for r in every),
        })
    return rows


def _epsilon_cell(row: dict[str, object]) -> str:
    if row["notion"] == "none":
        return "-"
    if row["ldp_epsilon"] is not None:
        return (f"{row['epsilon_mean']:g} local, per weight, composed over every round "
                f"({row['ldp_epsilon']:g} per weight per round; NOT client-level)")
    pld, rdp = row["epsilon_pld_mean"], row["epsilon_rdp_mean"]
    text = f"{row['epsilon_mean']:.3f} client-level" if pld is None else \
        f"{pld:.3f} client-level (PLD)"
    return text + ("" if rdp is None else f", RDP {rdp:.3f}")


def markdown(rows: list[dict[str, object]], rounds: int) -> str:
    """The table of docs/train.md: accuracy % mean ± population sd over the seeds."""
    shown = [k for k in REPORT_ROUNDS if k <= rounds]
    lines = [f"| method | seeds | epsilon (delta {DELTA:g}) | sigma | test accuracy after round "
             f"{' / '.join(map(str, shown))} (%) | final (%) | wall time / run |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        n = len(row["seeds"])
        acc = row["accuracy_at"]
        cells = " / ".join(_cell(*acc[k], n) for k in shown if k in acc)
        sigma = "-" if row["sigma_mean"] is None else f"{row['sigma_mean']:.3f}"
        final = f"**{_cell(row['final_mean'], row['final_sd'], n)}**"
        label, wall = row["label"], f"{row['wall_s_mean']:.0f} s"
        if row["partial"]:
            reached = min(row["stopped"].values())
            label += f", STOPPED after round {reached} of {rounds}"
            final = f"{_cell(row['final_mean'], row['final_sd'], n)} (round {reached})"
            wall += f" for {reached} rounds"
        lines.append(f"| {label} | {n} | {_epsilon_cell(row)} | {sigma} | {cells} | {final} | "
                     f"{wall} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, object]], path: Path) -> None:
    """Mean test accuracy against rounds, a line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for row in rows:
        means = row["mean_by_round"]
        ax.plot(range(1, len(means) + 1), means,
                label=f"{row['method']} ({len(row['seeds'])} seed"
                f"{'s' if len(row['seeds']) > 1 else ''})")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%), mean over seeds")
    ax.set_title("FashionMNIST, 3,000 clients, ~100 per round, epsilon 2")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _stopped_run(method: MethodRun, args: argparse.Namespace, seed: int) -> RunResult | None:
    """The record of a run folder left without a result (its run was stopped), or None.
    Its wall time is the sum of its rounds' times (startup not included), or, where the
    release withholds them, the span of its files' modification times."""
    from fedlap_privacy.state.run_lock import RunBusyError, lock_run_folder

    run_dir = args.out / "runs" / f"{method.name}-seed{seed}"
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file() or not metrics.read_text().strip():
        return None
    try:
        lock_run_folder(run_dir).release()
    except RunBusyError:
        return None  # still training (another driver's run): not stopped
    seconds = sum(json.loads(line).get("seconds", 0.0)
                  for line in metrics.read_text().splitlines() if line.strip())
    if not seconds:
        times = [f.stat().st_mtime for f in run_dir.iterdir() if f.is_file()]
        seconds = max(times) - min(times)
    return collect(method, args, seed, run_dir, seconds, command(method, args, seed, run_dir))


def _load(path: Path) -> RunResult:
    return RunResult(**json.loads(path.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data/fashion-mnist"))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--clients", type=int, default=3000)
    parser.add_argument("--cohort", type=int, default=100,
                        help="expected clients per round (Poisson rate cohort / clients)")
    parser.add_argument("--out", type=Path, default=Path("runs/cross-device-dp"))
    parser.add_argument("--stop-at", type=float, default=None,
                        help="start no run after this Unix time (partial results are kept)")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    results_dir = args.out / "results"
    results_dir.mkdir(parents=True, exist_ok=True)

    failures: dict[str, str] = {}
    for seed in seeds:
        for name in methods:
            path = results_dir / f"{name}-seed{seed}-r{args.rounds}.json"
            late = args.stop_at is not None and time.time() > args.stop_at
            if path.exists() and (late or _load(path).complete):
                continue
            if late:
                print(f"stop time reached: {name} seed {seed} not started", flush=True)
                stopped = _stopped_run(METHODS[name], args, seed)
                if stopped is not None:  # stopped before its rounds (e.g. by an older driver)
                    path.write_text(json.dumps(asdict(stopped), indent=1))
                continue
            print(f"{time.strftime('%H:%M:%S')} {name} seed {seed} ...", end=" ", flush=True)
            try:
                result = run_one(METHODS[name], args, seed)
            except RuntimeError as exc:
                failures[f"{name}-seed{seed}"] = str(exc)
                print(f"refused/failed: {exc}", flush=True)
                continue
            path.write_text(json.dumps(asdict(result), indent=1))
            print(f"{result.wall_s:.0f} s, {len(result.accuracy)} rounds, final "
                  f"{100 * result.accuracy[-1]:.1f}%, eps {result.epsilon}, sigma {result.sigma}"
                  + (" (STOPPED)" if result.stopped else ""), flush=True)

    results = [_load(p) for p in sorted(results_dir.glob(f"*-r{args.rounds}.json"))]
    rows = summarise(results, args.rounds)
    load = os.getloadavg()
    report = {"rounds": args.rounds, "clients": args.clients, "cohort": args.cohort,
              "target_eps": TARGET_EPS, "delta": DELTA, "load_average_at_end": load,
              "failures": failures, "summary": rows, "runs": [asdict(r) for r in results]}
    (args.out / "cross_device_dp.json").write_text(json.dumps(report, indent=1))
    print(markdown(rows, args.rounds))
    for key, why in failures.items():
        print(f"- {key}: {why}")
    if args.plot is not None and rows:
        plot(rows, args.plot)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
