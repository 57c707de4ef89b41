"""``fedlap-privacy plan`` run as a real process (``python -m fedlap_privacy.cli.main``).

Good input: one JSON object with every number of the plan, in each of the four modes.
Bad input: non-zero exit, exactly one line on stderr naming the offending value, no traceback.
``plan`` must not import torch.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from fedlap_privacy.accountant import FedLAPSchedule, epsilon, epsilon_curve, plan_sigma

DELTA = 1e-5
REFERENCE = FedLAPSchedule(batch_size=256, client_size=10000, local_steps=200)
KEYS = set(
    "accountant epsilon delta sigma rounds q1 q2 local_steps batch_size client_size "
    "client_fraction order curve".split()
)


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "fedlap_privacy.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def plan_json(*args: str) -> dict:
    proc = run_cli("plan", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1  # exactly one JSON object
    out = json.loads(lines[0])
    assert KEYS <= out.keys()
    return out


def test_plan_rounds_reproduces_the_paper() -> None:
    out = plan_json("--eps", "10.19", "--sigma", "1")
    assert out["rounds"] == 15
    assert out["accountant"] == "rdp"
    assert out["q1"] == out["q2"] == 0.0256
    assert (out["batch_size"], out["client_size"], out["local_steps"]) == (256, 10000, 200)
    assert out["client_fraction"] == 1.0 and out["delta"] == DELTA and out["sigma"] == 1.0
    assert round(out["epsilon"], 2) == 10.18
    assert len(out["curve"]) == 15 and round(out["curve"][0], 2) == 2.79
    assert out["order"] > 1
    # PLD's epsilon of the same sigma and rounds, printed beside Theorem 5.8's (8% tighter)
    by = out["epsilon_by_accountant"]
    assert list(by) == ["rdp", "pld"] and by["rdp"] == out["epsilon"]
    assert by["pld"] == pytest.approx(epsilon(REFERENCE, 1.0, 15, DELTA, accountant="pld"),
                                      rel=1e-12)
    assert by["pld"] == pytest.approx(9.375, abs=0.005)
    assert plan_json("--eps", "10.18", "--sigma", "1")["rounds"] == 14


def test_sigma_and_rounds_give_the_curve() -> None:
    out = plan_json("--sigma", "1", "--rounds", "27")
    assert out["rounds"] == 27 and out["sigma"] == 1.0
    assert out["curve"] == pytest.approx(list(epsilon_curve(REFERENCE, 1.0, 27, DELTA)), rel=1e-12)
    assert out["epsilon"] == pytest.approx(14.306, abs=5e-4)
    assert out["curve"][14] == pytest.approx(10.1830, abs=5e-5)


def test_eps_and_rounds_plan_sigma() -> None:
    out = plan_json("--eps", "8", "--rounds", "20")
    expected = plan_sigma(REFERENCE, 20, 8.0, DELTA)
    assert out["rounds"] == 20
    assert out["sigma"] == pytest.approx(expected, rel=1e-12)
    assert out["epsilon"] <= 8.0
    assert epsilon(REFERENCE, out["sigma"] / (1 + 2e-4), 20, DELTA) > 8.0


def test_eps_alone_plans_sigma_for_30_rounds() -> None:
    out = plan_json("--eps", "10")
    assert out["rounds"] == 30 and len(out["curve"]) == 30
    assert out["sigma"] == pytest.approx(plan_sigma(REFERENCE, 30, 10.0, DELTA), rel=1e-12)
    assert 1.2 < out["sigma"] < 1.35 and out["epsilon"] <= 10.0


def test_schedule_options_and_client_fraction() -> None:
    out = plan_json(
        *"--sigma 1.5 --rounds 5 --batch-size 64 --client-size 2000 --local-steps 30".split(),
        *"--client-fraction 0.25 --delta 1e-6 --threat-model hidden-selection".split(),
    )
    s = FedLAPSchedule(batch_size=64, client_size=2000, local_steps=30, client_fraction=0.25)
    assert out["q1"] == pytest.approx(0.25 * 64 / 2000) and out["q2"] == pytest.approx(0.032)
    assert out["client_fraction"] == 0.25 and out["delta"] == 1e-6
    assert out["epsilon"] == pytest.approx(epsilon(s, 1.5, 5, 1e-6), rel=1e-12)


def test_plan_holds_against_the_server_by_default_as_train_does() -> None:
    """One default adversary across commands: plan's epsilon, like train's, holds against
    the server (no amplification by client sampling); Theorem 5.8's is asked for."""
    args = ("--sigma 1.5 --rounds 5 --batch-size 64 --client-size 2000 --local-steps 1 "
            "--client-fraction 0.25")
    default = plan_json(*args.split())
    s = FedLAPSchedule(batch_size=64, client_size=2000, local_steps=1, client_fraction=1.0)
    assert default["threat_model"] == "server"
    assert default["epsilon"] == pytest.approx(epsilon(s, 1.5, 5, DELTA), rel=1e-12)
    hidden = plan_json(*args.split(), "--threat-model", "hidden-selection")
    assert hidden["epsilon"] < 0.7 * default["epsilon"]  # amplified: not against the server
    table = run_cli("plan", *args.split()).stdout
    assert "server (as train: the server knows whom it selected)" in table
    table = run_cli("plan", *args.split(), "--threat-model", "hidden-selection").stdout
    assert "not against the server" in table and "train's default" in table


