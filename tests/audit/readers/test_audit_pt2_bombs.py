"""``audit --model X.pt2``: a program from someone else cannot crash the audit, take memory
beyond its budget, or print to the auditor's terminal (issue 46).

Each attack edits a genuine export the way an attacker would. The interpreter used to run
any aten operator as the file gave it: an unchecked sparse constructor wrote outside its
buffer (a segmentation fault), a 12 KB graph asked ``aten.ones`` for 3.6 GB, a one-element
payload viewed with stride 0 as 40,000 x 40,000 was cloned into 6.4 GB, a chain of ``mm``
kept every intermediate, and ``aten._print`` wrote the file's text to the terminal. The
audits that could allocate run under an address-space cap of the process's current size
plus 2 GiB (the old interpreter fails there with a MemoryError); the segfault runs in a
child process."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from pt2_archive import Entries, edit_json, export_for_audit, rewrite
from pt2_archive import arg as _arg
from pt2_archive import graph as _graph
from pt2_archive import node as _node
from torch import nn
from typer.testing import CliRunner

from fedlap_privacy.audit.readers.exported import load_exported_program
from fedlap_privacy.cli.main import app
from fedlap_privacy.errors import CheckpointError

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(),
                                reason="the address-space cap reads /proc/self/status")
runner = CliRunner()
_GIB = 1 << 30


@contextmanager
def _at_most(extra: int) -> Iterator[None]:
    """Cap this process's address space at its current size plus ``extra`` bytes."""
    status = Path("/proc/self/status").read_text()
    size = int(next(line for line in status.splitlines() if line.startswith("VmSize:"))
               .split()[1]) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = size + extra if hard == resource.RLIM_INFINITY else min(size + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class _Bait(nn.Module):
    """A linear classifier plus the operators an attacker resizes: a constant built with
    ``ones``, a buffer expanded and cloned, and an ``mm`` on the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)
        self.register_buffer("c", torch.zeros(1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x.flatten(1))
        return (h + torch.ones(4, 4).sum() + self.c.expand(2, 2).clone().sum()
                + torch.mm(h[:, :4], self.fc.weight[:4, :4]).sum())


@pytest.fixture(scope="module")
def bait(tmp_path_factory) -> tuple[Path, list[str]]:
    """The genuine export (dynamic batch) and the records the audit is given."""
    folder = tmp_path_factory.mktemp("bombs")
    torch.manual_seed(0)
    return export_for_audit(_Bait().eval(), folder)


def _where(nodes: list[dict[str, Any]], target: str) -> int:
    return next(i for i, n in enumerate(nodes) if n["target"] == f"torch.ops.aten.{target}")


def _ints(nodes: list[dict[str, Any]], target: str, sizes: list[int]) -> None:
    nodes[_where(nodes, target)]["inputs"][-1 if target == "expand.default" else 0] = _arg(
        "size", {"as_ints": sizes})


def _mm_chain(links: int) -> Callable[[list[dict[str, Any]]], None]:
    """``ones`` becomes a 256 KiB column multiplied by a 1 x 1 matrix of ones ``links``
    times; the last product takes the place of ``ones`` (values stay 1)."""

    def change(nodes: list[dict[str, Any]]) -> None:
        at = _where(nodes, "ones.default")
        nodes[at]["inputs"][0] = _arg("size", {"as_ints": [65536, 1]})
        nodes[at]["outputs"] = [{"as_tensor": {"name": "h0"}}]
        chain = [_node("ones.default", [_arg("size", {"as_ints": [1, 1]})], "one")]
        chain += [_node("mm.default", [_arg("self", {"as_tensor": {"name": f"h{k}"}}),
                                       _arg("mat2", {"as_tensor": {"name": "one"}})],
                        f"h{k + 1}" if k + 1 < links else "ones") for k in range(links)]
        nodes[at + 1:at + 1] = chain

    return change


def _stride_zero_payload(entries: Entries) -> None:
    """The one-element buffer ``c`` declared 40,000 x 40,000 with strides 0."""
    edit_json(entries, "data/weights/model_weights_config.json", lambda config: config[
        "config"]["c"]["tensor_meta"].update(sizes=[{"as_int": 40000}] * 2,
                                             strides=[{"as_int": 0}] * 2))
    _graph(lambda nodes: nodes.__setitem__(_where(nodes, "expand.default"), _node(
        "alias.default", [_arg("self", {"as_tensor": {"name": "b_c"}})], "expand")))(entries)


def _audit(path: Path, records: list[str]):
    return runner.invoke(app, ["audit", "--model", str(path), *records, "--claimed-eps", "50",
                               "--json"])


def _one_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.stdout[-300:], result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_genuine_bait_audits_under_the_cap(bait) -> None:
    """The model the attacks edit audits normally within the cap the attacks run under."""
    path, records = bait
    with _at_most(2 * _GIB):
        result = _audit(path, records)
    assert result.exit_code == 0, result.stderr
    assert set(json.loads(result.stdout)["attacks"]) == {"loss", "grad-norm"}


@pytest.mark.parametrize(("edit", "node", "asks"), [
    (_graph(lambda nodes: _ints(nodes, "ones.default", [30000, 30000])),
     "(aten.ones.default)", 3433.0),
    (_graph(lambda nodes: _ints(nodes, "expand.default", [40000, 40000])),
     "(aten.expand.default)", 6103.0),
], ids=["ones", "expand-clone"])
def test_allocations_beyond_the_budget_are_refused(bait, tmp_path: Path, edit, node: str,
                                                   asks: float) -> None:
    """A 12 KB graph asking for gigabytes is refused before it allocates, with the budget
    its weights and batch give (128 MiB floor + 8 x weights + batch x per-record)."""
    path, records = bait
    evil = rewrite(path, tmp_path / "evil.pt2", edit)
    assert evil.stat().st_size < 32_000
    with _at_most(2 * _GIB):
        line = _one_line(_audit(evil, records))
    assert node in line and "above its budget of" in line and "batch 1 records" in line
    wanted = float(line.split("asks for ")[1].split(" MB")[0])
    assert asks <= wanted < asks + 1
    budget = float(line.split("budget of ")[1].split(" MB")[0])
    assert budget == 132.3  # one record checked first: 128 MiB + 4 MiB + 1024 x 256 B


def test_stride_zero_payload_is_refused_on_load(bait, tmp_path: Path) -> None:
    """One stored float declared as a 40,000 x 40,000 buffer (strides 0) and cloned."""
    path, records = bait
    evil = rewrite(path, tmp_path / "evil.pt2", _stride_zero_payload)
    with _at_most(2 * _GIB):
        line = _one_line(_audit(evil, records))
    assert "'c' declares 1600000000 elements over a payload of 1" in line


def test_mm_chain_holds_a_few_intermediates(bait, tmp_path: Path) -> None:
    """1,000 chained products of 256 KiB each (44 MFLOP a record, within the compute
    budget): the program runs to the end holding a few of them (the old interpreter kept all
    250 MB)."""
    path, _ = bait
    module = load_exported_program(rewrite(path, tmp_path / "evil.pt2",
                                           _graph(_mm_chain(1000))))
    with _at_most(_GIB), torch.no_grad():
        out = module(torch.rand(3, 1, 8, 8))
    assert torch.isfinite(out).all() and module.peak_bytes < 1 << 20


def test_mm_chain_with_gradients_is_refused_past_the_budget(bait, tmp_path: Path) -> None:
    """With gradients autograd keeps every product, so the per-record gradients of the
    grad-norm attack are refused once they pass the budget; the old audit held them all."""
    path, records = bait
    evil = rewrite(path, tmp_path / "evil.pt2", _graph(_mm_chain(600)))
    with _at_most(2 * _GIB):
        line = _one_line(_audit(evil, records))
    assert "(aten.mm.default)" in line and "batch 2 records" in line


def _sparse_write(entries: Entries) -> None:
    """An unchecked sparse constructor with index 10**8 in a 4-element tensor, made dense."""

    def change(nodes: list[dict[str, Any]]) -> None:
        at = _where(nodes, "ones.default")
        nodes[at:at + 1] = [
            _node("full.default", [_arg("size", {"as_ints": [1, 1]}),
                                   _arg("fill_value", {"as_int": 10**8}),
                                   _arg("dtype", {"as_scalar_type": 5}, keyword=True)], "i"),
            _node("full.default", [_arg("size", {"as_ints": [1]}),
                                   _arg("fill_value", {"as_float": 7.0})], "v"),
            _node("_sparse_coo_tensor_with_dims_and_tensors.default", [
                _arg("sparse_dim", {"as_int": 1}), _arg("dense_dim", {"as_int": 0}),
                _arg("size", {"as_ints": [4]}), _arg("indices", {"as_tensor": {"name": "i"}}),
                _arg("values", {"as_tensor": {"name": "v"}}),
                _arg("dtype", {"as_scalar_type": 7}, keyword=True),
                _arg("layout", {"as_layout": 1}, keyword=True),
                _arg("is_coalesced", {"as_bool": True}, keyword=True)], "s"),
            _node("_to_dense.default", [_arg("self", {"as_tensor": {"name": "s"}})], "ones")]

    _graph(change)(entries)


def test_sparse_out_of_bounds_write_is_refused(bait, tmp_path: Path) -> None:
    """Run in a child process: on the old interpreter it ends in a segmentation fault."""
    path, records = bait
    evil = rewrite(path, tmp_path / "evil.pt2", _sparse_write)
    child = subprocess.run(
        [sys.executable, "-c", "from fedlap_privacy.cli.main import app; app()", "audit",
         "--model", str(evil), *records, "--json"],
        capture_output=True, text=True, timeout=300, check=False)
    assert child.returncode == 2, (child.returncode, child.stderr[-500:])
    lines = child.stderr.strip().splitlines()
    assert len(lines) == 1 and "aten._sparse_coo_tensor_with_dims_and_tensors" in lines[0]


def test_print_is_refused_and_nothing_is_echoed(bait, tmp_path: Path, capfd) -> None:
    """``aten._print`` wrote the file's text to the auditor's terminal (file descriptor 1,
    past Python's sys.stdout)."""
    path, records = bait
    text = "AUDIT PASSED: no membership leak found"
    evil = rewrite(path, tmp_path / "evil.pt2", _graph(lambda nodes: nodes.insert(0, _node(
        "_print.default", [_arg("s", {"as_string": text})], None))))
    result = _audit(evil, records)
    echoed = capfd.readouterr()
    assert text not in echoed.out + echoed.err + result.stdout + result.stderr
    assert "aten._print.default" in _one_line(result)


def test_size_arithmetic_and_strings_are_bounded(bait, tmp_path: Path) -> None:
    """A shift by 10**12 (a 125 GB Python integer) and a string argument that is not a word
    (an assert's message is replaced, never shown) are refused in one line."""
    path, _ = bait

    def shift(nodes: list[dict[str, Any]]) -> None:
        nodes.insert(0, {"target": "_operator.lshift", "name": "big", "metadata": {},
                         "inputs": [_arg("a", {"as_int": 1}), _arg("b", {"as_int": 10**12})],
                         "outputs": [{"as_sym_int": {"as_name": "big"}}],
                         "is_hop_single_tensor_return": None})

    with pytest.raises(CheckpointError, match="beyond any tensor's size"):
        load_exported_program(rewrite(path, tmp_path / "shift.pt2", _graph(shift)))(
            torch.rand(2, 1, 8, 8))
    gelu = _graph(lambda nodes: nodes.insert(0, _node("gelu.default", [
        _arg("self", {"as_tensor": {"name": "x"}}),
        _arg("approximate", {"as_string": "\x1b[2J tanh"}, keyword=True)], "g")))
    with pytest.raises(CheckpointError, match="string argument that is not a plain word"):
        load_exported_program(rewrite(path, tmp_path / "gelu.pt2", gelu))


def test_batch_norm_weights_must_cover_the_channels(tmp_path: Path) -> None:
    """The CPU BatchNorm kernel reads one weight per channel without checking how many there
    are: a one-element weight for 3,000,000 channels read far past it (a segfault)."""
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2)).eval()
    program = torch.export.export(model, (torch.randn(2, 4),), dynamic_shapes=(
        {0: torch.export.Dim("batch", min=1)},)).run_decompositions()
    torch.export.save(program, tmp_path / "bn.pt2")
    x = torch.randn(3, 4)
    torch.testing.assert_close(load_exported_program(tmp_path / "bn.pt2")(x), model(x))

    def shrink(config: Any) -> None:
        for name in ("0.weight", "0.running_mean"):
            config["config"][name]["tensor_meta"]["sizes"] = [{"as_int": 1}]

    evil = rewrite(tmp_path / "bn.pt2", tmp_path / "evil.pt2", lambda entries: edit_json(
        entries, "data/weights/model_weights_config.json", shrink))
    with pytest.raises(CheckpointError, match=r"per-channel argument of shape \(1,\)"):
        load_exported_program(evil)(x)


