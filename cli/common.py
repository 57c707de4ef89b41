"""What every sub-command shares: one-line errors, JSON output, a rich console."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console

from fedlap_privacy.errors import FedlapError
from fedlap_privacy.jsonsafe import json_safe

console = Console()
err_console = Console(stderr=True)
T = TypeVar("T")


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one clear line to stderr and exit non-zero (never a traceback)."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def guarded(call: Callable[[], T]) -> T:
    """Run ``call``; user errors (bad values, files, checkpoints) become one line + exit 2."""
    try:
        return call()
    except (FedlapError, ValueError, FileNotFoundError) as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    except KeyboardInterrupt:
        fail("interrupted", code=130)


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


def privacy_sentence(p: dict[str, Any]) -> str:
    """One line saying what a run's epsilon protects (its privacy notion, SPEC 1.5)."""
    notion, eps = p.get("notion"), p.get("epsilon")
    if notion in ("record-level", "client-level") and eps is not None:
        unit = "a record" if notion == "record-level" else "a client's whole dataset"
        return (f"({eps:.3f}, {p['delta']:g})-DP for {unit} ({notion}), "
                f"sigma {p['sigma']:.4g}")
    if notion == "local" and eps is not None:
        return (f"local DP: each uploaded weight {p['round_epsilon']:g}-LDP per round, "
                f"{eps:g} per weight over the run (a whole upload: d x that)")
    return "no formal privacy (non-private method)"
