"""``audit --model X.pt2`` on a file from someone else: nothing in it is unpickled or run.

Each attack edits a genuine ``torch.export.save`` archive the way an attacker would and first
plays it against ``torch.export.load`` (what the audit used to call), to show the payload is
live there: it writes a marker file. The audit then either refuses the file with one line and
exit 2, or never reads the poisoned part; in both cases the marker is never written."""

from __future__ import annotations

import builtins
import io
import json
import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pt2_archive import Entries, export_for_audit
from pt2_archive import edit_json as _edit_json
from pt2_archive import rewrite as _rewrite
from torch import nn
from typer.testing import CliRunner

from fedlap_privacy.audit.readers.exported import load_exported_program
from fedlap_privacy.cli.main import app
from fedlap_privacy.compute.per_sample import per_sample_grad_norms
from fedlap_privacy.errors import CheckpointError

runner = CliRunner()


class _Eval:
    """Pickles to ``eval(expr, env)``: what any ``__reduce__`` payload can do."""

    def __init__(self, expr: str, env: dict[str, Any]) -> None:
        self.expr, self.env = expr, env

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.eval, (self.expr, self.env))


def _plant(marker: Path) -> str:
    """Python that writes the marker (truthy), for ``... and genuine_value`` payloads."""
    return f"__import__('pathlib').Path({str(marker)!r}).write_text('pwned')"


def _torch_saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class _Net(nn.Module):
    """A small CNN with a parameterless buffer, a lifted constant and a two-output op."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(64, 10)
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm(self.conv(x)))
        h = F.max_pool2d(self.bn(h) + h, 2)
        h = h.reshape(h.shape[0], -1) * self.scale + torch.tensor([0.1])
        top, _ = h.max(dim=1, keepdim=True)
        return self.fc(h) - top


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> tuple[Path, nn.Module, list[str]]:
    """A genuine .pt2 of a small CNN (dynamic batch) and the CLI arguments auditing it."""
    folder = tmp_path_factory.mktemp("pt2")
    torch.manual_seed(0)
    model = _Net().eval()
    path, records = export_for_audit(model, folder)
    return path, model, records


def _audit(path: Path, records: list[str]):
    return runner.invoke(app, ["audit", "--model", str(path), *records, "--claimed-eps", "50",
                               "--json", "--fail-on-violation"])


def _torch_runs_it(path: Path, marker: Path) -> bool:
    """Play the file against ``torch.export.load`` (the old loader): did the payload run?"""
    logging.disable(logging.CRITICAL)  # torch logs the fallbacks it takes
    try:
        torch.export.load(str(path)).module()(torch.rand(3, 1, 8, 8))
    except Exception:  # a loud payload may break the load after it ran; that is its business
        pass
    finally:
        logging.disable(logging.NOTSET)
    ran = marker.exists()
    marker.unlink(missing_ok=True)
    return ran


def _pickled_weight(stealthy: bool) -> Callable[[Entries, Path, nn.Module], None]:
    """Flag the first weight ``use_pickle`` and store a payload in its place; a stealthy one
    returns the genuine parameter, so the old audit finished with exit 0."""

    def edit(entries: Entries, marker: Path, model: nn.Module) -> None:
        def change(config: Any) -> None:
            meta = config["config"]["conv.weight"]
            meta["use_pickle"] = True
            value = "__import__('torch').nn.Parameter(t)" if stealthy else "None"
            entries["data/weights/" + meta["path_name"]] = _torch_saved(_Eval(
                f"{_plant(marker)} and {value}",
                {"t": model.conv.weight.detach().clone()}))

        _edit_json(entries, "data/weights/model_weights_config.json", change)

    return edit


def _pickled_constant(kind: str) -> Callable[[Entries, Path, nn.Module], None]:
    """A constant the loader unpickles: ``tensor_`` with use_pickle (torch.load
    weights_only=False), ``opaque_obj_`` (pickle.loads)."""

    def edit(entries: Entries, marker: Path, model: nn.Module) -> None:
        payload = _Eval(f"{_plant(marker)} and t", {"t": torch.zeros(1)})
        path_name = f"{kind}_9"
        entries["data/constants/" + path_name] = (
            _torch_saved(payload) if kind == "tensor" else pickle.dumps(payload))
        _edit_json(entries, "data/constants/model_constants_config.json",
                   lambda c: c["config"].update({"extra": {
                       "path_name": path_name, "is_param": False, "use_pickle": True,
                       "tensor_meta": None}}))

    return edit


def _legacy_weights(entries: Entries, marker: Path, model: nn.Module) -> None:
    """The pre-2.8 layout: the whole state dict pickled in data/weights/model.pt, which
    torch reads with weights_only=True and, when that fails, weights_only=False."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    entries["data/weights/model.pt"] = _torch_saved(_Eval(f"{_plant(marker)} and t", {"t": state}))