def _float64_convolution(op: str) -> Callable[[Entries], None]:
    """``ones`` becomes a 700 x 700 float64 plane convolved with a 24 x 24 kernel: 3.9 MB
    out, but the CPU kernel without a oneDNN path unfolds the input into 2.2 GB first."""
    f64 = _arg("dtype", {"as_scalar_type": 8}, keyword=True)

    def change(nodes: list[dict[str, Any]]) -> None:
        at = _where(nodes, "ones.default")
        nodes[at:at + 1] = [
            _node("ones.default", [_arg("size", {"as_ints": [1, 1, 700, 700]}), f64], "big"),
            _node("ones.default", [_arg("size", {"as_ints": [1, 1, 24, 24]}), f64], "ker"),
            _node(op, [_arg("input", {"as_tensor": {"name": "big"}}),
                       _arg("weight", {"as_tensor": {"name": "ker"}}),
                       _arg("bias", {"as_none": True}), _arg("stride", {"as_ints": [1, 1]}),
                       _arg("padding", {"as_ints": [12, 12]})], "ones")]

    return _graph(change)


@pytest.mark.parametrize("op", ["conv2d.default", "conv_transpose2d.input"])
def test_convolution_buffers_count_against_the_budget(bait, tmp_path: Path, op: str) -> None:
    """The outputs were within the budget, so the audit ran to the end holding 2.6 GB (exit
    0); the unfolded input is now charged before the convolution runs."""
    path, records = bait
    evil = rewrite(path, tmp_path / "evil.pt2", _float64_convolution(op))
    with _at_most(2 * _GIB):
        line = _one_line(_audit(evil, records))
    assert f"(aten.{op})" in line and "above its budget of 132.3 MB" in line
    assert 2150 < float(line.split("asks for ")[1].split(" MB")[0]) < 2200


