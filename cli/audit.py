"""``fedlap-privacy audit --model ckpt.pt``: membership-inference and canary audits (docs/audit.md).

Thin: parse flags, call :func:`fedlap_privacy.audit.inference.report.run_audit`, print. torch (and
the audit package) is imported inside the command, so other sub-commands start without it. With
``--reference-models N`` it first has :mod:`fedlap_privacy.fl.auditing.reference_models` train (or
reuse) N reference models beside the run, without the records the audit scores, and hands
them to the audit (RMIA and LiRA scores).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from fedlap_privacy.cli.canary_table import render_one_run
from fedlap_privacy.cli.common import (
    DRY_RUN_HELP,
    check_writable,
    console,
    fail,
    guarded,
    human_seconds,
    print_json,
)

if TYPE_CHECKING:
    from fedlap_privacy.audit.reports.results import AuditReport

__all__ = ["audit", "render_one_run", "render_report"]


def _fmt(value: Any, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def render_report(report: dict[str, Any]) -> None:
    """A rich table of the metrics per attack, the accountant's promise, the verdict."""
    sets = report["sets"]
    table = Table(
        title=(
            f"membership inference: {report['dataset']['name']}, audit half "
            f"{sets['per_half']} members + {sets['per_half']} non-members"
        )
    )
    for column in ("feature", "attack", "AUC", "TPR@0.1%FPR", "TPR@1%FPR", "bal. acc", "eps LB"):
        table.add_column(column, justify="left" if column in ("feature", "attack") else "right")
    tested = report["privacy"]["epsilon_tested"]
    for feature, by_model in report["attacks"].items():
        for kind, m in by_model.items():
            eps_lb = _fmt(m["eps_lb"])
            if tested is not None and m["eps_lb"] > tested:
                eps_lb = f"[bold red]{eps_lb}[/]"
            table.add_row(
                feature,
                kind,
                _fmt(m["auc"]),
                _fmt(m["tpr_at_fpr_0.001"]),
                _fmt(m["tpr_at_fpr_0.01"]),
                _fmt(m["balanced_accuracy"]),
                eps_lb,
            )
    console.print(table)
    privacy = report["privacy"]
    delta = privacy["delta"]
    console.print(
        f"accountant: epsilon = {_fmt(privacy['epsilon'])}"
        f"{'' if delta is None else f', delta = {delta:.3g}'} "
        f"({privacy['notion']}, {privacy['accountant'] or 'no accountant'}); "
        f"tested for a record: "
        + (
            "nothing"
            if tested is None
            else f"epsilon {tested:.3f}, delta {privacy['delta_tested']:.3g}"
        )
        + f" -- {privacy['basis']}",
        highlight=False,
    )
    console.print(
        f"max epsilon lower bound {report['max_eps_lb']:.3f} ({report['max_eps_lb_attack']}; "
        f"Clopper-Pearson, family-wise {report['confidence']:.0%}); balanced accuracy at "
        "the best audit threshold",
        highlight=False,
    )
    references = report.get("reference_models")
    if references:
        rmia = references["rmia"]
        console.print(
            f"reference models: {references['count']} ({', '.join(references['models'])}), "
            f"offline; RMIA a = {rmia['a']:g} ({'tuned' if rmia['a_tuned'] else 'default'}), "
            f"gamma = {rmia['gamma']:g}, population {references['population_records']} records; "
            f"LiRA variance: {references['lira']['variance']}",
            highlight=False,
        )
    one_run = report.get("one_run")
    if one_run:
        render_one_run(one_run)
    if report["violation"]:
        console.print(
            f"[bold red]VIOLATION: the empirical lower bound {report['max_eps_lb']:.3f} exceeds "
            f"the promised epsilon {tested:.3f} -- the DP implementation or its accounting "
            "is wrong[/]"
        )


def _pair(text: str | None) -> tuple[float, float] | None:
    """``"0.1307,0.3081"`` -> (mean, std)."""
    if text is None:
        return None
    try:
        mean, std = (float(v) for v in text.split(","))
    except ValueError:
        fail(f"--normalise {text!r}: expected MEAN,STD, e.g. 0.1307,0.3081")
    if not std > 0:
        fail(f"--normalise {text!r}: STD must be > 0")
    return mean, std