@pytest.mark.parametrize(("edit", "refusal"), [
    (_pickled_weight(stealthy=False), "weight 'conv.weight' is stored pickled"),
    (_pickled_weight(stealthy=True), "weight 'conv.weight' is stored pickled"),
    (_pickled_constant("tensor"), "constant 'extra' is stored pickled"),
    (_pickled_constant("opaque_obj"), "constant 'extra' is stored pickled"),
    (_legacy_weights, "data/weights/model.pt is pickled"),
], ids=["weight", "weight-stealthy", "tensor-constant", "opaque-constant", "legacy-weights"])
def test_pickled_payloads_are_refused_before_they_run(genuine, tmp_path: Path, edit,
                                                      refusal: str) -> None:
    path, model, records = genuine
    marker = tmp_path / "pwned"
    evil = _rewrite(path, tmp_path / "evil.pt2", lambda e: edit(e, marker, model))
    assert _torch_runs_it(evil, marker)  # the exploit is live against torch.export.load
    result = _audit(evil, records)
    assert not marker.exists()
    assert result.exit_code == 2, result.stdout
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert refusal in result.stderr and "refusing to load" in result.stderr


def test_stealthy_payload_passed_the_old_audit(genuine, tmp_path: Path) -> None:
    """The stealthy weight loads under torch.export.load as a model that computes the genuine
    outputs: the old audit ran the payload and still reported normally."""
    path, model, _ = genuine
    marker = tmp_path / "pwned"
    evil = _rewrite(path, tmp_path / "evil.pt2",
                    lambda e: _pickled_weight(stealthy=True)(e, marker, model))
    x = torch.rand(5, 1, 8, 8)
    logging.disable(logging.CRITICAL)
    try:
        loaded = torch.export.load(str(evil)).module()
    finally:
        logging.disable(logging.NOTSET)
    assert marker.exists()
    torch.testing.assert_close(loaded(x), model(x))
    marker.unlink()
    with pytest.raises(CheckpointError, match="stored pickled"):
        load_exported_program(evil)
    assert not marker.exists()


def _sample_inputs(entries: Entries, marker: Path, model: nn.Module) -> None:
    """Sample inputs torch falls back to weights_only=False for (a genuine tuple after)."""
    entries["data/sample_inputs/model.pt"] = _torch_saved(
        _Eval(f"{_plant(marker)} and t", {"t": ((torch.rand(2, 1, 8, 8),), {})}))


def _symbolic_shape(entries: Entries, marker: Path, model: nn.Module) -> None:
    """A symbolic batch size torch parses with sympy.sympify, i.e. eval."""

    def change(program: Any) -> None:
        size = program["graph_module"]["graph"]["tensor_values"]["x"]["sizes"][0]
        size["as_expr"]["expr_str"] = (
            f"{_plant(marker)} and " + size["as_expr"]["expr_str"])

    _edit_json(entries, "models/model.json", change)


def _guard_code(entries: Entries, marker: Path, model: nn.Module) -> None:
    """Guard code, which torch compiles into the module it returns."""
    _edit_json(entries, "models/model.json",
               lambda program: program.update(guards_code=[f"{_plant(marker)} is None"]))


@pytest.mark.parametrize("edit", [_sample_inputs, _symbolic_shape, _guard_code],
                         ids=["sample-inputs", "symbolic-shape", "guard-code"])
def test_parts_torch_would_run_are_never_read(genuine, tmp_path: Path, edit) -> None:
    path, model, records = genuine
    marker = tmp_path / "pwned"
    evil = _rewrite(path, tmp_path / "evil.pt2", lambda e: edit(e, marker, model))
    assert _torch_runs_it(evil, marker)
    result = _audit(evil, records)
    assert not marker.exists()
    assert result.exit_code == 0, result.stderr
    assert set(json.loads(result.stdout)["attacks"]) == {"loss", "grad-norm"}


