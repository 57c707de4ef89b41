"""``audit --canary-scores FILE.npz``: exit 1 on a violation (with --fail-on-violation), 0 on
null scores, and one line with exit 2 on every bad file, nothing read with pickle."""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedlap_privacy.audit.canaries import score_file
from fedlap_privacy.cli.main import app

runner = CliRunner()
M = 1000


def _bits(m: int = M) -> np.ndarray:
    return np.random.default_rng(1).random(m) < 0.5


def _file(tmp_path: Path, name: str = "scores.npz", **arrays) -> Path:
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def _run(path: Path, *extra: str):
    return runner.invoke(app, ["audit", "--canary-scores", str(path), "--claimed-eps", "1",
                               "--delta", "1e-5", *extra])


def _fails(path: Path, *extra: str) -> str:
    result = _run(path, *extra)
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    return lines[0]


def test_separating_scores_exit_1_with_fail_on_violation(tmp_path: Path) -> None:
    bits = _bits()
    path = _file(tmp_path, scores=bits * 3.0 + 0.1, included=bits)
    result = _run(path, "--fail-on-violation", "--json", "--out", str(tmp_path / "report"))
    assert result.exit_code == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "violation" and report["epsilon_lower_bound"] > 3.5
    assert (tmp_path / "report" / "report.html").is_file()
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["epsilon_lower_bound"] == pytest.approx(report["epsilon_lower_bound"])
    assert _run(path).exit_code == 0  # a violation without --fail-on-violation: still 0