def audit(
    model: Annotated[Path | None, typer.Option("--model", help=(
        "checkpoint written by train; with --members / --nonmembers: an exported program "
        "(.pt2, read without unpickling or running anything from it), a TorchScript module "
        "(loading TorchScript runs the file's code: only audit TorchScript files you trust), "
        "or a state dict with --model-factory"))] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option("--data-dir", help="dataset folder (default: the checkpoint's)"),
    ] = None,
    attacks: Annotated[
        str, typer.Option("--attacks", help="comma-separated features: loss, grad-norm")
    ] = "loss,grad-norm",
    out: Annotated[
        Path | None, typer.Option("--out", help="folder for report.json and roc.png")
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="print the report as one JSON object")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="seed of the member/non-member draw")] = 0,
    max_per_half: Annotated[
        int | None,
        typer.Option("--max-per-half", help="cap on each of the four record sets (speed)"),
    ] = None,
    fail_on_violation: Annotated[
        bool, typer.Option("--fail-on-violation",
                           help="exit with status 1 when an audit finds a violation")
    ] = False,
    reference_models: Annotated[
        int, typer.Option("--reference-models", min=0, help=(
            "add RMIA and LiRA (offline) with N reference models trained like the run, "
            "without the audited records, in <run>/reference/ (cached; each costs one full "
            "training; 1-4 is typical)"))
    ] = 0,
    members: Annotated[str | None, typer.Option("--members", help=(
        "a model trained elsewhere: its training records, an .npz (x, y) or IMAGES,LABELS "
        "IDX files"))] = None,
    nonmembers: Annotated[str | None, typer.Option("--nonmembers", help=(
        "records the model never saw (same formats)"))] = None,
    model_factory: Annotated[str | None, typer.Option("--model-factory", help=(
        "module:function or file.py:function building the model a state dict fills "
        "(your code: it is imported); for a run's ckpt.pt of a model built by your factory, "
        "that factory (a factory recorded in ckpt.pt is never imported unless named here)"))
    ] = None,
    claimed_eps: Annotated[float | None, typer.Option("--claimed-eps", help=(
        "a model trained elsewhere: the epsilon its owner promises"))] = None,
    delta: Annotated[float | None, typer.Option("--delta", help=(
        "the delta of --claimed-eps (default 1e-5)"))] = None,
    normalise: Annotated[str | None, typer.Option("--normalise", help=(
        "IDX records: MEAN,STD applied after scaling pixels to [0, 1]"))] = None,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help=(
        "torch threads (default: OMP_NUM_THREADS, else usable CPUs / FEDLAP_WORKERS; at "
        "most the CPUs it may run on)."))] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help=DRY_RUN_HELP)] = False,
    canary_scores: Annotated[Path | None, typer.Option("--canary-scores", help=(
        "instead of --model: an .npz with 'scores' (one float per canary, higher = more "
        "likely included) and 'included' (the secret bits) from a training run anywhere "
        "(JAX, TensorFlow, ...); needs --claimed-eps and --delta"))] = None,
    noise_multiplier: Annotated[float | None, typer.Option("--noise-multiplier", help=(
        "--canary-scores: the claimed mechanism's noise multiplier (with --sample-rate and "
        "--steps: the claim-curve test)"))] = None,
    sample_rate: Annotated[float | None, typer.Option("--sample-rate", help=(
        "--canary-scores: the claimed Poisson sample rate"))] = None,
    steps: Annotated[int | None, typer.Option("--steps", help=(
        "--canary-scores: the claimed number of noisy steps"))] = None,
) -> None:
    """Membership-inference audit: attack a model's training records, bound epsilon.

    A checkpoint written by train is audited with its run's members and ledger (and
    canaries); any other model with --members / --nonmembers; canary scores from any
    training with --canary-scores."""
    from fedlap_privacy.cli.audit_scores import audit_scores_command

    if canary_scores is not None:
        others = {"--model": model, "--members": members, "--nonmembers": nonmembers,
                  "--model-factory": model_factory, "--data-dir": data_dir,
                  "--normalise": normalise, "--max-per-half": max_per_half}
        given = [flag for flag, value in others.items() if value is not None]
        given += ["--reference-models"] * bool(reference_models)
        if given:
            fail(f"--canary-scores audits a score file alone; drop {', '.join(given)}")
        audit_scores_command(canary_scores, claimed_eps, delta, out, json_output,
                             fail_on_violation, (noise_multiplier, sample_rate, steps), dry_run)
        return
    if noise_multiplier is not None or sample_rate is not None or steps is not None:
        fail("--noise-multiplier, --sample-rate and --steps describe the claim of "
             "--canary-scores")
    if model is None:
        fail("give --model (a checkpoint or a model trained elsewhere) or --canary-scores FILE")

    from fedlap_privacy.compute.threads import apply_cpu_policy

    guarded(lambda: apply_cpu_policy(threads))
    if out is not None:
        from fedlap_privacy.audit.reports.report_folder import check_report_folder

        guarded(lambda: check_writable(out, probe=not dry_run))
        guarded(lambda: check_report_folder(out))

    external = members is not None or nonmembers is not None

    def run_external() -> AuditReport:
        from fedlap_privacy.audit.inference.external import audit_model_files
        from fedlap_privacy.audit.inference.report import parse_attacks

        if members is None or nonmembers is None or reference_models:
            fail("a model trained elsewhere needs both --members and --nonmembers (and no "
                 "--reference-models)")
        return audit_model_files(
            model, members, nonmembers, factory=model_factory, normalise=_pair(normalise),
            claimed_epsilon=claimed_eps, delta=delta, attacks=parse_attacks(attacks),
            seed=seed, max_per_half=max_per_half, out_dir=out,
        )

    def run() -> AuditReport:
        from fedlap_privacy.audit.inference.reference_audit import ReferenceModel
        from fedlap_privacy.audit.inference.report import audited_records, parse_attacks, run_audit

        if external:
            return run_external()
        if claimed_eps is not None or delta is not None or normalise:
            fail("--claimed-eps, --delta and --normalise apply to a model "
                 "trained elsewhere (--members / --nonmembers); a checkpoint's claim comes "
                 "from its ledger")
        names = parse_attacks(attacks)  # fail on a bad name before any heavy work
        references = []
        if reference_models:
            from fedlap_privacy.fl.auditing.reference_models import (
                load_reference_models,
                train_reference_models,
            )

            audited = audited_records(model, data_dir, seed, max_per_half, model_factory)
            paths = train_reference_models(model.parent, reference_models, audited,
                                           data_dir=data_dir, factory=model_factory)
            references = [ReferenceModel(r.model, r.trained_on, str(r.path))
                          for r in load_reference_models(paths, model_factory)]
        return run_audit(
            model,
            data_dir=data_dir,
            attacks=names,
            seed=seed,
            out_dir=out,
            max_per_half=max_per_half,
            reference_models=references,
            factory=model_factory,
        )

    if dry_run:
        _dry_run(model, data_dir, attacks, seed, max_per_half, reference_models, members,
                 nonmembers, model_factory, claimed_eps, delta, normalise, out, json_output)
        return
    if json_output:
        report = guarded(run).to_json()
        print_json(report)
    else:
        doing = (f"training or loading {reference_models} reference model(s), then auditing"
                 if reference_models else "auditing (per-record losses and gradient norms)")
        with console.status(f"{doing}..."):
            report = guarded(run).to_json()
        render_report(report)
        if out is not None:
            console.print(f"wrote {out / 'report.json'}, {out / 'roc.png'} and the readable "
                          f"report {out / 'report.md'} / {out / 'report.html'}", highlight=False)
    if fail_on_violation and report["violation"]:
        raise typer.Exit(1)


