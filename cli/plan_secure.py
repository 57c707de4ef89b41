"""``fedlap-privacy plan --secure-aggregation NOISE``: the local noise each client adds for
client-level DP-FedAvg over secure aggregation, planned against the server
(:func:`fedlap_privacy.accountant.distributed.plan_distributed`). Thin: check the flags,
call, print."""

from __future__ import annotations

from fedlap_privacy.cli.common import FoldingTable, console, fail, guarded, print_json


def plan_secure(noise: str, *, eps: float | None, delta: float, rounds: int | None,
                model_size: int | None, clients: int | None, bits: int,
                sigma: float | None, json_output: bool, min_survivors: int | None = None,
                colluding: int = 0) -> None:
    """Plan the distributed noise for ``(eps, delta)`` and print it (one line and exit 2 on a
    missing or conflicting flag)."""
    from fedlap_privacy.accountant.distributed import plan_distributed

    missing = [flag for flag, value in (("--eps", eps), ("--rounds", rounds),
                                        ("--model-size", model_size),
                                        ("--clients-per-round", clients)) if value is None]
    if missing:
        fail(f"--secure-aggregation plans the local noise for a target: give {', '.join(missing)}")
    if sigma is not None:
        fail("--secure-aggregation plans the noise itself: drop --sigma")
    assert eps is not None and rounds is not None and model_size is not None
    assert clients is not None
    plan = guarded(lambda: plan_distributed(noise, epsilon=eps, delta=delta,
                                            model_size=model_size, clients=clients,
                                            rounds=rounds, bits=bits,
                                            min_survivors=min_survivors, colluding=colluding))
    q = plan.mechanism.quantisation
    record = {
        "mechanism": plan.mechanism.noise.value, "threat_model": "server",
        "bits": plan.bits, "modulus": plan.modulus, "model_size": plan.model_size,
        "padded_dimension": q.dim, "clients_per_round": plan.clients, "rounds": plan.rounds,
        "min_survivors": plan.min_survivors, "colluding": plan.colluding,
        "clip": q.clip, "grid_step": q.gamma, "rounding_bias": q.beta,
        "local_noise_std": plan.local_sigma, "local_noise_grid_units": plan.mechanism.local_std,
        "noise_multiplier": plan.noise_multiplier, "central_noise_multiplier": plan.central_sigma,
        "ratio_to_central": plan.ratio, "epsilon": plan.epsilon, "delta": plan.delta,
        "target_epsilon": eps,
    }
    if json_output:
        print_json(record)
        return
    table = FoldingTable(title=f"Distributed DP plan ({record['mechanism']} over secure "
                         "aggregation)", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("threat model", "server: it sees only the sum and knows whom it selected (no "
                         f"amplification); a round counts as few as {plan.min_survivors} "
                         f"shares, {plan.colluding} of them colluding"),
        ("model size (padded)", f"{plan.model_size:,} ({q.dim:,})"),
        ("clients per round", f"{plan.clients}"),
        ("participations of a client", f"{plan.rounds} (every round, conservatively)"),
        ("bits (modulus)", f"{plan.bits} (2^{plan.bits})"),
        ("grid step gamma", f"{q.gamma:.4g}"),
        ("each client's noise std", f"{plan.local_sigma:.4g} ({plan.mechanism.local_std:.4g} "
                                    "grid units)"),
        ("noise multiplier of the sum", f"{plan.noise_multiplier:.5g}"),
        ("central Gaussian's, same epsilon", f"{plan.central_sigma:.5g}"),
        ("price of not trusting the server", f"x{plan.ratio:.4f}"),
        ("delta", f"{plan.delta:g}"),
        ("epsilon against the server", f"{plan.epsilon:.4f} (target {eps:g})"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
