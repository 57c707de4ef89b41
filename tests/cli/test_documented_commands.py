"""Every ``fedlap-privacy ...`` command README.md and docs/ show runs, and so do the README's
Python examples.

The commands come from the fenced shell blocks and from inline code in the prose; ``train``,
``compare`` and ``audit`` run with ``--dry-run`` added (every flag parsed, every setting and
input file checked, the configuration resolved), ``plan`` runs for real. A flag that no
longer exists or a refused configuration fails here. They run in-process (typer's
CliRunner) in a folder holding what they read: a one-round run in runs/latest (and a copy
as runs/flower), miniature FashionMNIST files, record files for the external audits, the
files the documentation's own snippets write (``python - <<'PY'`` blocks, and Python blocks
headed ``# NAME.py``), and, for each documented ``audit --model RUN/ckpt.pt``, the run a
documented ``train --out RUN`` makes (trained for real, one round). The
round and feature timings of the dry runs are replaced by a constant (they are tested in
test_dry_run.py). Commands a test cannot run are in :data:`NOT_RUN`, with the reason.
"""

from __future__ import annotations

import re
import shlex
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import write_mini_mnist
from helpers import repo_root
from typer.testing import CliRunner

from fedlap_privacy.cli.main import app

DRY_RUN = ("train", "compare", "audit")
#: commands shown with placeholders (capital letters, "...") instead of values
NOT_RUN = {
    "fedlap-privacy plan --eps 3 --rounds 1 --client-size 1600 --batch-size 64 --local-steps T "
    "--threat-model server": "placeholder T (accesses per round)",
    "fedlap-privacy plan --eps 3 --rounds M --client-size 1600 --batch-size B --local-steps T":
        "placeholders M, B and T",
    "fedlap-privacy train --method fedavg --dataset fashion-mnist --data-dir data/fashion-mnist "
    "--clients 3000 --split shards --client-fraction 0.0333333 --rounds 5 --batch-size 10 "
    "--local-steps 10 --set lr_local=0.1 --set width=32 --set depth=2":
        "3,000 clients need FashionMNIST's 60,000 records; the test's miniature has 200 (the "
        "700-client digits command beside it is run)",
    "fedlap-privacy audit --reference-models N": "placeholder N; the full command is shown "
                                                 "in a fenced block",
    "fedlap-privacy audit --model FILE --members ... --nonmembers ...":
        "placeholders; the full commands are shown in a fenced block",
}
#: commands that run for real and take tens of seconds: marked slow (run with -m slow)
SLOW: dict[str, str] = {}


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) of every ``fedlap-privacy`` command in the fenced shell blocks and the
    inline code of README.md and docs/*.md; backslash continuations joined, comments and
    the optional-flag brackets ``[--json]`` dropped."""
    root = repo_root()
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    found: list[tuple[str, str]] = []
    for path in files:
        text = path.read_text()
        for block in re.finditer(r"^```(?:bash|sh|shell|console)\n(.*?)^```", text, re.S | re.M):
            joined = block.group(1).replace("\\\n", " ")
            for line in joined.splitlines():
                command = re.sub(r"\s#.*$", "", line).strip()
                command = re.sub(r"^\.venv/bin/", "", command)
                if command.startswith("fedlap-privacy "):
                    found.append((path.name, command))
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for span in re.finditer(r"`(fedlap-privacy\s+[a-z]+\s+--[^`]+)`", prose):
            found.append((path.name, " ".join(span.group(1).split())))
    return [(where, " ".join(c.replace("[", "").replace("]", "").split()))
            for where, c in found]



def first_places() -> dict[str, str]:
    """Each documented command once, with the file that shows it first (the README repeats
    commands of the pages)."""
    places: dict[str, str] = {}
    for where, command in documented_commands():
        places.setdefault(command, where)
    return places

def documented_files() -> tuple[list[str], dict[str, str]]:
    """What the documentation's snippets write: the code of every ``python - <<'PY'`` block
    of its shell blocks, and each Python block headed ``# NAME.py`` (NAME.py -> its text)."""
    root = repo_root()
    scripts: list[str] = []
    modules: dict[str, str] = {}
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = path.read_text()
        for block in re.finditer(r"^```(?:bash|sh|shell)\n(.*?)^```", text, re.S | re.M):
            scripts += re.findall(r"^python3? - <<'PY'\n(.*?)^PY$", block.group(1), re.S | re.M)
        for block in re.finditer(r"^```python\n# ([\w.]+\.py)\n(.*?)^```", text, re.S | re.M):
            modules[block.group(1)] = block.group(2)
    return scripts, modules


def _documented_runs(folder: Path) -> None:
    """In ``folder``: each run a documented audit reads, made by the documented train that
    writes it, for real and for one round."""
    commands = [shlex.split(c)[1:] for c in first_places()]
    audited = {Path(a[a.index("--model") + 1]).parent for a in commands
               if a[0] == "audit" and "--model" in a and a[a.index("--model") + 1].endswith(
                   "ckpt.pt")}
    for args in commands:
        if args[0] == "train" and "--out" in args and Path(args[args.index("--out") + 1]) in (
                audited - {Path("runs/latest"), Path("runs/flower")}):
            run = CliRunner().invoke(app, [*args, "--rounds", "1"])
            assert run.exit_code == 0, f"{shlex.join(args)}\n{run.output}"


def _workspace(root: Path) -> None:
    """What the commands read, in ``root`` (their working folder): ``fresh/`` as a fresh
    clone with the dataset files, ``used/`` as after ``train`` (for --resume and audit)."""
    for folder in ("fresh", "used"):
        write_mini_mnist(root / folder / "data" / "fashion-mnist", n_train=2600, n_test=100)
    scripts, modules = documented_files()
    for folder in ("fresh", "used"):
        for script in scripts:
            subprocess.run([sys.executable, "-"], input=script, text=True, check=True,
                           cwd=root / folder)
        for name, text in modules.items():
            (root / folder / name).write_text(text)
    root = root / "used"
    _documented_runs(root)
    run = CliRunner().invoke(app, [
        "train", "--method", "dp-fedavg", "--target-eps", "5", "--rounds", "1", "--set",
        "width=4", "--set", "local_steps=1", "--canaries", "10", "--out", "runs/latest"])
    assert run.exit_code == 0, run.output
    shutil.copytree(root / "runs" / "latest", root / "runs" / "flower")
    rng = np.random.default_rng(0)
    for name in ("train.npz", "holdout.npz"):
        np.savez(root / name, x=rng.standard_normal((40, 1, 28, 28)).astype(np.float32),
                 y=np.arange(40) % 10)
    for stem, n in (("train", 60), ("t10k", 40)):
        images = struct.pack(">4i", 2051, n, 28, 28) + bytes(n * 28 * 28)
        labels = struct.pack(">2i", 2049, n) + bytes(n)
        (root / f"{stem}-images-idx3-ubyte.gz").write_bytes(__import__("gzip").compress(images))
        (root / f"{stem}-labels-idx1-ubyte.gz").write_bytes(__import__("gzip").compress(labels))
    # the dry run checks that the model files exist; it does not load them
    (root / "model.pt2").write_bytes(b"PK")
    (root / "weights.pt").write_bytes(b"PK")
    (root / "mynet.py").write_text("def build():\n    raise RuntimeError('never run')\n")


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("documented")
    with pytest.MonkeyPatch.context() as mp:
        (root / "used").mkdir()
        mp.chdir(root / "used")
        _workspace(root)
    return root


def test_the_documentation_shows_commands_of_every_kind():
    commands = [c for _, c in documented_commands()]
    for sub in ("plan", "train", "compare", "audit"):
        assert any(c.startswith(f"fedlap-privacy {sub} ") for c in commands), sub
    assert "fedlap-privacy compare --dataset digits --eps 3,10" in commands
    assert all(c in commands for c in NOT_RUN), "a NOT_RUN entry is no longer documented"


@pytest.mark.parametrize("where,command", [
    pytest.param(where, command, id=f"{where}: {command}"[:100],
                 marks=[pytest.mark.slow] if command in SLOW else [])
    for command, where in first_places().items() if command not in NOT_RUN
])
def test_documented_command_runs(where, command, workspace, monkeypatch):
    from fedlap_privacy.audit.reports import dry_run as audit_dry_run
    from fedlap_privacy.fl.engine import dry_run
    from fedlap_privacy.fl.engine.dry_run import RoundTiming

    if "--engine flower" in command:
        pytest.importorskip("flwr", reason="--engine flower needs the flower extra")
    args = shlex.split(command)[1:]
    # a new run starts in a fresh clone; --resume and audit read the run train wrote
    workspace = workspace / ("used" if "--resume" in args or args[0] == "audit" else "fresh")
    monkeypatch.chdir(workspace)
    monkeypatch.setattr(dry_run, "time_steps",
                        lambda cfg, data, device: RoundTiming(1.0, 1.0, 0.1, 1.0, 0.0, "cpu"))
    monkeypatch.setattr(audit_dry_run, "time_features", lambda *args: 1.0)
    if args[0] in DRY_RUN:
        args.append("--dry-run")
    before = _listing(workspace)
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, f"{where}: {command}\n{result.output}"
    assert "Traceback" not in result.output
    if args[0] in DRY_RUN:
        assert "dry run" in result.output or '"dry_run": true' in result.output
        assert _listing(workspace) == before, f"{command} wrote into its folder"


def test_the_readme_python_examples_run(tmp_path):
    """The Python blocks of the README and the getting-started page (a newcomer's first
    code) run as shown, in a fresh folder; the training example for one round instead of
    five. Each printed line of the training example is an accuracy and an epsilon."""
    root = repo_root()
    blocks = list(dict.fromkeys(
        block for path in (root / "README.md", root / "docs" / "getting-started.md")
        for block in re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)))
    trains = [b for b in blocks if "train(" in b]
    assert trains, "the README shows no training from Python"
    for block in blocks:
        code = block.replace("rounds=5", "rounds=1")
        done = subprocess.run([sys.executable, "-"], input=code, text=True, cwd=tmp_path,
                              capture_output=True)
        assert done.returncode == 0, f"{block}\n{done.stderr}"
        if block in trains:
            accuracy, epsilon = map(float, done.stdout.split())
            assert 0.0 <= accuracy <= 1.0 and epsilon > 0.0, done.stdout
        shutil.rmtree(tmp_path / "runs", ignore_errors=True)
