"""``fedlap-privacy train``: FedLAP-DP (default), FedLAP and the baselines, with a live display."""

from __future__ import annotations

from contextlib import nullcontext
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from fedlap_privacy.accountant.distributed import DistributedNoise
from fedlap_privacy.cli.common import (
    DATA_HELP,
    DRY_RUN_HELP,
    MODEL_HELP,
    SCHEDULE_HELP,
    FoldingTable,
    ScheduleChoice,
    check_writable,
    choice_enum,
    console,
    data_flags,
    describe_downloads,
    err_console,
    fail,
    guarded,
    human_bytes,
    print_json,
    print_schedule,
    print_train_plan,
    privacy_sentence,
)
from fedlap_privacy.fl.config import PRESETS
from fedlap_privacy.fl.config_resolve import number_text
from fedlap_privacy.fl.config_rules import METHODS
from fedlap_privacy.fl.engine.events import (
    ClientDone,
    ClientStep,
    RoundEnded,
    RoundEstimate,
    RunEvent,
    RunStarted,
    RunWarning,
)
from fedlap_privacy.fl.engine.stop import STOP_EXIT_CODE, STOPPED, stop_between_rounds
from fedlap_privacy.fl.engine.terminal_progress import duration
from fedlap_privacy.fl.run.run_records import RoundRecord, RunSummary
from fedlap_privacy.vocabulary import ThreatModel, words

Method = choice_enum("Method", METHODS)
SecureNoise = choice_enum("SecureNoise", words(DistributedNoise))
Preset = choice_enum("Preset", PRESETS)


class Engine(StrEnum):
    simulation = "simulation"
    flower = "flower"
    flower_simulation = "flower-simulation"


