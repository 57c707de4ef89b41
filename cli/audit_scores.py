"""``fedlap-privacy audit --canary-scores FILE.npz``: the one-run audit of canary scores from
any framework (docs/auditing.md). Thin: read the file
(:mod:`fedlap_privacy.audit.canaries.score_file`),
call :func:`fedlap_privacy.audit.canaries.score_audit.audit_canary_scores`, print."""

from __future__ import annotations

from pathlib import Path

import typer

from fedlap_privacy.cli.canary_table import render_one_run
from fedlap_privacy.cli.common import check_writable, console, fail, guarded, print_json

__all__ = ["audit_scores_command"]


def audit_scores_command(
    path: Path,
    claimed_eps: float | None,
    delta: float | None,
    out: Path | None,
    json_output: bool,
    fail_on_violation: bool,
    mechanism: tuple[float | None, float | None, int | None],
    dry_run: bool = False,
) -> None:
    """Audit the claim ``(claimed_eps, delta)`` from the scores in ``path``; exit 1 on a
    violation with ``fail_on_violation``, 2 (one line) on bad input. ``dry_run``: check the
    flags and the file, say what would be audited, write nothing."""
    from fedlap_privacy.audit.canaries.score_audit import (
        MIN_CANARIES,
        ClaimedMechanism,
        audit_canary_scores,
        check_claim,
    )
    from fedlap_privacy.audit.canaries.score_file import load_score_file

    if claimed_eps is None or delta is None:
        fail("--canary-scores needs the claim it tests: --claimed-eps E and --delta D")
    given = [v is not None for v in mechanism]
    if any(given) and not all(given):
        fail("the claimed mechanism needs all of --noise-multiplier, --sample-rate and --steps")
    claimed = None
    if all(given):
        sigma, q, steps = mechanism
        claimed = guarded(lambda: ClaimedMechanism(sigma, q, steps).validate())  # type: ignore[arg-type]
    if out is not None:
        from fedlap_privacy.audit.reports.report_folder import check_report_folder

        guarded(lambda: check_writable(out, probe=not dry_run))
        guarded(lambda: check_report_folder(out))
    scores, included = guarded(lambda: load_score_file(path))
    if dry_run:
        guarded(lambda: check_claim(claimed_eps, delta, 0.95))
        if len(scores) < MIN_CANARIES:
            fail(f"the audit needs at least {MIN_CANARIES} canaries, got {len(scores)}")
        plan = {"dry_run": True, "canary_scores": str(path), "canaries": len(scores),
                "claimed_epsilon": claimed_eps, "delta": delta,
                "mechanism": None if claimed is None else claimed.to_json(),
                "out": None if out is None else str(out)}
        if json_output:
            print_json(plan)
        else:
            console.print(f"[bold]dry run[/]: nothing audited, nothing written; would audit "
                          f"{len(scores):,} canary scores from {path} against epsilon "
                          f"{claimed_eps:g} at delta {delta:g}"
                          + ("" if claimed is None else " and the claimed mechanism's curve")
                          + ("" if out is None else f", report into {out}"), highlight=False)
        return
    result = guarded(lambda: audit_canary_scores(
        scores, included, claimed_epsilon=claimed_eps, delta=delta, mechanism=claimed,
        out=out, title=f"the canary scores in {path.name}"))
    if json_output:
        print_json(result.to_json())
    else:
        render_one_run(result.to_json()["one_run"])
        colour = {"violation": "bold red", "consistent": "green", "inconclusive": "yellow"}
        console.print(
            f"[{colour[result.verdict]}]{result.verdict}[/]: epsilon lower bound "
            f"{result.epsilon_lower_bound:.3f} against the claim {claimed_eps:g} at delta "
            f"{delta:g} (family-wise {result.confidence:.0%}); "
            f"{result.strongest.reason}"
            + ("" if result.mechanism_epsilon is None else
               f"; the claimed mechanism is ({result.mechanism_epsilon:.3f}, {delta:g})-DP"),
            highlight=False)
        if out is not None:
            console.print(f"wrote {out / 'report.json'}, {out / 'scores.png'} and the readable "
                          f"report {out / 'report.md'} / {out / 'report.html'}",
                          highlight=False)
    if fail_on_violation and result.violation:
        raise typer.Exit(1)
