"""The JSON a user sees does not change shape: ``train --json``'s summary, ``metrics.jsonl``,
the privacy statement and history ``ckpt.pt`` releases, and ``comparison.json``.

Tiny deterministic runs (fixed seeds, seeded noise, a public split) are compared against
``golden/json_outputs.json``, captured from the code before the records became typed: the
keys, their order and the value types everywhere; the values that do not depend on the
machine (strings, integers, booleans, None, epsilons, sigmas, byte counts) exactly (floats
to 1e-9). Accuracies, losses and timings vary with the BLAS a machine runs and are compared
by type only. Regenerate (only for an intended change): ``FEDLAP_GOLDEN=write pytest ...``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fedlap_privacy.cli.main import app
from fedlap_privacy.fl.run.run_files import load_release

GOLDEN = Path(__file__).parent / "golden" / "json_outputs.json"
#: values that depend on the machine (training arithmetic, timings, paths): type only
VOLATILE = {
    "test_accuracy", "test_loss", "validation_accuracy", "seconds", "out", "mean", "std",
    "mean_by_round", "accuracy_by_round", "validation_mean", "grad_norm", "syn_loss",
    "server_loss", "server_accuracy",
}
COMMON = ["--local-steps", "2", "--set", "width=8", "--rounds", "2", "--seed", "3",
          "--set", "split_seed=5", "--reproducible-noise"]
#: one run per shape the outputs take: released or withheld selection, method-specific
#: metrics, client-level sampling, a validation hold-out, no privacy at all
RUNS = {
    "dp-fedavg-server": ["--method", "dp-fedavg", "--sigma", "1.2", "--set",
                         "threat_model=server", "--set", "validation_records=40"],
    "fedlap-server": ["--method", "fedlap-dp", "--sigma", "1.5",
                      "--set", "threat_model=server", "--set", "max_loops=2",
                      "--set", "ipc=2", "--set", "syn_steps=2", "--set", "server_epochs=2",
                      "--set", "reinits=1", "--set", "real_batches=2",
                      "--set", "local_model_steps=2", "--rounds", "1"],
    "normfedavg-client": ["--method", "dp-normfedavg", "--target-eps", "8"],
    "fedavg": ["--method", "fedavg"],
}


def _train(out: Path, args: list[str]) -> dict[str, Any]:
    result = CliRunner().invoke(app, ["train", *COMMON, *args, "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    release = load_release(out)
    return {
        "summary": json.loads(result.stdout),
        "metrics": [json.loads(line) for line in (out / "metrics.jsonl").read_text()
                    .splitlines()],
        "ckpt_privacy": json.loads(json.dumps(release.privacy)),
        "ckpt_history": json.loads(json.dumps(release.history)),
    }


def _compare(out: Path) -> dict[str, Any]:
    result = CliRunner().invoke(app, [
        "compare", "--methods", "dp-fedavg,fedavg", "--eps", "5", "--rounds", "1",
        "--set", "width=8", "--set", "local_steps=2", "--set", "split_seed=5",
        "--set", "reproducible_noise=true", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads((out / "comparison.json").read_text())


def _outputs(tmp_path: Path) -> dict[str, Any]:
    outputs = {name: _train(tmp_path / name, args) for name, args in RUNS.items()}
    outputs["compare"] = _compare(tmp_path / "compare")
    return outputs


def _same(got: Any, want: Any, where: str, volatile: bool = False) -> None:
    """``got`` has ``want``'s structure, key order and types, and its stable values."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for key in want:
            _same(got[key], want[key], f"{where}.{key}", volatile or key in VOLATILE)
    elif isinstance(want, list):
        if not volatile:
            assert len(got) == len(want), f"{where}: {len(got)} items != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=False)):
            _same(g, w, f"{where}[{i}]", volatile)
    elif not volatile:
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-9, abs=1e-12), where
        else:
            assert got == want, where


def test_json_outputs_keep_their_keys_order_and_values(tmp_path: Path) -> None:
    got = _outputs(tmp_path)
    if os.environ.get("FEDLAP_GOLDEN") == "write":
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(GOLDEN.read_text())
    _same(got, want, "outputs")
    # the withheld selection drops the counts; the method's public extras stay
    assert "clients" not in got["normfedavg-client"]["metrics"][0]
    assert "expected_clients" in got["normfedavg-client"]["metrics"][0]
    assert "clients" in got["dp-fedavg-server"]["metrics"][0]
    assert "validation_accuracy" in got["dp-fedavg-server"]["summary"]
    assert "client_sampling" in got["normfedavg-client"]["summary"]
