"""The ``fedlap-privacy`` command. Sub-commands parse, call one function, print; no logic.

Sub-command modules import torch only inside their functions, so ``plan`` starts fast, and
:func:`main` sets torch's environment defaults (:mod:`fedlap_privacy.compute.runtime_env`) before
any of them loads torch.
"""

from __future__ import annotations

import typer

from fedlap_privacy.cli.audit import audit
from fedlap_privacy.cli.compare import compare
from fedlap_privacy.cli.plan import plan
from fedlap_privacy.cli.train import train
from fedlap_privacy.compute.runtime_env import apply_runtime_defaults

app = typer.Typer(
    name="fedlap-privacy",
    help="Differentially private federated learning: plan privacy, train, audit, compare.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def main() -> None:
    """Differentially private federated learning: plan privacy, train, audit, compare."""
    apply_runtime_defaults()


app.command("plan")(plan)
app.command("train")(train)
app.command("audit")(audit)
app.command("compare")(compare)

if __name__ == "__main__":
    app()
