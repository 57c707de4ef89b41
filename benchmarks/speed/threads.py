"""The thread policy (``fedlap_privacy.compute.threads``) against torch's default, under contention.

Times one default digits FedLAP-DP client round (paper Algorithm 3, Wang et al., PoPETs
2024; the ``fedlap-privacy train`` default configuration, client 0) in four situations, in
ONE process: alone and with one competing busy process (a spinning Python process), each with
torch's default intra-op threads and with the policy's ``threads_for(workers=2)`` (the round
and the competing process share the machine). Prints wall times and the ratio
"with a competing process / alone" for each thread setting; the policy should keep it near
or below 2 while oversubscribed OpenMP threads spin.

Then times the whole default ``fedlap-privacy train --rounds 2`` (a fresh process each time,
after one warm-up run) alone and beside one busy torch process (training-like small
convolutions and matrix products on torch's default threads): with the package's default,
threads that follow the load (``fedlap_privacy.compute.threads.LoadFollower``); with the thread
count fixed (torch's GNU OpenMP threads spin a few milliseconds before they sleep); fixed and
waiting passively (``OMP_WAIT_POLICY=PASSIVE``); and with one thread. A run slower than
``--cap`` seconds is stopped and reported as at least the cap.

    python benchmarks/speed/threads.py [--repeats 2] [--whole-run-repeats 1] [--cap 150]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedlap_privacy.compute.threads import threads_for, usable_cpus
from fedlap_privacy.data.datasets import load_dataset
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.simulation import client_parts, default_model_config
from fedlap_privacy.fl.methods.augment import DSA
from fedlap_privacy.fl.methods.fedlap import client_approximation, init_synthetic
from fedlap_privacy.models import build_model

SPIN = "while True:\n    pass\n"
#: one busy torch process on torch's default threads: a training-like loop of small operations
BUSY_TORCH = (
    "import torch\n"
    "x = torch.randn(64, 16, 14, 14); w = torch.randn(16, 16, 3, 3); m = torch.randn(256, 256)\n"
    "while True:\n"
    "    torch.nn.functional.conv2d(x, w, padding=1).relu_(); m @ m\n"
)
#: environment of each whole-run setting (on top of the caller's, less these variables)
WAIT_SETTINGS = {
    "package default (threads follow the load)": {},
    "fixed threads (FEDLAP_FOLLOW_LOAD=0)": {"FEDLAP_FOLLOW_LOAD": "0"},
    "fixed threads, OMP_WAIT_POLICY=PASSIVE": {"FEDLAP_FOLLOW_LOAD": "0",
                                               "OMP_WAIT_POLICY": "PASSIVE"},
    "one thread": {"OMP_NUM_THREADS": "1"},
}
_CLEARED = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
            "FEDLAP_FOLLOW_LOAD", "FEDLAP_FAST_PATHS")


def train_seconds(extra_env: dict[str, str], cap: float) -> float:
    """Wall time of ``fedlap-privacy train --rounds 2`` in a fresh process (at most ``cap``)."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED} | extra_env
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "fedlap_privacy", "train", "--rounds", "2",
               "--out", str(Path(tmp) / "run")]
        start = time.perf_counter()
        try:
            subprocess.run(cmd, env=env, check=True, timeout=cap, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return cap
        return time.perf_counter() - start


def whole_runs(repeats: int, cap: float) -> None:
    """The wait-policy table of the module docstring."""
    print(f"default 2-round train, whole process, wall time (cap {cap:.0f} s)")
    train_seconds({}, cap)  # warm-up: file caches, compiled kernels, imports
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(repeats):
        for busy in (False, True):
            competitor = (subprocess.Popen([sys.executable, "-c", BUSY_TORCH]) if busy
                          else None)
            try:
                for name, extra in WAIT_SETTINGS.items():
                    times.setdefault((name, busy), []).append(train_seconds(extra, cap))
            finally:
                if competitor is not None:
                    competitor.kill()
                    competitor.wait()
    for name in WAIT_SETTINGS:
        alone = statistics.median(times[(name, False)])
        busy = statistics.median(times[(name, True)])
        at_least = ">=" if busy >= cap else "  "
        print(f"  {name:42s} alone {alone:6.1f} s   beside a busy torch process "
              f"{at_least}{busy:6.1f} s   ratio {at_least}{busy / alone:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--whole-run-repeats", type=int, default=1)
    parser.add_argument("--cap", type=float, default=150.0)
    args = parser.parse_args()
    cfg = TrainConfig()
    data = load_dataset("digits")
    part = client_parts(cfg, data)[0]
    x, y = torch.from_numpy(data.x_train[part]), torch.from_numpy(data.y_train[part])
    torch.manual_seed(0)
    model = build_model(default_model_config(cfg, data))
    dsa = DSA().draw

    def round_time() -> float:
        gen = torch.Generator().manual_seed(1)
        syn = init_synthetic(x, y, cfg.ipc, cfg.init, gen)
        start = time.perf_counter()
        client_approximation(model, x, y, syn, cfg, cfg.lr_net, gen, dsa)
        return time.perf_counter() - start

    default = torch.get_num_threads()
    policy = threads_for(2, env={})  # the round and one competing process
    settings = {f"torch default ({default} threads)": default,
                f"policy, workers=2 ({policy} thread(s))": policy}
    print(f"digits client round, {usable_cpus()} usable CPUs, load average "
          f"{os.getloadavg()[0]:.2f}")
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.repeats):
        for busy in (False, True):
            spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
            try:
                for name, n in settings.items():
                    torch.set_num_threads(n)
                    round_time()  # warm-up at this thread count
                    times.setdefault((name, busy), []).append(round_time())
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
    torch.set_num_threads(default)
    for name in settings:
        alone = statistics.median(times[(name, False)])
        busy = statistics.median(times[(name, True)])
        print(f"  {name:32s} alone {alone:6.2f} s   with a busy process {busy:6.2f} s   "
              f"ratio {busy / alone:5.2f}")
    if args.whole_run_repeats > 0:
        whole_runs(args.whole_run_repeats, args.cap)


if __name__ == "__main__":
    main()
