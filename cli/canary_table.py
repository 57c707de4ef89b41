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
                   "f-DP LB", "ceiling", "claim-curve p", "claimed", "verdict"):
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
            "-" if curve is None else f"{curve['p_value']:.2g}", _fmt(a["claimed_epsilon"]),
            f"[{colour[a['verdict']]}]{a['verdict']}[/] ({a.get('verdict_method', 'steinke')})",
        )
    console.print(table)
    console.print(
        "Steinke LB: Steinke-Nasr-Jagielski one-run bound; f-DP LB: Mahloujifar-Melis-"
        "Chaudhuri bound of the Gaussian trade-off family (* : the claimed mechanism is not "
        "that Gaussian-private, so its verdict does not count); claim-curve p: p-value of the "
        "counts under the ledger's own trade-off curve; every test at confidence "
        f"{one_run['confidence']:.3g}; ceiling: the largest bound an audit could reach; "
        "inconclusive: the claim is above it; verdict: the strongest valid one (its method)",
        highlight=False)
