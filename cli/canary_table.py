"""The tables of one-run canary audits, shared by ``audit --model`` and ``audit
--canary-scores``: one small table per score (a row per test), readable at 80 columns."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from fedlap_privacy.cli.common import console

__all__ = ["render_one_run"]

#: each test's name in the table
TESTS = {"steinke": "Steinke LB", "fdp": "f-DP LB", "claim-curve": "claim-curve p",
         "noise": "noise test"}
COLOUR = {"violation": "bold red", "consistent": "green", "inconclusive": "yellow"}


def _fmt(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _table(audit: dict[str, Any]) -> Table:
    first = next(iter(audit["methods"].values()))
    table = Table(title=f"{audit['audit']}: {first['canaries']} canaries, "
                        f"{first.get('included', '?')} included", title_justify="left")
    for column in ("test", "bound", "ceiling", "p-value", "level", "verdict", "counts"):
        table.add_column(column, justify="left" if column in ("test", "verdict") else "right")
    for name, m in audit["methods"].items():
        verdict = f"[{COLOUR[m['verdict']]}]{m['verdict']}[/]" + (
            "" if m.get("valid", True) else " (not counted)")
        counts = (f"{m['correct']}/{m['guesses']}" if "guesses" in m else f"{m['values']:,}")
        table.add_row(TESTS.get(name, name), _fmt(m.get("epsilon_lower_bound")),
                      _fmt(m.get("ceiling")), _fmt(m.get("p_value")), _fmt(m.get("level")),
                      verdict, counts)
    return table


def render_one_run(one_run: dict[str, Any]) -> None:
    """The canary audits: per score, every test's bound (or p-value), ceiling, level and
    verdict, then the sentence that decided the score's verdict."""
    console.print(f"one-run canary audits ({one_run['kind']} canaries), claimed epsilon "
                  f"{_fmt(one_run.get('claimed_epsilon'))}:", highlight=False)
    for a in one_run["audits"]:
        console.print(_table(a))
        console.print(f"{a['audit']}: [{COLOUR[a['verdict']]}]{a['verdict']}[/]: "
                      f"{a.get('reason', '')}", highlight=False)
        estimate, gdp = a.get("epsilon_estimate"), a.get("gdp_estimate")
        if estimate is not None:
            console.print(f"{a['audit']}: epsilon ESTIMATE {estimate['epsilon']:.2f} (Andrew "
                          "et al.; not a bound, in no verdict)", highlight=False)
        if gdp is not None:
            console.print(f"{a['audit']}: Gaussian-DP ESTIMATE epsilon {gdp['epsilon']:.2f} "
                          "(not a bound, in no verdict)", highlight=False)
        if a.get("epsilon_estimate_skipped"):
            console.print(f"{a['audit']}: no epsilon estimate (the bounds do not need it): "
                          f"{a['epsilon_estimate_skipped']}", highlight=False)
    console.print(
        "Steinke LB: Steinke-Nasr-Jagielski one-run lower bound on epsilon; f-DP LB: "
        "Mahloujifar-Melis-Chaudhuri bound of the Gaussian trade-off family (not counted "
        "where the claimed mechanism is not that Gaussian-private); claim-curve p: p-value "
        "of the guesses under the claimed mechanism's own trade-off curve; noise test: do "
        "the releases carry half the claimed noise; level: each test's share of the "
        "family's level (a p-value below it, or a bound above the claim, is a violation); "
        "ceiling: the largest bound a perfect score reaches with "
        "the coins drawn; counts: right guesses / guesses", highlight=False)