def train(
    ctx: typer.Context,
    method: Method | None = typer.Option(None, "--method", help="Default: fedlap-dp."),  # type: ignore[valid-type]
    dataset: str | None = typer.Option(None, "--dataset", help="digits (default) | mnist | "
                                       "fashion-mnist | cifar10"),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Folder with the dataset files."),
    data: Path | None = typer.Option(None, "--data", help=DATA_HELP),
    model: str | None = typer.Option(None, "--model", help=MODEL_HELP),
    download: bool = typer.Option(False, "--download", help="Fetch missing dataset files."),
    split: str = typer.Option("noniid", "--split", help="noniid | iid | dirichlet | shards | "
                         "label-dirichlet (the last two: cross-device, thousands of clients)"),
    alpha: float = typer.Option(0.5, "--alpha", help="Dirichlet concentration."),
    clients: int = typer.Option(5, "--clients"),
    client_fraction: float | None = typer.Option(
        None, "--client-fraction", parser=number_text, metavar="FLOAT",
        help="Poisson client sampling: each client takes part in a round with this "
        "probability (0.05, or a fraction: 1/30)."),
    clients_per_round: int | None = typer.Option(
        None, "--clients-per-round", help="Fixed-size cohorts: this many clients per round, "
        "drawn without replacement (dp-fedavg-client accounts it)."),
    rounds: int | None = typer.Option(None, "--rounds"),
    sigma: float | None = typer.Option(None, "--sigma", help="Noise multiplier."),
    target_eps: float | None = typer.Option(
        None, "--target-eps", help="Spend this epsilon: sigma is planned for the rounds (with "
        "an explicit --sigma the run stops before exceeding it instead)."),
    delta: float | None = typer.Option(None, "--delta"),
    batch_size: int | None = typer.Option(None, "--batch-size"),
    local_steps: int | None = typer.Option(None, "--local-steps", help="Baselines: accesses "
                                           "per round (ALI-DPFL: the first tau)."),
    ldp_epsilon: float | None = typer.Option(None, "--ldp-epsilon", help="LDP-FL: epsilon of "
                                             "each weight per round."),
    preset: Preset | None = typer.Option(None, "--preset", help="The authors' values."),  # type: ignore[valid-type]
    schedule: ScheduleChoice = typer.Option("auto", "--schedule", help=SCHEDULE_HELP),  # type: ignore[valid-type]
    settings: list[str] = typer.Option([], "--set", help="Any configuration key, KEY=VALUE "
                                       "(repeatable), e.g. --set lr_local=0.1."),
    threat_model: ThreatModel | None = typer.Option(
        None, "--threat-model", help="Who epsilon holds against. server (default for record-"
        "level DP): the server sees whom it selected, no amplification by client sampling; "
        "hidden-selection: Theorem 5.8's q1 (adversaries who do not know who was selected); "
        "trusted-server: DP-NormFedAvg's only one (the server adds the noise)."
    ),
    reproducible_noise: bool = typer.Option(
        False, "--reproducible-noise", help="Derive the DP noise and sampling from --seed "
        "(bit-for-bit reproducible runs for research): the run is NOT private."
    ),
    canaries: int = typer.Option(
        0, "--canaries", help="Insert M >= 2 canaries, each with a secret coin, for the one-run "
        "audit of `audit` (white-box Dirac gradients for the DP-SGD-like methods, canary "
        "clients for dp-normfedavg, canary records otherwise; --set canary_kind=black-box)."),
    secure_aggregation: SecureNoise | None = typer.Option(  # type: ignore[valid-type]
        None, "--secure-aggregation", help="dp-fedavg-client without trusting the server: "
        "each client adds its share of skellam or discrete-gaussian noise to its encoded "
        "update, the server decodes only the sum (--sigma: the noise multiplier of the sum "
        "of the fewest honest shares). Epsilon against the server, outsiders' beside it."),
    bits: int | None = typer.Option(None, "--bits", help="With --secure-aggregation: bits "
                                    "of the modular sum (default: the fewest within 2% of "
                                    "central DP's noise for the model's size)."),
    min_survivors: int | None = typer.Option(
        None, "--min-survivors", help="With --secure-aggregation: a round with fewer uploads "
        "is not released (default: a fixed cohort's size; half the expected cohort under "
        "Poisson sampling)."),
    colluding: int | None = typer.Option(
        None, "--colluding", help="With --secure-aggregation: clients assumed to collude "
        "with the server (their noise shares are not counted)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda[:N]"),
    seed: int = typer.Option(0, "--seed", help="Public randomness only: initial weights and "
                             "the split (DP noise is secret unless --reproducible-noise)."),
    out: Path = typer.Option(Path("runs/latest"), "--out", help="Output directory."),
    resume: bool = typer.Option(
        False, "--resume", help="Continue the run in --out with its own settings (--rounds may "
        "raise the total; other flags must equal the recorded values). A run of your own "
        "--model FILE.py:FUNC needs that same --model: a recorded factory is never imported "
        "unless you name it."
    ),
    json_output: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    engine: Engine = typer.Option(
        Engine.simulation, "--engine", help="simulation: in-process; flower: a local Flower "
        "deployment (SuperLink + one SuperNode per client on 127.0.0.1; needs the flower "
        "extra); flower-simulation: the same Flower App on Flower's Simulation Engine (a "
        "virtual SuperNode per client on Ray, here or on --ray-address; needs the simulation "
        "extra)."
    ),
    client_cpus: float = typer.Option(
        1.0, "--client-cpus", help="flower-simulation: CPUs each virtual SuperNode holds while "
        "it trains (the clients run side by side on total CPUs / this)."),
    client_gpus: float = typer.Option(
        0.0, "--client-gpus", help="flower-simulation: GPUs each virtual SuperNode holds (0.25: "
        "four clients share a GPU; 0: the clients train on the CPU)."),
    ray_address: str | None = typer.Option(
        None, "--ray-address", help="flower-simulation: run the virtual SuperNodes on this Ray "
        "cluster (auto, HOST:6379 or ray://HOST:10001; every Ray node needs the simulation "
        "extra and the data); default: a Ray instance on this machine."),
    allow_client_failures: bool = typer.Option(
        False, "--allow-client-failures", help="Flower: continue a round with the clients that "
        "answer (default: a client that does not answer fails the run); privacy is still "
        "counted for every selected client."
    ),
    node_policy: Path | None = typer.Option(
        None, "--node-policy", help="Flower: a node policy TOML file given to every local "
        "SuperNode (allowed methods, minimum sigma, budget, ...; see docs/flower.md)."
    ),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch threads (default: "
        "OMP_NUM_THREADS, else usable CPUs / FEDLAP_WORKERS; at most the CPUs it may run on)."),
    dry_run: bool = typer.Option(False, "--dry-run", help=DRY_RUN_HELP),
) -> None:
    """Train federated; writes ckpt.pt, metrics.jsonl and plots into --out."""
    from fedlap_privacy.compute.threads import apply_cpu_policy

    guarded(lambda: apply_cpu_policy(threads))
    if engine is Engine.flower_simulation:  # resources checked before anything else
        _require_flower(engine)
        from fedlap_privacy.fl.flower.simulation_engine import SimulationResources

        guarded(lambda: SimulationResources(client_cpus, client_gpus, ray_address).validate())
    from fedlap_privacy.fl.config_resolve import resolve_config, resumed_config
    from fedlap_privacy.fl.engine.simulation import resume as resume_training
    from fedlap_privacy.fl.engine.simulation import train as start_training

    flags = {
        "method": None if method is None else method.value,
        **guarded(lambda: data_flags(dataset, data, model)),
        "data_dir": None if data_dir is None else str(data_dir),
        "split": split, "dirichlet_alpha": alpha, "clients": clients,
        "client_fraction": client_fraction, "clients_per_round": clients_per_round,
        "rounds": rounds, "delta": delta,
        "batch_size": batch_size, "target_eps": target_eps, "seed": seed, "sigma": sigma,
        "local_steps": local_steps, "ldp_epsilon": ldp_epsilon,
        "threat_model": None if threat_model is None else threat_model.value,
        "reproducible_noise": reproducible_noise or None,
        "canaries": canaries or None,
        "secure_aggregation": None if secure_aggregation is None else secure_aggregation.value,
        "secure_bits": bits, "min_survivors": min_survivors, "colluding": colluding,
    }
    if resume:  # the recorded configuration; a flag asking for another value is refused
        typed = _typed_flags(ctx, {**flags, "reproducible_noise": reproducible_noise,
                                   "canaries": canaries})
        cfg = guarded(lambda: resumed_config(
            out, typed, None if preset is None else preset.value, settings,
            schedule.value if _typed(ctx, "schedule") else "auto", rounds))
    else:
        cfg = guarded(lambda: resolve_config(None if preset is None else preset.value, flags,
                                             settings, schedule=schedule.value))
        guarded(lambda: check_writable(out, probe=not dry_run))
    if preset is None and not resume and not json_output:
        print_schedule(schedule.value, cfg)
    if engine is not Engine.simulation:
        _require_flower(engine)
    elif allow_client_failures or node_policy is not None:
        fail("--allow-client-failures and --node-policy apply to the Flower engines only")
    if engine is not Engine.flower_simulation and (
            _typed(ctx, "client_cpus") or _typed(ctx, "client_gpus") or ray_address):
        fail("--client-cpus, --client-gpus and --ray-address apply to --engine "
             "flower-simulation only")
    if dry_run:
        from fedlap_privacy.fl.engine.dry_run import plan_train

        if node_policy is not None and not node_policy.is_file():
            fail(f"--node-policy {node_policy}: no such file")
        plan = guarded(lambda: plan_train(None if resume else cfg, out, device, resume, rounds,
                                          model=model, download=download))
        if json_output:
            print_json(plan.to_json())
        else:
            print_train_plan(plan, engine.value, download)
        if plan.problems:
            raise typer.Exit(2)
        return

    if download:
        from fedlap_privacy.data.dataset_files import missing_downloads
        from fedlap_privacy.data.datasets import dataset_root, load_dataset

        fetch = missing_downloads(cfg.dataset, dataset_root(cfg.dataset, cfg.data_dir))
        if fetch:
            err_console.print(f"downloading {describe_downloads(fetch)}", highlight=False)
        guarded(lambda: load_dataset(cfg.dataset, cfg.data_dir, download=True))

    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), console=console, disable=json_output, transient=False,
    )
    task = progress.add_task("training", total=cfg.rounds, info="")

    def on_event(event: RunEvent) -> None:
        if isinstance(event, RunStarted):  # the bar shows from here: a refused run shows none
            progress.start()
            progress.update(task, completed=event.start_round - 1, total=event.config.rounds,
                            info=f"{event.config.method}  sigma={event.config.sigma}")
        elif isinstance(event, RunWarning):
            err_console.print(f"[bold yellow]warning:[/] {event.message}", highlight=False)
        elif isinstance(event, RoundEstimate) and event.long:
            err_console.print(
                f"[bold yellow]note:[/] one access takes {event.access_s:.1f} s on this "
                f"machine: a round (T = {event.accesses} accesses x {event.clients:g} "
                f"clients) will take about {duration(event.round_s)}, the run about "
                f"{duration(event.run_s)}", highlight=False)
        elif isinstance(event, ClientStep):
            who = (f"cohort of {event.clients} clients" if event.cohort else
                   f"client {event.position + 1}/{event.clients}")
            progress.update(task, info=(
                f"round {event.round}: {who} step {event.step}/{event.steps}, round ~"
                f"{duration(event.round_estimate_s)} ({duration(event.elapsed_s)} so far)"))
        elif isinstance(event, ClientDone):
            progress.update(task, info=f"round {event.round}: client {event.client} done")
        elif isinstance(event, RoundEnded):
            r = event.record
            progress.update(task, completed=r.round, info=(
                f"round {r.round}  acc {r.test_accuracy:.2%}  "
                + ("eps -" if r.epsilon is None else f"eps {r.epsilon:.2f}")))

    def run() -> Any:
        if engine is Engine.flower_simulation:
            from fedlap_privacy.fl.flower.simulation_engine import (
                SimulationResources,
                run_simulation_engine,
            )

            return run_simulation_engine(
                None if resume else cfg, out, device, on_event,
                resources=SimulationResources(client_cpus, client_gpus, ray_address),
                allow_client_failures=allow_client_failures, resume_run=resume, rounds=rounds,
                node_policy=node_policy, model=model,
            )
        if engine is Engine.flower:
            from fedlap_privacy.fl.engine.flower_app import run_flower

            return run_flower(
                None if resume else cfg, out, None, device, on_event,
                allow_client_failures=allow_client_failures, resume_run=resume, rounds=rounds,
                node_policy=node_policy, threads=threads, model=model,
            )
        if resume:
            return resume_training(out, rounds, device, on_event, model=model)
        return start_training(cfg, out, device, on_event, estimate=not json_output)

    # SIGTERM stops between rounds in-process (the Simulation Engine's ServerApp runs in this
    # process too); a Flower deployment's processes keep their own handling
    stopping = stop_between_rounds() if engine is not Engine.flower else nullcontext()
    try:
        with stopping:
            result = guarded(run)
    finally:
        progress.stop()
    if json_output:
        print_json(result.summary.to_json())
    else:
        _print_summary(result.summary, result.history)
    if result.summary.stopped == STOPPED:
        raise typer.Exit(STOP_EXIT_CODE)