def test_graph_json_beyond_what_the_reader_parses_is_refused(bait, tmp_path: Path) -> None:
    """A model.json of 17 MiB (padded; a genuine export is 2-3 KB a node) is refused before
    it is parsed: 256 MiB of JSON took 6.4 GB to parse."""
    path, _ = bait

    def pad(entries: Entries) -> None:
        entries["models/model.json"] += b" " * (17 << 20)

    evil = rewrite(path, tmp_path / "evil.pt2", pad)
    with pytest.raises(CheckpointError, match=r"models/model.json unpacks to 1[0-9]{7} bytes, "
                                              r"more than the 16 MiB this reader parses"):
        load_exported_program(evil)


def test_payloads_unpacking_beyond_the_archive_are_refused(bait, tmp_path: Path) -> None:
    """1,000 weights of 40 KB of zeros each, deflated: each entry is smaller than the
    archive (the old check), together 40 MB from a 0.3 MB file, all read by the old reader."""
    path, _ = bait

    def inflate(entries: Entries) -> None:
        def add(config: Any) -> None:
            template = config["config"]["c"]
            for k in range(1000):
                meta = json.loads(json.dumps(template))
                meta["path_name"] = f"zeros{k}"
                meta["tensor_meta"].update(sizes=[{"as_int": 10_000}], strides=[{"as_int": 1}])
                config["config"][f"z{k}"] = meta

        edit_json(entries, "data/weights/model_weights_config.json", add)
        for k in range(1000):
            entries[f"data/weights/zeros{k}"] = bytes(40_000)

    evil = rewrite(path, tmp_path / "evil.pt2", inflate, zipfile.ZIP_DEFLATED)
    assert evil.stat().st_size < 400_000
    with pytest.raises(CheckpointError, match=r"entries unpack to 4[0-9]{7} bytes, more than "
                                              r"the [0-9]+ of the archive"):
        load_exported_program(evil)
