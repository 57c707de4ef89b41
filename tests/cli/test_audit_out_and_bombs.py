"""What an audit writes cannot be turned by another local user or a crafted score file: an
``--out`` that is a link, a training run's folder or everyone's is refused in one line; a
file swapped for a link mid-write never reaches report.html; a score file of millions of
zeros is refused or audited within 2 GB and 60 s, with a small report.json and ``--json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedlap_privacy.audit.canaries.score_audit import MAX_CANARIES, audit_canary_scores
from fedlap_privacy.audit.reports import report_folder
from fedlap_privacy.cli.main import app
from fedlap_privacy.errors import ConfigError

SECRET = b"the victim's private key"


def _coins(m: int = 1000) -> np.ndarray:
    return np.random.default_rng(3).random(m) < 0.5


def _scores_file(tmp_path: Path) -> Path:
    path = tmp_path / "scores.npz"
    bits = _coins()
    np.savez(path, scores=bits + np.random.default_rng(4).random(1000), included=bits)
    return path


def _one_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def _audit(path: Path, out: Path):
    return CliRunner().invoke(app, ["audit", "--canary-scores", str(path), "--claimed-eps", "1",
                                    "--delta", "1e-5", "--out", str(out)])


def test_an_out_that_is_a_link_a_run_folder_or_everyones_is_refused(tmp_path: Path) -> None:
    path = _scores_file(tmp_path)
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    assert "symbolic link" in _one_line(_audit(path, link))
    assert not any(target.iterdir())
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.lock").write_text("")
    assert "holds a training run (run.lock)" in _one_line(_audit(path, run))
    assert sorted(p.name for p in run.iterdir()) == ["run.lock"]
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert "writable by every user" in _one_line(_audit(path, shared))
    fine = tmp_path / "fine"
    result = _audit(path, fine)
    assert result.exit_code == 0, result.stderr
    assert {p.name for p in fine.iterdir()} == {"report.json", "report.md", "report.html",
                                                "scores.png"}


def test_a_figure_swapped_for_a_link_never_reaches_the_report(tmp_path: Path,
                                                               monkeypatch) -> None:
    """Another user replaces scores.png by a link to a file of the victim's between the
    write and the page: the page embeds the bytes the audit drew, not what the name holds."""
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    write = report_folder.ReportFolder.write

    def swapped(self, name: str, data: bytes) -> Path:
        path = write(self, name, data)
        if name == "scores.png":
            path.unlink()
            path.symlink_to(secret)
        return path

    monkeypatch.setattr(report_folder.ReportFolder, "write", swapped)
    out = tmp_path / "out"
    bits = _coins()
    audit_canary_scores(bits + 0.5 * np.random.default_rng(5).random(1000), bits,
                        claimed_epsilon=1.0, delta=1e-5, out=out)
    page = (out / "report.html").read_text()
    import base64

    assert base64.b64encode(SECRET).decode() not in page
    assert "data:image/png;base64,iVBOR" in page  # the figure the audit drew


def test_a_folder_swapped_for_a_link_after_the_check_is_not_followed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with report_folder.ReportFolder(out) as folder:
        out.rename(tmp_path / "moved")
        out.symlink_to(elsewhere)
        folder.write_text("report.md", "x")
    assert not any(elsewhere.iterdir())
    assert (tmp_path / "moved" / "report.md").read_text() == "x"
    with pytest.raises(ConfigError, match="symbolic link"):
        report_folder.ReportFolder(out)


def test_the_88_kb_file_of_ten_million_zeros_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bomb.npz"
    np.savez_compressed(path, scores=np.zeros(10**7), included=np.zeros(10**7, dtype=bool))
    assert path.stat().st_size < 100_000
    result = CliRunner().invoke(app, ["audit", "--canary-scores", str(path), "--claimed-eps",
                                      "1", "--delta", "1e-5"])
    assert "bytes per array" in _one_line(result)


_MEASURE = """
import json, resource, subprocess, sys, time
start = time.time()
done = subprocess.run(sys.argv[1:], capture_output=True)
used = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"rc": done.returncode, "seconds": time.time() - start, "bytes": used,
                  "stdout": len(done.stdout), "stderr": done.stderr.decode()[-500:]}))
"""


def test_the_largest_score_file_stays_within_2_gb_and_60_s(tmp_path: Path) -> None:
    """2^20 tied scores (the most an audit takes, 10 KB compressed): audited with its
    report in seconds and a few hundred MB; report.json and --json stay small."""
    path = tmp_path / "big.npz"
    np.savez_compressed(path, scores=np.zeros(MAX_CANARIES),
                        included=np.arange(MAX_CANARIES) % 2 == 0)
    assert path.stat().st_size < 100_000
    cli = [sys.executable, "-c", "from fedlap_privacy.cli.main import app; app()"]
    out = tmp_path / "report"
    measured = subprocess.run(
        [sys.executable, "-c", _MEASURE, *cli, "audit", "--canary-scores", str(path),
         "--claimed-eps", "1", "--delta", "1e-5", "--out", str(out), "--json"],
        capture_output=True, text=True, check=True, env={**os.environ, "COLUMNS": "100"})
    found = json.loads(measured.stdout)
    assert found["rc"] == 0, found
    assert found["seconds"] < 60 and found["bytes"] < 2 * 2**30, found
    assert found["stdout"] < 100_000, found
    assert (out / "report.json").stat().st_size < 100_000
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] != "violation"
    audit = report["one_run"]["audits"][0]
    assert "scores_in" not in audit and sum(audit["histogram"]["in"]) == MAX_CANARIES // 2
