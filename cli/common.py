"""What every sub-command shares: one-line errors, JSON output, a rich console."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fedlap_privacy.errors import ConfigError, FedlapError
from fedlap_privacy.fl.engine.stop import STOP_EXIT_CODE, StopRequested
from fedlap_privacy.fl.methods.schedule import LARGE_MIN_RECORDS, SCHEDULE_CHOICES
from fedlap_privacy.state.jsonsafe import json_safe
from fedlap_privacy.vocabulary import NoiseKind, Notion, ThreatModel

if TYPE_CHECKING:
    from fedlap_privacy.data.dataset_files import Download
    from fedlap_privacy.fl.config import TrainConfig
    from fedlap_privacy.fl.engine.dry_run import DataPlan, RunPlan, TrainPlan
    from fedlap_privacy.fl.run.run_records import PrivacyStatement

console = Console()
err_console = Console(stderr=True)
T = TypeVar("T")


class FoldingTable(Table):
    """A rich table whose cells wrap at spaces and fold a word too long for its column,
    never cut with an ellipsis: at 80 columns and in a pipe every value stays whole."""

    def add_column(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("overflow", "fold")
        super().add_column(*args, **kwargs)


def choice_enum(name: str, words: Iterable[str]) -> type[StrEnum]:
    """A typer choice built from the words the package defines (a flag never lists its own)."""
    return StrEnum(name, {str(w).replace("-", "_"): str(w) for w in words})  # type: ignore[misc]


ScheduleChoice = choice_enum("ScheduleChoice", SCHEDULE_CHOICES)
#: --schedule's help (train, compare)
SCHEDULE_HELP = (
    "FedLAP-DP's client schedule. auto: large (the authors', tuned: B 256, T = 200 in a "
    "one-round run, 50 from three rounds on, server rate x10) when clients hold >= "
    f"{LARGE_MIN_RECORDS:,} records on average, else small (train's defaults: B 64, T = 10; "
    "about 4x cheaper per round than T = 50). Keys you set win."
)

#: --dry-run's help (train, compare, audit)
DRY_RUN_HELP = (
    "Check every setting and input file and print what the run would do (methods, rounds, "
    "sigma, the epsilon it spends and against whom, the data, an estimated time from one "
    "round timed on random data); trains nothing, writes nothing, downloads nothing."
)


def print_schedule(requested: str, *cfgs: TrainConfig) -> None:
    """The line naming FedLAP-DP's schedule and the runs' resolved B and T, one configuration
    per round count, as "T = 200 / 50 for 1 / 3 rounds" where T differs (nothing for the
    other methods), or the cross-device defaults where the rule picked them."""
    from fedlap_privacy.fl.config_resolve import cross_device_defaults, fedlap_schedule

    chosen = fedlap_schedule(requested, cfgs[-1].to_dict())
    if chosen is None:
        scale = cross_device_defaults(cfgs[-1].to_dict())
        if scale is not None:
            console.print(scale.describe(cfgs[-1]), highlight=False)
        return
    accesses = [c.accesses_per_round for c in cfgs]
    t = str(accesses[0]) if len(set(accesses)) == 1 else (
        f"{' / '.join(map(str, accesses))} for {' / '.join(str(c.rounds) for c in cfgs)} rounds")
    console.print(chosen.describe(cfgs[-1].batch_size, t), highlight=False)


#: --data's help (train, compare)
DATA_HELP = ("Your own records instead of --dataset: a folder of .npz files, one per client "
             "(x, y; optional test.npz), or one .npz (x, y, optional client). x: images "
             "(N, C, H, W) or feature rows (N, D). See docs/own-data.md.")
#: --model's help (train, compare)
MODEL_HELP = ("FILE.py:FUNC or module:FUNC: FUNC(input_shape, num_classes) returns the "
              "torch.nn.Module to train (no BatchNorm). Default: the ConvNet for images, an MLP "
              "for feature rows.")


def data_flags(dataset: str | None, data: Path | None, model: str | None) -> dict[str, Any]:
    """The configuration keys of --dataset, --data and --model (one of the first two)."""
    from fedlap_privacy.data.datasets import CUSTOM
    from fedlap_privacy.errors import ConfigError

    if data is not None and dataset is not None:
        raise ConfigError("--dataset and --data exclude each other: --data brings your own "
                          "records")
    return {"dataset": CUSTOM if data is not None else dataset,
            "data": None if data is None else str(data), "model": model}


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one clear line to stderr and exit non-zero (never a traceback)."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def guarded(call: Callable[[], T]) -> T:
    """Run ``call``; user errors (bad values, files and folders, checkpoints) become one line +
    exit 2, a stop on request (SIGTERM between rounds) one line + exit 143, Ctrl-C exit 130."""
    try:
        return call()
    except StopRequested as exc:
        fail(str(exc), code=STOP_EXIT_CODE)
    except (FedlapError, ValueError, OSError) as exc:  # OSError: a file or folder of the user's
        # the text may quote a file's content (a recorded model factory): shown, not markup
        fail(escape(str(exc).splitlines()[0]) if str(exc) else type(exc).__name__)
    except KeyboardInterrupt:
        fail("interrupted", code=130)


def check_writable(folder: Path, flag: str = "--out", *, probe: bool = True) -> None:
    """Refuse (ConfigError, one line) an output folder that cannot be created or written,
    before any work: the nearest existing folder on its path must take a new entry (probed
    with a temporary folder, removed at once; nothing else is created). ``probe=False`` (a
    dry run, which leaves every folder as it was): asked of the file system's permissions
    only (``os.access``), which root always passes."""
    existing = folder
    while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
        existing = existing.parent
    if existing.is_symlink() and not existing.exists():
        return  # a dangling link: the run folder's own check names it
    if not existing.is_dir():
        raise ConfigError(f"{flag} {folder} cannot be created: {existing} is a file, not a folder")
    if not probe:
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"{flag} {folder} cannot be written ({existing})")
        return
    try:
        with tempfile.TemporaryDirectory(dir=existing, prefix=".fedlap-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {folder} cannot be written: {exc.strerror or exc} "
                          f"({existing})") from None


def print_json(obj: dict[str, Any]) -> None:
    """One JSON object on stdout (non-finite floats become null, so the output is valid JSON)."""
    sys.stdout.write(json.dumps(json_safe(obj)) + "\n")


def human_bytes(n: float) -> str:
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("kB", "MB"):
        n /= 1000
        if n < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} GB"


def privacy_sentence(p: PrivacyStatement, sigma_planned: bool = False) -> str:
    """What a run's epsilon protects, against whom, and what it declares public
    (``sigma_planned``: sigma was planned for a target epsilon)."""
    notion, eps = p.notion, p.epsilon
    if notion in (Notion.RECORD, Notion.CLIENT) and eps is not None:
        unit = "a record" if notion == Notion.RECORD else "a client's whole dataset"
        against = {
            ThreatModel.SERVER:
                "against the server (it sees whom it selected and every upload)",
            ThreatModel.HIDDEN_SELECTION:
                "against parties who do not know which clients were selected (NOT against the "
                "server)",
            ThreatModel.TRUSTED_SERVER:
                "against those who see the released models; the server, which sees each "
                "update, is trusted",
        }.get(p.threat_model or "", "")
        if p.secure_aggregation and p.threat_model == ThreatModel.SERVER:
            against = ("against the server (it sees whom it selected and only the sum of the "
                       "uploads)")
        planned = " (planned for the target)" if sigma_planned else ""
        text = (f"({eps:.3f}, {p.delta:g})-DP for {unit} ({notion}) {against}, "
                f"sigma {p.sigma:.4g}{planned}")
        accountant = p.accountant
        if accountant:
            beside = [f"{name.upper()} {value:.3f}" for name, value in
                      (p.epsilon_by_accountant or {}).items() if name != accountant]
            text += f", accounted with {accountant.upper()}" + (
                f" ({', '.join(beside)})" if beside else "")
        others = p.epsilon_by_threat_model or {}
        other = [f"{eps_t:.3f} {t}" for t, eps_t in others.items() if t != p.threat_model]
        if other:
            approximate = (": an approximation, the summed integer noise taken as Gaussian; "
                           "the bound proven is the server's" if p.secure_aggregation else "")
            text += f" (epsilon {', '.join(other)}{approximate})"
        if p.client_sampling:
            text += f"; {p.client_sampling}"
        if p.secure_aggregation:
            text += f"; {p.secure_aggregation}"
    elif notion == Notion.LOCAL and eps is not None:
        text = (f"local DP: each uploaded weight {p.round_epsilon:g}-LDP per round, "
                f"{eps:g} per weight over the run (a whole upload: d x that)")
    else:
        return "no formal privacy (non-private method)"
    if p.noise == NoiseKind.SEEDED:
        text += (". [bold red]NOT PRIVATE:[/] the noise was derived from the seed "
                 "(--reproducible-noise)")
    if p.public:
        text += ". Released as public: " + "; ".join(p.public)
    return text


def human_seconds(seconds: float | None) -> str:
    """``95`` -> ``1 min 35 s``; None -> ``not timed``."""
    if seconds is None:
        return "not timed"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 90 else f"{minutes / 60:.1f} h"


def print_data_plan(data: DataPlan) -> None:
    console.print(f"data: {data.describe()} (labels read for the split, no image used)",
                  highlight=False)


def print_run_plan(run: RunPlan) -> None:
    """The lines of one planned run: method, rounds, sigma, epsilon and against whom, time."""
    cfg = run.config
    sigma = ("no Gaussian noise" if not cfg.private else
             f"sigma {cfg.sigma:.4g}" + (" (planned for the target)" if run.sigma_planned
                                          else ""))
    start = f", from round {run.start_round}" if run.start_round > 1 else ""
    cohort = (f"fraction {cfg.client_fraction:g}" if cfg.clients_per_round is None
              else f"{cfg.clients_per_round} per round")
    console.print(
        f"run: {cfg.method}, {cfg.rounds} rounds{start}, {cfg.clients} clients ({cohort}), "
        f"B {cfg.batch_size}, T = {run.accesses_per_round} "
        f"accesses per client-round, {sigma}", highlight=False)
    if run.stop:
        console.print(f"[bold yellow]stops after {run.rounds_run} round(s):[/] {run.stop}",
                      highlight=False)
    console.print("privacy: " + privacy_sentence(run.privacy), highlight=False)


def describe_downloads(downloads: Sequence[Download]) -> str:
    """``4 files, 30.9 MB, from HOST into FOLDER (MD5-checked)``."""
    total = sum(d.size for d in downloads)
    hosts = sorted({d.url.split("/")[2] for d in downloads})
    return (f"{len(downloads)} file{'s' if len(downloads) != 1 else ''}, {human_bytes(total)}, "
            f"from {', '.join(hosts)} into {downloads[0].target.parent} (MD5-checked)")


def print_train_plan(plan: TrainPlan, engine: str, download: bool) -> None:
    """``train --dry-run``'s report; the problems that would stop the run last, on stderr."""
    console.print("[bold]dry run[/]: nothing trained, nothing written, nothing downloaded",
                  highlight=False)
    print_data_plan(plan.data)
    if plan.downloads:
        console.print(f"--download: the run would fetch {describe_downloads(plan.downloads)}",
                      highlight=False)
    elif download:
        console.print("--download: the files are present; nothing would be fetched",
                      highlight=False)
    print_run_plan(plan.run)
    for warning in plan.warnings:
        console.print(f"[bold yellow]warning:[/] {escape(warning)}", highlight=False)
    run = plan.run
    timing = run.timing
    how = "not timed" if timing is None else timing.describe()
    per_round = ("" if timing is None or not run.rounds_run or run.seconds is None else
                 f", {human_seconds((run.seconds - timing.setup) / run.rounds_run)} a round")
    console.print(
        f"time: about {human_seconds(run.seconds)} on this machine{per_round} ({engine} "
        f"engine; {how}; with the machine's load now)", highlight=False)
    console.print(f"would write: {plan.out}" + (" (continuing the run there)" if plan.resume
                                                 else " (ckpt.pt, private.pt, metrics.jsonl, "
                                                 "plots)"), highlight=False)
    for problem in plan.problems:
        err_console.print(f"[bold red]the run would stop:[/] {escape(problem)}",
                          highlight=False, soft_wrap=True)