def _dry_run(model: Path, data_dir: Path | None, attacks: str, seed: int,
             max_per_half: int | None, reference_models: int, members: str | None,
             nonmembers: str | None, model_factory: str | None, claimed_eps: float | None,
             delta: float | None, normalise: str | None, out: Path | None,
             json_output: bool) -> None:
    """``audit --dry-run``: the plan (fedlap_privacy.audit.reports.dry_run), printed."""
    from fedlap_privacy.audit.reports.dry_run import plan_audit, plan_external_audit
    from fedlap_privacy.fl.engine.dry_run import cached_reference_models

    if members is not None or nonmembers is not None:
        if members is None or nonmembers is None or reference_models:
            fail("a model trained elsewhere needs both --members and --nonmembers (and no "
                 "--reference-models)")
        _pair(normalise)
        plan = guarded(lambda: plan_external_audit(
            model, members, nonmembers, model_factory, claimed_eps, delta, attacks,
            max_per_half, out))
        cached = 0
    else:
        if claimed_eps is not None or delta is not None or normalise:
            fail("--claimed-eps, --delta and --normalise apply to a model "
                 "trained elsewhere (--members / --nonmembers)")
        plan = guarded(lambda: plan_audit(model, data_dir, attacks, seed, max_per_half, out,
                                          model_factory))
        cached = cached_reference_models(model.parent, reference_models)
    if json_output:
        print_json({**plan.to_json(), "reference_models": reference_models,
                    "reference_models_cached": cached})
        return
    claim = plan.claim
    tested = claim["epsilon_tested"]
    console.print("[bold]dry run[/]: nothing audited, nothing written", highlight=False)
    console.print(f"model: {plan.source}; records: {plan.records}", highlight=False)
    sets = ("drawn from the files" if plan.per_half is None else
            f"{plan.per_half:,} records in each of the four sets (attack and audit halves)")
    console.print(f"attacks: {', '.join(plan.attacks)} (MLP and threshold), {sets}"
                  + ("; one-run canary audits" if plan.canaries else ""), highlight=False)
    console.print("tests: " + ("nothing (no record-level claim)" if tested is None else
                               f"epsilon {tested:.3f}, delta {claim['delta_tested']:.3g}")
                  + f" -- {claim['basis']}", highlight=False)
    if reference_models:
        console.print(f"reference models: {reference_models} ({cached} trained already; each "
                      "other one is a full training of the run's configuration)",
                      highlight=False)
    console.print(f"time: about {human_seconds(plan.seconds)} for the features (timed on "
                  "random records of the model's input shape)"
                  if plan.seconds is not None else "time: not estimated (the model is loaded "
                  "only by the audit itself)", highlight=False)
    console.print("would write: " + ("nothing (no --out)" if plan.out is None else
                                     f"{plan.out} (report.json, roc.png)"), highlight=False)