def test_an_epsilon_far_above_the_usual_range_is_flagged_with_what_lowers_it() -> None:
    """The paper-dp preset's schedule on a small client (digits: ~288 records, B 256) plans
    an epsilon in the thousands: said, with why and what to change; a usual one is not."""
    args = "--sigma 1.2 --rounds 30 --batch-size 256 --client-size 288 --local-steps 200"
    proc = run_cli("plan", *args.split())
    assert proc.returncode == 0, proc.stderr
    warning = " ".join(proc.stderr.split())
    assert "above the usual range" in warning and "q2 = 0.89" in warning
    assert "--sigma" in warning and "--rounds" in warning and "--eps" in warning
    out = plan_json(*args.split())  # the warning inside the JSON object, stderr empty
    assert out["epsilon"] > 1000 and len(out["warnings"]) == 1
    quiet = run_cli("plan", "--eps", "10")
    assert quiet.returncode == 0 and "usual range" not in quiet.stderr + quiet.stdout


def test_pld_accountant() -> None:
    out = plan_json(
        *"--sigma 5 --rounds 3 --batch-size 10 --client-size 100 --local-steps 5".split(),
        *"--client-fraction 0.1 --accountant pld --threat-model hidden-selection".split(),
    )
    s = FedLAPSchedule(batch_size=10, client_size=100, local_steps=5, client_fraction=0.1)
    assert out["accountant"] == "pld" and out["order"] is None and len(out["curve"]) == 3
    pld = epsilon(s, 5.0, 3, DELTA, accountant="pld")
    assert out["epsilon"] == pytest.approx(pld, rel=1e-9)
    assert out["epsilon"] < epsilon(s, 5.0, 3, DELTA)
    assert out["epsilon_by_accountant"] == {"pld": out["epsilon"],
                                            "rdp": pytest.approx(epsilon(s, 5.0, 3, DELTA))}


def test_table_output() -> None:
    proc = run_cli("plan", "--eps", "10.19", "--sigma", "1")
    assert proc.returncode == 0, proc.stderr
    assert "10.1830" in proc.stdout and "2.7866" in proc.stdout and "holds" in proc.stdout
    assert "same sigma and rounds, PLD" in proc.stdout and "9.3771" in proc.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--eps", "0"], "epsilon 0.0"),
        (["--eps", "-1"], "epsilon -1.0"),
        (["--delta", "0"], "delta 0.0"),
        (["--delta", "1.5"], "delta 1.5"),
        (["--batch-size", "20000"], "20000"),
        (["--client-fraction", "0"], "client fraction 0.0"),
        (["--client-fraction", "1.5"], "client fraction 1.5"),
        (["--sigma", "0"], "sigma 0.0"),
        (["--sigma", "-2"], "sigma -2.0"),
        (["--sigma", "1", "--rounds", "0"], "rounds 0"),
        (["--sigma", "1", "--rounds", "-3"], "rounds -3"),
        (["--local-steps", "0"], "local steps 0"),
        (["--eps", "0.01", "--rounds", "30"], "epsilon 0.01"),  # below the order-grid floor
        (["--eps", "0.5", "--sigma", "0.5"], "epsilon 0.5"),  # one round already exceeds
        (["--sigma", "0.001", "--accountant", "pld"], "cannot discretise sigma 0.001"),
    ],
)
def test_bad_input_is_one_line_on_stderr(args: list[str], needle: str) -> None:
    # table and JSON output take the same path to the error; alternate them to save time
    extra = ["--json"] if len(needle) % 2 else []
    proc = run_cli("plan", *args, *extra)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip("\n").splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0]
    assert lines[0].startswith("error:")