def test_null_scores_exit_0_and_table(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    path = _file(tmp_path, scores=rng.standard_normal(M), included=_bits().astype(np.int64))
    result = _run(path, "--fail-on-violation")
    assert result.exit_code == 0, result.stderr
    assert "consistent" in result.stdout and "epsilon lower bound" in result.stdout


def test_mechanism_flags_add_the_claim_curve_test(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    path = _file(tmp_path, scores=rng.standard_normal(M), included=_bits())
    result = _run(path, "--json", "--noise-multiplier", "1", "--sample-rate", "0.01",
                  "--steps", "1000")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["claim"]["mechanism"] == {"noise_multiplier": 1.0, "sample_rate": 0.01,
                                            "steps": 1000}
    assert 0.05 < report["claim_curve_p_value"] <= 1.0
    assert "claim-curve" in report["one_run"]["methods"]
    assert "all of --noise-multiplier" in _fails(path, "--steps", "10")
    assert "noise multiplier" in _fails(path, "--noise-multiplier", "nan", "--sample-rate",
                                        "0.1", "--steps", "10")


class _MakesMarker:
    """Pickles to code that creates ``marker``: it would run if the file were unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _zip_with(tmp_path: Path, members: dict[str, bytes]) -> Path:
    path = tmp_path / "forged.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def _npy(header: dict, body: bytes = b"") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + body


def test_bad_files_one_line_exit_2(tmp_path: Path) -> None:
    bits = _bits(20)
    cases = {
        "needs arrays 'scores' and 'included'": _file(tmp_path, "a.npz", scores=np.zeros(20)),
        "differ in length": _file(tmp_path, "b.npz", scores=np.zeros(20), included=bits[:19]),
        "NaN or infinite": _file(tmp_path, "c.npz", scores=np.r_[np.nan, np.zeros(19)],
                                 included=bits),
        "NaN or infinite ": _file(tmp_path, "d.npz", scores=np.r_[np.inf, np.zeros(19)],
                                  included=bits),
        "only 0 and 1": _file(tmp_path, "e.npz", scores=np.zeros(20),
                              included=np.r_[2, np.zeros(19, int)]),
        "booleans or the integers 0 and 1": _file(tmp_path, "f.npz", scores=np.zeros(20),
                                                  included=bits + 0.0),
        "must be 1-D": _file(tmp_path, "g.npz", scores=np.zeros((20, 2)), included=bits),
        "must be 1-D ": _file(tmp_path, "h.npz", scores=np.zeros(20),
                              included=bits[:, None]),
        "expected plain numbers": _file(tmp_path, "i.npz", scores=np.array(["a"] * 20),
                                        included=bits),  # the one .npz reader's refusal
        "at least 10 canaries": _file(tmp_path, "j.npz", scores=np.zeros(3),
                                      included=bits[:3]),
        "not an .npz archive": tmp_path / "k.npz",
        "no canary-score file": tmp_path / "missing.npz",
    }
    (tmp_path / "k.npz").write_bytes(np.random.default_rng(0).bytes(512))
    for expected, path in cases.items():
        assert expected.strip() in _fails(path), expected


def test_a_pickled_object_array_is_refused_unread(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    scores = np.array([_MakesMarker(marker)] + [0.0] * 19, dtype=object)
    path = _file(tmp_path, scores=scores, included=_bits(20))
    assert "holds Python objects" in _fails(path)
    assert not marker.exists()
    np.load(path, allow_pickle=True)["scores"]  # the attack is real: unpickling runs it
    assert marker.exists()


def test_forged_headers_and_bombs_are_refused(tmp_path: Path) -> None:
    huge = _npy({"descr": "<f8", "fortran_order": False, "shape": (10**12,)})
    bits = _npy({"descr": "|b1", "fortran_order": False, "shape": (20,)}, bytes(20))
    # read by the one .npz reader (fedlap_privacy.data.npz_reader): a header the member's size
    # does not back is refused before any count is believed
    assert "truncated or forged" in _fails(
        _zip_with(tmp_path, {"scores.npy": huge, "included.npy": bits}))
    many = score_file.MAX_CANARIES + 1  # within the reader's bytes per array
    scores = _npy({"descr": "<f8", "fortran_order": False, "shape": (20,)}, bytes(160))
    bools = _npy({"descr": "|b1", "fortran_order": False, "shape": (many,)}, bytes(many))
    assert f"declares {many:,} canaries" in _fails(
        _zip_with(tmp_path, {"scores.npy": scores, "included.npy": bools}))
    bomb = _npy({"descr": "<f8", "fortran_order": False, "shape": (many,)},
                bytes(8 * many))  # 8 MB of zeros deflated to a few KB
    assert f"above the limit of {8 * (many - 1):,} bytes per array" in _fails(
        _zip_with(tmp_path, {"scores.npy": bomb, "included.npy": bits}))
    # a member far longer than its header declares (a zip bomb of zeros): never read past it
    long = _npy({"descr": "<f8", "fortran_order": False, "shape": (20,)}, bytes(50 * 2**20))
    assert "truncated or forged" in _fails(
        _zip_with(tmp_path, {"scores.npy": long, "included.npy": bits}))
    short = _npy({"descr": "<f8", "fortran_order": False, "shape": (20,)}, bytes(8))
    assert "truncated or forged" in _fails(
        _zip_with(tmp_path, {"scores.npy": short, "included.npy": bits}))


def test_a_duplicated_member_is_refused(tmp_path: Path) -> None:
    bits = _npy({"descr": "|b1", "fortran_order": False, "shape": (20,)}, bytes(20))
    honest = _npy({"descr": "<f8", "fortran_order": False, "shape": (20,)}, bytes(160))
    path = tmp_path / "twice.npz"
    with zipfile.ZipFile(path, "w") as z, pytest.warns(UserWarning, match="Duplicate name"):
        z.writestr("scores.npy", honest)
        z.writestr("scores.npy", honest)
        z.writestr("included.npy", bits)
    assert "holds array 'scores' twice" in _fails(path)


def test_a_file_above_the_size_cap_is_refused(tmp_path: Path, monkeypatch) -> None:
    path = _file(tmp_path, scores=np.zeros(20), included=_bits(20))
    monkeypatch.setattr(score_file, "MAX_FILE_BYTES", 100)
    assert "a canary-score file may have" in _fails(path)


def test_flags_that_do_not_fit(tmp_path: Path) -> None:
    path = _file(tmp_path, scores=np.zeros(20), included=_bits(20))
    result = runner.invoke(app, ["audit", "--canary-scores", str(path), "--claimed-eps", "1"])
    assert result.exit_code == 2 and "--delta" in result.stderr
    assert "drop --model" in _fails(path, "--model", str(tmp_path / "x.pt"))
    assert "delta must lie in (0, 1)" in runner.invoke(app, [
        "audit", "--canary-scores", str(path), "--claimed-eps", "1", "--delta", "2"]).stderr
    result = runner.invoke(app, ["audit"])
    assert result.exit_code == 2 and "--canary-scores" in result.stderr


def test_dry_run_checks_the_file_and_writes_nothing(tmp_path: Path) -> None:
    path = _file(tmp_path, scores=np.zeros(20), included=_bits(20))
    result = _run(path, "--dry-run", "--out", str(tmp_path / "report"))
    assert result.exit_code == 0, result.stderr
    assert "dry run" in result.stdout and "20 canary scores" in result.stdout
    assert not (tmp_path / "report").exists()
    plan = json.loads(_run(path, "--dry-run", "--json").stdout)
    assert plan["dry_run"] is True and plan["canaries"] == 20
    bad = _file(tmp_path, "bad.npz", scores=np.zeros(20))
    assert "needs arrays" in _fails(bad, "--dry-run")


def test_a_file_name_with_markup_is_text_in_the_report(tmp_path: Path) -> None:
    """An attacker names the scores file with HTML (and a mathtext `$`): report.md and
    report.html show the name as text, and the figure still draws."""
    bits = _bits()
    name = "<img src=x onerror=alert(1)>$x.npz"
    path = _file(tmp_path, name, scores=np.random.default_rng(2).normal(size=M), included=bits)
    out = tmp_path / "report"
    assert _run(path, "--out", str(out)).exit_code == 0
    for report in ("report.md", "report.html"):
        text = (out / report).read_text()
        assert "<img src=x" not in text and "&lt;img src=x" in text, report
    assert (out / "scores.png").stat().st_size > 0


def test_the_one_npz_reader_refuses_extra_members_and_fifos(tmp_path: Path) -> None:
    """issue 46: the score file is read by the package's one .npz reader, like --data."""
    extra = _file(tmp_path, "extra.npz", scores=np.zeros(20), included=_bits(20),
                  other=np.zeros(3))
    assert "member 'other.npy' is not one of the arrays" in _fails(extra)
    fifo = tmp_path / "fifo.npz"
    os.mkfifo(fifo)
    assert "not a regular file (a FIFO)" in _fails(fifo)  # refused, never blocks
