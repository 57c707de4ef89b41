"""``fedlap-privacy plan``: epsilon of a FedLAP-DP run, or sigma / rounds for a target."""

from __future__ import annotations

import typer

from fedlap_privacy.accountant import AccountantName, accountant_names
from fedlap_privacy.accountant.distributed import DistributedNoise
from fedlap_privacy.accountant.report import PLAN_THREAT_MODELS, PrivacyPlan
from fedlap_privacy.cli.common import (
    FoldingTable,
    choice_enum,
    console,
    err_console,
    fail,
    guarded,
    print_json,
)
from fedlap_privacy.cli.plan_secure import plan_secure
from fedlap_privacy.vocabulary import LARGE_EPSILON, ThreatModel, words

Accountant = choice_enum("Accountant", accountant_names())
PlanThreatModel = choice_enum("PlanThreatModel", PLAN_THREAT_MODELS)
SecureNoise = choice_enum("SecureNoise", words(DistributedNoise))


def _parse_orders(text: str | None):
    from fedlap_privacy.accountant import EXTENDED_ORDERS

    if text is None or text == "default":
        return None
    if text == "extended":
        return EXTENDED_ORDERS
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        fail(f"--orders {text!r} must be 'default', 'extended' or comma-separated numbers > 1")


def plan(
    eps: float | None = typer.Option(None, "--eps", help="Target epsilon."),
    delta: float = typer.Option(1e-5, "--delta", help="Target delta."),
    sigma: float | None = typer.Option(None, "--sigma", help="Noise multiplier."),
    rounds: int | None = typer.Option(None, "--rounds", help="Number of rounds M."),
    batch_size: float = typer.Option(256, "--batch-size", help="Expected batch size B."),
    client_size: int = typer.Option(10000, "--client-size", help="Smallest client dataset."),
    client_fraction: float = typer.Option(1.0, "--client-fraction", help="Clients per round."),
    local_steps: int = typer.Option(200, "--local-steps", help="Accesses per client-round T."),
    accountant: Accountant = typer.Option(  # type: ignore[valid-type]
        AccountantName.RDP.value, "--accountant"),
    threat_model: PlanThreatModel = typer.Option(  # type: ignore[valid-type]
        ThreatModel.SERVER.value, "--threat-model",
        help="server (default, as train's): against the server, which knows whom it "
        "selected (no amplification by client sampling). hidden-selection: Theorem 5.8 as "
        "published (q1 amplified by client sampling; holds only against parties who do not "
        "know who was selected). Equal at client fraction 1."
    ),
    orders: str | None = typer.Option(None, "--orders", help="default | extended | a,b,c"),
    secure_aggregation: SecureNoise | None = typer.Option(  # type: ignore[valid-type]
        None, "--secure-aggregation",
        help="Plan client-level DP-FedAvg over secure aggregation instead: the noise share "
        "each client adds (skellam or discrete-gaussian) for --eps over --rounds, against the "
        "server. Needs --model-size and --clients-per-round."),
    model_size: int | None = typer.Option(None, "--model-size",
                                          help="With --secure-aggregation: parameters."),
    clients_per_round: int | None = typer.Option(
        None, "--clients-per-round", help="With --secure-aggregation: clients in each sum."),
    bits: int = typer.Option(20, "--bits",
                             help="With --secure-aggregation: bits of the modular sum."),
    min_survivors: int | None = typer.Option(
        None, "--min-survivors", help="With --secure-aggregation: the fewest shares a round "
        "is released with (default: every client of the round)."),
    colluding: int = typer.Option(0, "--colluding", help="With --secure-aggregation: clients "
                                  "colluding with the server (their shares do not count)."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Epsilon after each round, or plan sigma / rounds for a target (Theorem 5.8).

    Defaults are the authors' CIFAR-10 DP configuration (B 256, 10,000 records per client,
    T = 4 x 5 x 10 accesses per round, sigma 1, 30 rounds).
    """
    if secure_aggregation is not None:
        plan_secure(secure_aggregation.value, eps=eps, delta=delta, rounds=rounds,
                    model_size=model_size, clients=clients_per_round, bits=bits, sigma=sigma,
                    json_output=json_output, min_survivors=min_survivors,
                    colluding=colluding)
        return
    if min_survivors is not None or colluding:
        fail("--min-survivors and --colluding go with --secure-aggregation")
    from fedlap_privacy.accountant import FedLAPSchedule
    from fedlap_privacy.accountant.report import privacy_plan

    def run() -> PrivacyPlan:
        schedule = FedLAPSchedule(
            batch_size=batch_size,
            client_size=client_size,
            local_steps=local_steps,
            client_fraction=client_fraction,
        )
        return privacy_plan(
            schedule, delta, eps=eps, sigma=sigma, rounds=rounds,
            accountant=accountant.value, orders=_parse_orders(orders),
            threat_model=threat_model.value,
        )

    result = guarded(run)
    note = _large_epsilon_note(result)
    if json_output:
        print_json({**result.to_json(), "warnings": [] if note is None else [note]})
    else:
        _print_table(result)
        if note is not None:
            err_console.print(f"[bold yellow]warning:[/] {note}", highlight=False)
    if result.rounds == 0:
        fail(
            f"even one round exceeds epsilon {result.target_epsilon} at sigma "
            f"{result.sigma:g}: raise sigma, lower the sampling rate or the local steps",
            code=1,
        )


def _large_epsilon_note(r: PrivacyPlan) -> str | None:
    """The plan's :meth:`~PrivacyPlan.large_epsilon_reason` with the flags that lower it."""
    why = r.large_epsilon_reason()
    if why is None:
        return None
    target = "a smaller --eps" if r.target_epsilon is not None else "--eps E (sigma planned for it)"
    return (f"epsilon {r.epsilon:.1f} after {r.rounds} rounds is above the usual range "
            f"(at most about {LARGE_EPSILON:g}) and promises little: {why}. To lower it: a "
            f"larger --sigma, fewer --rounds or --local-steps, a smaller --batch-size or a "
            f"larger --client-size, or {target}")


def _print_table(r: PrivacyPlan) -> None:
    table = FoldingTable(title=f"FedLAP-DP privacy plan ({r.accountant.upper()})",
                         show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("batch size B", f"{r.batch_size:g}"),
        ("client size min N_k", f"{r.client_size}"),
        ("client fraction C", f"{r.client_fraction:g}"),
        ("accesses per round T", f"{r.local_steps}"),
        ("threat model", r.threat_model + (
            " (Theorem 5.8: not against the server, unlike train's default)"
            if r.threat_model == ThreatModel.HIDDEN_SELECTION and r.client_fraction < 1
            else " (as train: the server knows whom it selected)"
            if r.threat_model == ThreatModel.SERVER else "")),
        ("q1 (first access)", f"{r.q1:.6g}"),
        ("q2 (later accesses)", f"{r.q2:.6g}"),
        ("delta", f"{r.delta:g}"),
        ("sigma" + (" (planned)" if r.mode == "plan-sigma" else ""), f"{r.sigma:.6g}"),
        ("rounds" + (" (planned)" if r.mode == "plan-rounds" else ""), f"{r.rounds}"),
        ("epsilon after the last round", f"{r.epsilon:.4f}"),
    ]
    for name, value in r.epsilon_by_accountant.items():
        if name != r.accountant:
            rows.append((f"  same sigma and rounds, {name.upper()}", "cannot price it" if value
                         is None else f"{value:.4f}"))
    if r.order is not None:
        rows.append(("best RDP order", f"{r.order:g}"))
    if r.target_epsilon is not None:
        verdict = "[green]holds[/]" if r.within_budget else "[red]exceeded[/]"
        rows.append((f"target epsilon {r.target_epsilon:g}", verdict))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if r.curve:
        curve = FoldingTable(title="epsilon after each round")
        for _ in range(3):
            curve.add_column("round", justify="right")
            curve.add_column("epsilon", justify="right")
        cells = [(str(i + 1), f"{e:.4f}") for i, e in enumerate(r.curve)]
        height = -(-len(cells) // 3)
        for row in range(height):
            line: list[str] = []
            for col in range(3):
                i = col * height + row
                line += list(cells[i]) if i < len(cells) else ["", ""]
            curve.add_row(*line)
        console.print(curve)