#: the address space a costly plan's refusal must fit in (a plan of 30 rounds needs ~50 MB)
MEMORY_BOUND = 1536 << 20


def _bounded_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BOUND, MEMORY_BOUND))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        # 8.5 million planned rounds: the old plan built their 10 GB curve and was killed
        (["--eps", "1e6", "--sigma", "1"], "admits 8,503,642 rounds, above the 100,000"),
        (["--eps", "1e6", "--sigma", "1", "--json"], "admits 8,503,642 rounds"),
        # 10^8 rounds: the old plan asked for a 113 GiB array (MemoryError traceback)
        (["--rounds", "100000000"], "rounds 100,000,000 is above the 100,000"),
        (["--rounds", "100000000", "--eps", "3"], "rounds 100,000,000 is above"),
        (["--accountant", "pld", "--rounds", "5000"], "above the 1,000 whose epsilon curve"),
        # an order of 10^8: a 10^8-entry binomial table and as many lgamma calls
        (["--orders", "100000000"], "RDP orders up to 1e+08"),
    ],
)
def test_costly_plans_are_refused_in_one_line_within_bounded_memory(args, needle) -> None:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "fedlap_privacy.cli.main", "plan", *args],
        capture_output=True, text=True, timeout=120, env=env, check=False,
        preexec_fn=_bounded_memory,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout and proc.stdout == ""
    lines = proc.stderr.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr[-2000:]
    assert needle in lines[0]


def test_unreachable_rounds_still_prints_the_plan() -> None:
    proc = run_cli("plan", "--eps", "0.5", "--sigma", "0.5", "--json")
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert out["rounds"] == 0 and out["curve"] == [] and out["within_budget"] is False


def test_plan_does_not_import_torch() -> None:
    command = [sys.executable, "-X", "importtime", "-m", "fedlap_privacy.cli.main"]
    proc = subprocess.run(
        [*command, "plan", "--eps", "10"], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "import time:" in proc.stderr  # the import log is there ...
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert "numpy" in imported
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}  # ... no torch
    assert "opacus" not in imported


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("fedlap-privacy")
    if not script.exists():
        pytest.skip("console script not installed next to this interpreter")
    proc = subprocess.run(
        [str(script), "plan", "--eps", "10.19", "--sigma", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["rounds"] == 15


def test_secure_aggregation_plans_the_share_each_client_adds_against_the_server() -> None:
    """``plan --secure-aggregation``: the command prints what the accountant plans (the
    oracle-tested :func:`plan_distributed`), never below the central Gaussian's noise, and
    the epsilon it reaches is the target's or below."""
    from fedlap_privacy.accountant.distributed import plan_distributed

    args = ["--eps", "4", "--rounds", "1500", "--model-size", "65536",
            "--clients-per-round", "100"]
    for noise, bits in (("skellam", 16), ("discrete-gaussian", 20)):
        done = run_cli("plan", "--secure-aggregation", noise, *args, "--bits", str(bits),
                       "--json")
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
        want = plan_distributed(noise, epsilon=4, delta=1e-5, model_size=65536, clients=100,
                                rounds=1500, bits=bits)
        assert got["noise_multiplier"] == pytest.approx(want.noise_multiplier, rel=1e-12)
        assert got["threat_model"] == "server" and got["epsilon"] <= 4 + 1e-9
        assert got["ratio_to_central"] >= 1.0
    assert got["ratio_to_central"] < 1.02  # 20 bits: within 2% of central DP
    table = run_cli("plan", "--secure-aggregation", "skellam", *args, "--bits", "16")
    assert table.returncode == 0 and table.stderr == ""
    assert "price of not trusting the server" in table.stdout


@pytest.mark.parametrize(("args", "needle"), [
    (["--eps", "4", "--rounds", "10"], "--model-size, --clients-per-round"),
    (["--eps", "4", "--rounds", "10", "--model-size", "100", "--clients-per-round", "10",
      "--sigma", "1"], "drop --sigma"),
    (["--eps", "4", "--rounds", "1500", "--model-size", "1048576", "--clients-per-round",
      "100", "--bits", "16"], "use more bits"),
])
def test_secure_aggregation_refuses_in_one_line(args: list[str], needle: str) -> None:
    done = run_cli("plan", "--secure-aggregation", "skellam", *args)
    assert done.returncode == 2 and needle in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) <= 3
