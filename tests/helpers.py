"""Plain helpers the tests import (pyproject.toml puts this folder on the path)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedlap_privacy.fl.config import TrainConfig

#: a FedLAP-DP / baseline configuration that trains in about a second on digits
TINY: dict[str, Any] = dict(
    width=16, rounds=2, reinits=1, max_loops=2, real_batches=2, syn_steps=2,
    local_model_steps=2, ipc=2, server_epochs=5, batch_size=32, local_steps=3,
)


def tiny(**kw: Any) -> TrainConfig:
    """The tiny configuration ``TINY`` with ``kw`` overriding (or adding to) its fields."""
    from fedlap_privacy.fl.config import TrainConfig

    return TrainConfig(**{**TINY, **kw})


@cache
def repo_root() -> Path:
    """The repository root: the nearest folder above this file that holds pyproject.toml."""
    here = Path(__file__).resolve()
    for folder in here.parents:
        if (folder / "pyproject.toml").is_file():
            return folder
    raise FileNotFoundError(f"no pyproject.toml above {here}")


def documented_script(name: str, doc: str = "auditing.md") -> str:
    """The ``# NAME`` Python block of docs/DOC, as a reader copies it."""
    import re

    text = (repo_root() / "docs" / doc).read_text()
    found = re.search(rf"^```python\n# {re.escape(name)}\n(.*?)^```", text, re.S | re.M)
    assert found, f"docs/{doc} shows no {name}"
    return found.group(1)


def save_run_files(
    checkpoint: Path, release: dict, client_indices: list, data_dir: str | None = None
) -> Path:
    """A hand-made run folder for the audit: ``checkpoint`` (the releasable part) and the
    ``private.pt`` beside it with the member indices and the data folder."""
    from fedlap_privacy.state.checkpoint import PRIVATE, PRIVATE_FORMAT, save_checkpoint

    save_checkpoint(checkpoint, release)
    private = {"client_indices": client_indices, "config": {"data_dir": data_dir}}
    save_checkpoint(checkpoint.parent / PRIVATE, private, PRIVATE_FORMAT)
    return checkpoint


def ledger_claiming(epsilon: float, delta: float = 1e-5) -> list[dict]:
    """The entries of a one-round record-level ledger whose epsilon is ``epsilon`` (sigma
    planned for it): what an audit recomputes its claim from."""
    from fedlap_privacy.accountant import FedLAPSchedule, plan_sigma
    from fedlap_privacy.state.ledger import PrivacyLedger

    schedule = FedLAPSchedule(batch_size=10, client_size=100, local_steps=1)
    sigma = plan_sigma(schedule, 1, epsilon, delta)
    ledger = PrivacyLedger("record-level", schedule, sigma, delta, clients=1)
    ledger.record(1, 1, [0])
    return ledger.to_list()


#: what each method needs beyond the tiny configuration to run at all
METHOD_EXTRAS: dict[str, dict] = {
    "fedlap": dict(radius_rule="min", init="real", sigma=None),  # client-suggested radii
    "ali-dpfl": dict(target_eps=5.0, sigma=1.0, tau_max=5),
    "ldp-fl": dict(ldp_epsilon=1.0),
}


def edit_checkpoint(path: Path, fmt: str | None = None, **changes: Any) -> None:
    """Rewrite a run file as an attacker with write access would: each ``key=change`` replaces
    the payload's ``key`` by ``change(old value)`` (``fmt``: the file's format name)."""
    from fedlap_privacy.state.checkpoint import load_checkpoint, save_checkpoint

    payload = load_checkpoint(path, *([fmt] if fmt else []))
    payload.pop("format")
    for key, change in changes.items():
        payload[key] = change(payload[key])
    save_checkpoint(path, payload, *([fmt] if fmt else []))