def _typed(ctx: typer.Context, param: str) -> bool:
    """Whether the user typed the option ``param`` (rather than leaving its default). By the
    source's name: typer >= 0.29 carries its own copy of click's ``ParameterSource``."""
    source = ctx.get_parameter_source(param)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def _typed_flags(ctx: typer.Context, values: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """The configuration flags the user typed, but --rounds (it may change on --resume):
    "--flag" -> (configuration key, value)."""
    params = {key: {"dirichlet_alpha": "alpha", "secure_bits": "bits"}.get(key, key)
              for key in values}
    return {f"--{params[key].replace('_', '-')}": (key, value) for key, value in values.items()
            if key != "rounds" and _typed(ctx, params[key])}


def _require_flower(engine: Engine) -> None:
    """One line, no traceback, when the optional Flower extra (or, for the Simulation
    Engine, the simulation extra: Ray) is missing (``\\[``: rich)."""
    import importlib.util

    try:
        import flwr  # noqa: F401
    except ImportError:
        extra = "simulation" if engine is Engine.flower_simulation else "flower"
        fail(f"--engine {engine.value} needs Flower: pip install '.\\[{extra}]' in a clone of "
             "fedlap-privacy")
    if engine is Engine.flower_simulation and importlib.util.find_spec("ray") is None:
        fail("--engine flower-simulation needs Flower's Simulation Engine (Ray): pip install "
             "'.\\[simulation]' in a clone of fedlap-privacy")


def _print_summary(summary: RunSummary, history: list[RoundRecord]) -> None:
    table = FoldingTable(title=f"{summary.method} on {summary.dataset}")
    for col in ("round", "test acc", "epsilon", "accesses", "clients", "upload", "seconds"):
        table.add_column(col, justify="right")
    for h in history:
        table.add_row(
            str(h.round), f"{h.test_accuracy:.2%}",
            "-" if h.epsilon is None else f"{h.epsilon:.3f}",
            "-" if h.accesses is None else str(h.accesses),
            "-" if h.clients is None else str(h.clients),
            human_bytes(h.upload_bytes or 0),
            "-" if h.seconds is None else f"{h.seconds:.1f}",
        )
    console.print(table)
    console.print(privacy_sentence(summary.privacy, summary.sigma_planned))
    if summary.upload_bytes_mean is not None:
        console.print(f"Upload per client-round {human_bytes(summary.upload_bytes_mean)}, "
                      f"{human_bytes(summary.upload_bytes_total)} in all.")
    acc = summary.test_accuracy
    console.print(
        f"[bold]{summary.rounds_run} rounds[/], test accuracy "
        f"[bold]{'-' if acc is None else f'{acc:.2%}'}[/]. "
        f"Stopped: {summary.stopped}. Output: {summary.out}"
    )
