"""``audit --model X.pt2``: a program from someone else cannot make the audit run for hours
(issue 46, "nothing crashes the process"; docs/audit.md#auditing-a-model-trained-elsewhere).

The memory budget frees each product after its last reader, so a chain of 20,000 ``mm`` on
a 512 x 512 weight ran to the end within it, 10.5 GFLOP per record and per forward pass --
minutes for one batch of the audit. The compute budget counts a program's FLOP on ``meta``
tensors before the first operator runs and refuses it in one line."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pt2_archive import arg, export_for_audit, graph, node, rewrite
from torch import nn
from typer.testing import CliRunner

from fedlap_privacy.audit.readers.exported import load_exported_program
from fedlap_privacy.audit.readers.exported_compute import CALL, FACTOR, FLOOR, flops
from fedlap_privacy.cli.main import app
from fedlap_privacy.errors import CheckpointError

runner = CliRunner()


class _Square(nn.Module):
    """A classifier with a 512 x 512 weight applied once (``mm``) and a 64-channel 3 x 3
    convolution applied once: the layers the attacks repeat."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(1, 64, 3, padding=1)
        self.conv = nn.Conv2d(64, 64, 3, padding=1)
        self.squeeze = nn.Linear(64, 512)
        self.w = nn.Parameter(torch.randn(512, 512) / 512)
        self.out = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(torch.relu(self.conv_in(x)))).mean(dim=(2, 3))
        return self.out(torch.mm(torch.relu(self.squeeze(h)), self.w))


@pytest.fixture(scope="module")
def square(tmp_path_factory) -> tuple[Path, list[str]]:
    folder = tmp_path_factory.mktemp("compute")
    torch.manual_seed(0)
    return export_for_audit(_Square().eval(), folder)


def _repeat(target: str, times: int) -> Callable[[list[dict[str, Any]]], None]:
    """The last ``target`` node applied ``times`` times in a row, each copy reading the
    previous one's output (a loop unrolled): the shapes stay those of the genuine layer."""

    def change(nodes: list[dict[str, Any]]) -> None:
        at = max(i for i, n in enumerate(nodes) if n["target"] == f"torch.ops.aten.{target}")
        original = nodes[at]
        name = original["outputs"][0]["as_tensor"]["name"]
        original["outputs"] = [{"as_tensor": {"name": "h0"}}]
        chain = []
        for k in range(1, times):
            link = copy.deepcopy(original)
            link["inputs"][0]["arg"] = {"as_tensor": {"name": f"h{k - 1}"}}
            out = name if k == times - 1 else f"h{k}"
            link["name"], link["outputs"] = out, [{"as_tensor": {"name": out}}]
            link["metadata"] = {}
            chain.append(link)
        nodes[at + 1:at + 1] = chain

    return change


_WEIGHTS = 640 + 36928 + 64 * 512 + 512 + 512 * 512 + 5130  # the parameters of _Square


def _records(n: int) -> torch.Tensor:
    return torch.rand(n, 1, 8, 8)


def test_genuine_program_is_far_within_the_budget(square) -> None:
    """The model the attacks edit: its walk counts every node, and it needs a small part of
    its budget: 16 x 2 x weights x 64 positions + 2**27 FLOP per record."""
    module = load_exported_program(square[0])
    spent, budget, whole = module.flop_count(_records(4))
    weights = _WEIGHTS
    assert whole and budget.weights == weights and budget.positions == 64
    assert budget.per_record == FACTOR * 2 * weights * 64 + FLOOR
    convolutions = 2 * 64 * 64 * (9 + 64 * 9)  # per record, plus a bias add per output
    assert convolutions < spent / 4 < 2 * convolutions
    assert spent / 4 / budget.per_record < 0.01


@pytest.mark.parametrize(("target", "times", "each"), [
    ("mm.default", 20_000, 2 * 512 * 512),
    ("conv2d.default", 2_000, 2 * 64 * 64 * 64 * 9),
], ids=["mm-20000", "conv-2000"])
def test_unrolled_chains_are_refused_before_they_run(square, tmp_path: Path, target: str,
                                                    times: int, each: int) -> None:
    """20,000 products on the 512 x 512 weight (10.5 GFLOP a record), 2,000 convolutions
    64 -> 64 channels (9.4 GFLOP a record): refused in one line naming the budget, within
    seconds (the old interpreter had not finished the products on these 4 records after 10
    minutes, on a shared machine)."""
    evil = rewrite(square[0], tmp_path / "evil.pt2", graph(_repeat(target, times)))
    assert evil.stat().st_size < 8_000_000
    module = load_exported_program(evil)
    started = time.perf_counter()
    with pytest.raises(CheckpointError) as refused:
        module(_records(4))
    assert time.perf_counter() - started < 5
    line = str(refused.value)
    assert "\n" not in line and f"aten.{target})" in line
    assert f"GFLOP per record, its budget for a model of {_WEIGHTS} weights on records of 64 " \
           "positions" in line
    budget = float(line.split("needs more than ")[1].split(" GFLOP")[0])
    assert budget == pytest.approx((FACTOR * 2 * _WEIGHTS * 64 + FLOOR) / 1e9, rel=1e-3)
    assert times * each > 10 * budget * 1e9  # the whole chain: over ten budgets


