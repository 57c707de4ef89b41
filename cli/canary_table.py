"""The table of one-run canary audits, shared by ``audit --model`` and ``audit
--canary-scores``."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from fedlap_privacy.cli.common import console

__all__ = ["render_one_run"]


def _fmt(value: Any, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def render_one_run(one_run: dict[str, Any]) -> None:
    """The canary audits: every method's bound (or p-value), ceiling and verdict per audit."""
    table = Table(title=f"one-run canary audits ({one_run['kind']} canaries)")
    for column in ("audit", "canaries", "guesses", "correct", "Steinke LB", "ceiling",
                   "f-DP LB", "ceiling", "claim-curve p", "level", "claimed", "verdict"):
        table.add_column(column, justify="left" if column in ("audit", "verdict") else "right")
    colour = {"violation": "bold red", "consistent": "green", "inconclusive": "yellow"}
    for a in one_run["audits"]:
        estimate = a.get("epsilon_estimate")
        gdp = a.get("gdp_estimate")
        name = a["audit"] + ("" if estimate is None else
                             f" (estimate eps {estimate['epsilon']:.2f})") + (
            "" if gdp is None else f" (GDP estimate eps {gdp['epsilon']:.2f}, not a bound)")
        methods = a.get("methods", {})
        steinke = methods.get("steinke", a)
        fdp = methods.get("fdp")
        curve = methods.get("claim-curve")
        fdp_cells = ("-", "-") if fdp is None else (
            _fmt(fdp["epsilon_lower_bound"]) + ("" if fdp["valid"] else "*"),
            _fmt(fdp["ceiling"]))
        table.add_row(
            name, str(steinke["canaries"]), str(steinke["guesses"]), str(steinke["correct"]),
            _fmt(steinke["epsilon_lower_bound"]), _fmt(steinke["ceiling"]), *fdp_cells,
            "-" if curve is None else f"{curve['p_value']:.2g}",
            "-" if steinke.get("level") is None else f"{steinke['level']:.2g}",
            _fmt(a["claimed_epsilon"]),
            f"[{colour[a['verdict']]}]{a['verdict']}[/] ({a.get('verdict_method', 'steinke')})",
        )
    console.print(table)
    for a in one_run["audits"]:
        if a.get("reason"):
            console.print(f"{a['audit']}: {a['verdict']}: {a['reason']}", highlight=False,
                          markup=False)
    for a in one_run["audits"]:
        if a.get("epsilon_estimate_skipped"):
            console.print(f"{a['audit']}: no epsilon estimate (the bounds do not need it): "
                          f"{a['epsilon_estimate_skipped']}", highlight=False)
    console.print(
        "Steinke LB: Steinke-Nasr-Jagielski one-run bound; f-DP LB: Mahloujifar-Melis-"
        "Chaudhuri bound of the Gaussian trade-off family (* : the claimed mechanism is not "
        "that Gaussian-private, so its verdict does not count); claim-curve p: p-value of the "
        "counts under the ledger's own trade-off curve; level: each test's share of the "
        "family's level (a p-value below it, or a bound above the claim, is a violation); "
        "ceiling: the largest bound a perfect score reaches with the coins drawn; "
        "inconclusive: the claim is above every ceiling; verdict: a violation of any test, "
        "else consistent where one could have refuted the claim (its method)",
        highlight=False)