@pytest.mark.parametrize(("target", "refusal"), [
    ("builtins.eval", "only aten operators"),
    ("torch.load", "only aten operators"),
    ("torch.ops.higher_order.cond", "only aten operators"),
    ("torch.ops.aten.__class__.__call__", "only aten operators"),
    ("torch.ops.aten.from_file.default", "reads or writes files"),
    ("torch.ops.aten.save.default", "reads or writes files"),
])
def test_node_targets_outside_aten_are_refused(genuine, tmp_path: Path, target: str,
                                               refusal: str) -> None:
    """The interpreter resolves nothing but aten operators (and size arithmetic), and no aten
    operator with a file argument (from_file could map a file, save write one)."""
    path, _, records = genuine

    def edit(entries: Entries) -> None:
        _edit_json(entries, "models/model.json", lambda program: program["graph_module"][
            "graph"]["nodes"][0].update(target=target))

    result = _audit(_rewrite(path, tmp_path / "evil.pt2", edit), records)
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert refusal in result.stderr


def test_genuine_program_computes_what_torch_loads(genuine) -> None:
    """Outputs and per-record gradient norms (the grad-norm attack's feature) of the
    interpreter match torch.export.load's module on a trusted file."""
    path, model, _ = genuine
    ours, theirs = load_exported_program(path), torch.export.load(str(path)).module()
    x, y = torch.rand(7, 1, 8, 8), torch.arange(7)
    torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours(x), model(x))
    torch.testing.assert_close(per_sample_grad_norms(ours, x, y),
                               per_sample_grad_norms(model, x, y))
    assert {n for n, _ in ours.named_parameters()} and len(list(ours.parameters())) == len(
        list(model.parameters()))


class _Sizes(nn.Module):
    """Arithmetic on the batch size, a data-dependent size and the runtime asserts on it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        h = x.reshape(n * 2, 32).reshape(n, -1)
        hits = torch.nonzero(h[:, :1] > 0.5).shape[0]
        return self.fc(h) + hits


def test_size_arithmetic_and_asserts_run(tmp_path: Path) -> None:
    model = _Sizes().eval()
    program = torch.export.export(model, (torch.rand(4, 1, 8, 8),), dynamic_shapes=(
        {0: torch.export.Dim("batch", min=2, max=4096)},))
    targets = {str(node.target) for node in program.graph.nodes}
    assert {"aten._assert_scalar.default", "<built-in function mul>"} <= targets
    torch.export.save(program, tmp_path / "sizes.pt2")
    x = torch.rand(9, 1, 8, 8)
    torch.testing.assert_close(load_exported_program(tmp_path / "sizes.pt2")(x), model(x))


def test_genuine_program_audits(genuine) -> None:
    path, _, records = genuine
    result = _audit(path, records)
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["attacks"]) == {"loss", "grad-norm"} and report["violation"] is False


def test_fixed_batch_program_gets_one_line(tmp_path: Path, genuine) -> None:
    """Exported without a dynamic batch: a clear line, not a shape error from a node."""
    _, model, records = genuine
    program = torch.export.export(model, (torch.randn(2, 1, 8, 8),))
    torch.export.save(program, tmp_path / "fixed.pt2")
    result = _audit(tmp_path / "fixed.pt2", records)
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "dynamic batch dimension" in result.stderr


class _Layers(nn.Module):
    """The layers a classifier export holds beyond _Net's: LayerNorm, InstanceNorm, dropout
    and BatchNorm1d in eval, average and adaptive pooling, GELU, softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.bn = nn.BatchNorm1d(16)
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 10)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.avg_pool2d(F.gelu(self.inorm(self.conv(x))), 2)
        h = F.adaptive_avg_pool2d(h, 2).flatten(1)
        h = self.drop(self.ln(self.bn(h)))
        return self.fc(h) + F.log_softmax(h, dim=1).mean(dim=1, keepdim=True)


@pytest.mark.parametrize("decompose", [False, True], ids=["training-ir", "core-aten"])
def test_common_layers_run_in_both_irs(tmp_path: Path, decompose: bool) -> None:
    """Every operator these layers export to, before and after run_decompositions(), is on
    the interpreter's list and computes what the model does."""
    model = _Layers().eval()
    program = torch.export.export(model, (torch.rand(2, 1, 8, 8),), dynamic_shapes=(
        {0: torch.export.Dim("batch", min=1)},))
    torch.export.save(program.run_decompositions() if decompose else program,
                      tmp_path / "layers.pt2")
    ours = load_exported_program(tmp_path / "layers.pt2")
    x, y = torch.rand(5, 1, 8, 8), torch.arange(5)
    torch.testing.assert_close(ours(x), model(x))
    torch.testing.assert_close(per_sample_grad_norms(ours, x, y),
                               per_sample_grad_norms(model, x, y))
