"""``fedlap-privacy compare``: every method at matched privacy budgets, as a table and plots;
with several ``--rounds``, accuracy against the round count at matched epsilon
(:mod:`fedlap_privacy.fl.engine.compare`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedlap_privacy.cli.common import (
    DATA_HELP,
    DRY_RUN_HELP,
    MODEL_HELP,
    SCHEDULE_HELP,
    FoldingTable,
    ScheduleChoice,
    check_writable,
    console,
    data_flags,
    fail,
    guarded,
    human_bytes,
    human_seconds,
    print_data_plan,
    print_json,
    print_schedule,
)
from fedlap_privacy.fl.engine.events import (
    ComparisonEvent,
    ComparisonRunEnded,
    ComparisonRunStarted,
    ComparisonStarted,
)
from fedlap_privacy.fl.engine.stop import stop_between_rounds

if TYPE_CHECKING:
    from fedlap_privacy.fl.engine.compare_records import Comparison
    from fedlap_privacy.fl.engine.dry_run import ComparePlan


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        fail(f"--eps {text!r}: expected comma-separated numbers, e.g. 3,10")


def _round_counts(text: str) -> list[int]:
    """``--rounds``: comma-separated whole numbers >= 1 (empty items are skipped), checked by
    :func:`fedlap_privacy.fl.engine.compare.round_counts`; anything else: one line and exit 2."""
    from fedlap_privacy.fl.engine.compare import round_counts

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        fail(f"--rounds {text!r}: expected comma-separated whole numbers >= 1, e.g. 1,3,10")
    return guarded(lambda: round_counts(values))


def _accuracy(mean: float, std: float, seeds: int) -> str:
    """Mean test accuracy in %, with the standard deviation over seeds when there are several."""
    if seeds > 1:
        return f"{100 * mean:.2f} ± {100 * std:.2f}"
    return f"{100 * mean:.2f}"


def compare(
    dataset: str | None = typer.Option(None, "--dataset", help="Default: digits."),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Folder with the dataset files."),
    data: Path | None = typer.Option(None, "--data", help=DATA_HELP),
    model: str | None = typer.Option(None, "--model", help=MODEL_HELP),
    eps: str = typer.Option("3,10", "--eps", help="Target epsilons, comma-separated."),
    delta: float = typer.Option(1e-5, "--delta"),
    methods: str | None = typer.Option(None, "--methods", help="Comma-separated; default: all."),
    rounds: str | None = typer.Option(None, "--rounds", help="Round count(s), comma-separated, "
        "e.g. 1,3,10; each gets its own budget (target spent after that many rounds). "
        "Default: train's (10)."),
    seeds: int = typer.Option(1, "--seeds", help="Repeats with seeds seed..seed+N-1."),
    seed: int = typer.Option(0, "--seed"),
    settings: list[str] = typer.Option([], "--set", help="Any configuration key, KEY=VALUE."),
    schedule: ScheduleChoice = typer.Option("auto", "--schedule", help=SCHEDULE_HELP),  # type: ignore[valid-type]
    device: str = typer.Option("auto", "--device"),
    out: Path = typer.Option(Path("runs/compare"), "--out", help="Output directory."),
    json_output: bool = typer.Option(False, "--json", help="Print comparison.json's content."),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch threads (default: "
        "OMP_NUM_THREADS, else usable CPUs / FEDLAP_WORKERS; at most the CPUs it may run on)."),
    dry_run: bool = typer.Option(False, "--dry-run", help=DRY_RUN_HELP),
) -> None:
    """Train each method at each target epsilon (and round count); writes comparison.json and
    plots into --out."""
    from fedlap_privacy.compute.threads import apply_cpu_policy

    guarded(lambda: apply_cpu_policy(threads))
    from fedlap_privacy.fl.config_rules import METHODS
    from fedlap_privacy.fl.engine.compare import (
        bases_by_rounds,
        check_overrides,
        comparison_split_seed,
        plan_jobs,
        run_comparison,
    )
    from fedlap_privacy.fl.methods.schedule import SCHEDULED_METHOD

    targets = _floats(eps)
    counts = None if rounds is None else _round_counts(rounds)
    several = counts is not None and len(counts) > 1
    guarded(lambda: check_overrides(settings, several))
    chosen = METHODS if methods is None else [m.strip() for m in methods.split(",")]
    flags = {**guarded(lambda: data_flags(dataset, data, model)), "delta": delta, "seed": seed,
             "rounds": None if counts is None else counts[-1],
             "data_dir": None if data_dir is None else str(data_dir)}
    # a base per round count: FedLAP-DP's schedule depends on it
    by_rounds = guarded(lambda: bases_by_rounds(flags, settings, chosen, schedule.value,
                                                counts if several else [flags["rounds"]]))
    base = list(by_rounds.values())[-1]
    # one count: base.rounds (after --set), exactly as a single --rounds always did
    split_seed = guarded(lambda: comparison_split_seed(base, out))  # secret: never printed
    jobs = guarded(lambda: plan_jobs(base, targets, chosen, seeds, counts if several else None,
                                     by_rounds, split_seed))
    if SCHEDULED_METHOD in base and not json_output:  # after every check: errors stay one line
        print_schedule(schedule.value, *(b[SCHEDULED_METHOD] for b in by_rounds.values()))
    if dry_run:
        from fedlap_privacy.fl.engine.dry_run import plan_compare

        plan = guarded(lambda: plan_compare(jobs, out, device, split_seed=split_seed))
        if json_output:
            print_json(plan.to_json())
        else:
            _print_plan(plan)
        return
    guarded(lambda: check_writable(out, probe=not dry_run))

    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
        disable=json_output,
    )
    task = progress.add_task("compare", total=None, info="")

    def on_event(event: ComparisonEvent) -> None:
        if isinstance(event, ComparisonStarted):
            progress.update(task, total=event.runs)
        elif isinstance(event, ComparisonRunStarted):
            budget = "no DP" if event.eps is None else f"eps {event.eps:g}"
            count = f" {event.rounds} rounds" if several else ""
            progress.update(task, info=f"{event.method} {budget}{count} seed {event.seed}")
        elif isinstance(event, ComparisonRunEnded):
            progress.advance(task)

    with progress, stop_between_rounds():
        report = guarded(
            lambda: run_comparison(base, targets, chosen, seeds, out, device, on_event, jobs,
                                   split_seed=split_seed)
        )
    if json_output:
        print_json(report.to_json())
        return
    if several:
        _print_by_rounds(report)
    else:
        _print_by_epsilon(report)
    console.print(
        "Epsilons of different notions do not compare: record-level protects one record, "
        "client-level a client's whole dataset, local each uploaded weight per round. "
        f"{report.seconds:.0f} s. Output: {out}"
    )


def _print_by_epsilon(report: Comparison) -> None:
    """One round count: a row per method, a column per target epsilon (the paper's Table 2)."""
    from fedlap_privacy.fl.engine.compare import NO_DP

    columns = [f"{e:g}" for e in report.eps] + [NO_DP]
    table = FoldingTable(title=f"Test accuracy (%) on {report.dataset}, {report.rounds} "
                         f"rounds, delta {report.delta:g}, {report.seeds} seed(s)")
    table.add_column("method", no_wrap=True)
    table.add_column("privacy notion")
    table.add_column("upload / client-round", justify="right")
    for c in columns:
        table.add_column(c if c == NO_DP else f"eps {c}", justify="right")
    for method, row in report.methods.items():
        cells = []
        for c in columns:
            cell = row.results.get(c)
            cells.append("-" if cell is None else _accuracy(cell.mean, cell.std, report.seeds))
        upload = row.upload_bytes
        table.add_row(method, row.notion, "-" if upload is None else human_bytes(upload),
                      *cells)
    console.print(table)


def _print_by_rounds(report: Comparison) -> None:
    """Several round counts: a row per method and budget, a column per round count with the
    final accuracy and the epsilon the run reports (each count planned for its own budget)."""
    from fedlap_privacy.fl.engine.compare import NO_DP

    counts = report.round_counts
    table = FoldingTable(title=f"Test accuracy (%) and epsilon spent after R rounds at matched "
                        f"target epsilon, {report.dataset}, delta {report.delta:g}, "
                        f"{report.seeds} seed(s)")
    table.add_column("method", no_wrap=True)
    table.add_column("privacy notion")
    table.add_column("upload / client-round", justify="right")
    table.add_column("target")
    for r in counts:
        table.add_column(f"{r} round" + ("" if r == 1 else "s"), justify="right")
    for method, row in report.methods.items():
        upload = row.upload_bytes
        cells = list(row.results.items())
        for i, (column, cell) in enumerate(cells):
            by_rounds = {p.rounds: p for p in cell.by_rounds}
            values = []
            for r in counts:
                point = by_rounds.get(r)
                if point is None:
                    values.append("-")
                    continue
                spent = point.epsilon_mean
                values.append(_accuracy(point.mean, point.std, report.seeds)
                              + ("" if spent is None else f"\neps {spent:.2f}"))
            first = i == 0
            table.add_row(
                method if first else "", row.notion if first else "",
                "" if not first else "-" if upload is None else human_bytes(upload),
                column if column == NO_DP else f"eps {column}", *values,
                end_section=i == len(cells) - 1,
            )
    console.print(table)


def _print_plan(plan: ComparePlan) -> None:
    """``compare --dry-run``: a row per run (budget, rounds, sigma, epsilon spent, time)."""
    console.print("[bold]dry run[/]: nothing trained, nothing written", highlight=False)
    print_data_plan(plan.data)
    table = FoldingTable(title=f"{len(plan.runs)} runs into {plan.out}")
    for column in ("method", "target", "seed", "rounds", "T", "sigma", "epsilon spent",
                   "against", "time"):
        table.add_column(column, justify="left" if column in ("method", "against") else "right",
                         no_wrap=column == "method")
    for method, eps, seed, run, done in plan.runs:
        p = run.privacy
        spent = p.epsilon
        table.add_row(
            method, "-" if eps is None else f"{eps:g}", str(seed),
            f"{run.rounds_run}" + ("" if run.rounds_run == run.config.rounds
                                   else f" of {run.config.rounds}"),
            str(run.accesses_per_round), "-" if p.sigma is None else f"{p.sigma:.4g}",
            "-" if spent is None else f"{spent:.3f} ({p.notion})",
            p.threat_model or "-", "in --out already" if done else human_seconds(run.seconds),
        )
    console.print(table)
    console.print(f"time: about {human_seconds(plan.seconds)} on this machine (each method's "
                  "round timed once on random data of the dataset's shape, with the machine's "
                  "load now)", highlight=False)
