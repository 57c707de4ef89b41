"""``fedlap-privacy compare``: every method at matched privacy budgets, as a table and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedlap_privacy.cli.common import console, fail, guarded, human_bytes, print_json


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        fail(f"--eps {text!r}: expected comma-separated numbers, e.g. 3,10")


def compare(
    dataset: str = typer.Option("digits", "--dataset"),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Folder with the dataset files."),
    eps: str = typer.Option("3,10", "--eps", help="Target epsilons, comma-separated."),
    delta: float = typer.Option(1e-5, "--delta"),
    methods: str | None = typer.Option(None, "--methods", help="Comma-separated; default: all."),
    rounds: int | None = typer.Option(None, "--rounds", help="Default: train's (10)."),
    seeds: int = typer.Option(1, "--seeds", help="Repeats with seeds seed..seed+N-1."),
    seed: int = typer.Option(0, "--seed"),
    settings: list[str] = typer.Option([], "--set", help="Any configuration key, KEY=VALUE."),
    device: str = typer.Option("auto", "--device"),
    out: Path = typer.Option(Path("runs/compare"), "--out", help="Output directory."),
    json_output: bool = typer.Option(False, "--json", help="Print comparison.json's content."),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch threads (default: "
        "OMP_NUM_THREADS, else usable CPUs / FEDLAP_WORKERS)."),
) -> None:
    """Train each method at each target epsilon; writes comparison.json and a plot into --out."""
    from fedlap_privacy.threads import apply_thread_policy

    guarded(lambda: apply_thread_policy(threads))
    from fedlap_privacy.fl.compare import NO_DP, plan_jobs, run_comparison
    from fedlap_privacy.fl.config import METHODS, resolve_config

    targets = _floats(eps)
    chosen = METHODS if methods is None else [m.strip() for m in methods.split(",")]
    flags = {"dataset": dataset, "delta": delta, "seed": seed, "rounds": rounds,
             "data_dir": None if data_dir is None else str(data_dir)}
    base = guarded(lambda: resolve_config(None, flags, settings, plan_sigma_for_target=False))
    jobs = guarded(lambda: plan_jobs(base, targets, chosen, seeds))

    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
        disable=json_output,
    )
    task = progress.add_task("compare", total=None, info="")

    def on_event(event: str, info: dict[str, Any]) -> None:
        if event == "start":
            progress.update(task, total=info["runs"])
        elif event == "run_start":
            budget = "no DP" if info["eps"] is None else f"eps {info['eps']:g}"
            progress.update(task, info=f"{info['method']} {budget} seed {info['seed']}")
        elif event == "run_end":
            progress.advance(task)

    with progress:
        report = guarded(
            lambda: run_comparison(base, targets, chosen, seeds, out, device, on_event, jobs)
        )
    if json_output:
        print_json(report)
        return
    columns = [f"{e:g}" for e in report["eps"]] + [NO_DP]
    table = Table(title=f"Test accuracy (%) on {report['dataset']}, {report['rounds']} rounds, "
                        f"delta {report['delta']:g}, {report['seeds']} seed(s)")
    table.add_column("method")
    table.add_column("privacy notion")
    table.add_column("upload / client-round", justify="right")
    for c in columns:
        table.add_column(c if c == NO_DP else f"eps {c}", justify="right")
    for method, row in report["methods"].items():
        cells = []
        for c in columns:
            cell = row["results"].get(c)
            if cell is None:
                cells.append("-")
            elif report["seeds"] > 1:
                cells.append(f"{100 * cell['mean']:.2f} ± {100 * cell['std']:.2f}")
            else:
                cells.append(f"{100 * cell['mean']:.2f}")
        upload = row["upload_bytes"]
        table.add_row(method, row["notion"], "-" if upload is None else human_bytes(upload),
                      *cells)
    console.print(table)
    console.print(
        "Epsilons of different notions do not compare: record-level protects one record, "
        "client-level a client's whole dataset, local each uploaded weight per round. "
        f"{report['seconds']:.0f} s. Output: {out}"
    )