def test_audit_refuses_the_chain_in_one_line(square, tmp_path: Path) -> None:
    """The CLI: exit 2, one line on stderr naming the budget, no traceback."""
    path, records = square
    evil = rewrite(path, tmp_path / "evil.pt2", graph(_repeat("mm.default", 20_000)))
    started = time.perf_counter()
    result = runner.invoke(app, ["audit", "--model", str(evil), *records,
                                 "--claimed-eps", "50", "--json"])
    assert time.perf_counter() - started < 30
    assert result.exit_code == 2, (result.exit_code, result.stdout[-300:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "GFLOP per record, its budget for a model of 338122 weights" in lines[0]


def test_a_factory_matrix_squared_is_refused(square, tmp_path: Path) -> None:
    """No weights needed: ``full`` builds a 4096 x 4096 matrix (64 MiB, within the memory
    budget) and ``mm`` squares it, 137 GFLOP; so does a max pooling with a 1024 x 1024
    window over a 2048 x 2048 plane (1.1 TFLOP, 16 MiB)."""

    def square_it(nodes: list[dict[str, Any]]) -> None:
        nodes[0:0] = [
            node("full.default", [arg("size", {"as_ints": [4096, 4096]}),
                                  arg("fill_value", {"as_float": 1.0})], "big"),
            node("mm.default", [arg("self", {"as_tensor": {"name": "big"}}),
                                arg("mat2", {"as_tensor": {"name": "big"}})], "sq")]

    def pool_it(nodes: list[dict[str, Any]]) -> None:
        nodes[0:0] = [
            node("full.default", [arg("size", {"as_ints": [1, 1, 2048, 2048]}),
                                  arg("fill_value", {"as_float": 1.0})], "big"),
            node("max_pool2d.default", [arg("self", {"as_tensor": {"name": "big"}}),
                                        arg("kernel_size", {"as_ints": [1024, 1024]}),
                                        arg("stride", {"as_ints": [1, 1]})], "sq")]

    for edit, where in ((square_it, "node 1 (aten.mm.default)"),
                        (pool_it, "node 1 (aten.max_pool2d.default)")):
        module = load_exported_program(rewrite(square[0], tmp_path / "evil.pt2", graph(edit)))
        started = time.perf_counter()
        with pytest.raises(CheckpointError, match=r"GFLOP per record, its budget") as refused:
            module(_records(2))
        assert where in str(refused.value) and time.perf_counter() - started < 2


def test_counting_rules() -> None:
    """The FLOP of each kind of call, from shapes alone (meta tensors)."""
    meta = {"device": "meta"}
    a, b = torch.empty(3, 5, **meta), torch.empty(5, 7, **meta)
    assert flops("mm.default", [a, b], torch.empty(3, 7, **meta)) == 2 * 3 * 5 * 7
    bias = torch.empty(7, **meta)
    assert flops("addmm.default", [bias, a, b], torch.empty(3, 7, **meta)) == 2 * 105 + 21
    x, w = torch.empty(2, 4, 10, 10, **meta), torch.empty(6, 2, 3, 3, **meta)  # 2 groups
    out = torch.ops.aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], False,
                                             [0, 0], 2)
    conv = [x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 2]
    assert flops("convolution.default", conv, out) == 2 * 2 * 6 * 100 * 2 * 9 + out.numel()
    assert flops("expand.default", [bias, [9, 7]], torch.empty(9, 7, **meta)) == 0
    assert flops("sum.default", [torch.empty(9, 7, **meta)], torch.empty((), **meta)) == 63
    assert CALL == 1 << 16


def test_graph_of_many_cheap_calls_is_bounded(square, tmp_path: Path) -> None:
    """Each node costs at least its dispatch (2**16 FLOP): 20,000 views of the records count
    1.3 GFLOP for one record, over its 0.83 GFLOP budget; 1,000 of them pass."""

    def views(count: int) -> Callable[[list[dict[str, Any]]], None]:
        return lambda nodes: nodes.__setitem__(slice(0, 0), [node(
            "alias.default", [arg("self", {"as_tensor": {"name": "x"}})], f"v{k}")
            for k in range(count)])

    few = load_exported_program(rewrite(square[0], tmp_path / "few.pt2", graph(views(1000))))
    spent, budget, whole = few.flop_count(_records(1))
    assert whole and spent > 1000 * CALL and torch.isfinite(few(_records(1))).all()
    many = load_exported_program(rewrite(square[0], tmp_path / "many.pt2",
                                         graph(views(20_000))))
    with pytest.raises(CheckpointError, match=r"node \d+ \(aten.alias.default\)"):
        many(_records(1))
    assert 20_000 * CALL > budget.per_record


def test_chain_after_a_data_dependent_step_is_counted_as_it_runs(square,
                                                               tmp_path: Path) -> None:
    """``item`` (a value read from the records) ends the walk on meta tensors; the products
    after it are counted just before each runs, and refused once past the budget (having
    spent at most the budget)."""

    def after_item(nodes: list[dict[str, Any]]) -> None:
        _repeat("mm.default", 3_000)(nodes)
        nodes[0:0] = [
            node("sum.default", [arg("self", {"as_tensor": {"name": "x"}})], "s"),
            {**node("item.default", [arg("self", {"as_tensor": {"name": "s"}})], None),
             "outputs": [{"as_sym_float": {"as_name": "it"}}]}]

    module = load_exported_program(rewrite(square[0], tmp_path / "evil.pt2",
                                           graph(after_item)))
    spent, budget, whole = module.flop_count(_records(1))
    assert not whole and spent < budget.per_record
    with pytest.raises(CheckpointError, match=r"passes it at node \d+ \(aten.mm.default\)") as (
            refused), torch.no_grad():
        module(_records(1))
    node_index = int(str(refused.value).split("at node ")[1].split(" ")[0])
    assert node_index < 2_000  # within the budget: 1,574 of the 3,000 products ran
