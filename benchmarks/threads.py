"""The thread policy (``fedlap_privacy.threads``) against torch's default, under contention.

Times one default digits FedLAP-DP client round (paper Algorithm 3, Wang et al., PoPETs
2024; the ``fedlap-privacy train`` default configuration, client 0) in four situations, in
ONE process: alone and with one competing busy process (a spinning Python process), each with
torch's default intra-op threads and with the policy's ``threads_for(workers=2)`` (the round
and the competing process share the machine). Prints wall times and the ratio
"with a competing process / alone" for each thread setting; the policy should keep it near
or below 2 while oversubscribed OpenMP threads spin.

    python benchmarks/threads.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from fedlap_privacy.data import load_dataset
from fedlap_privacy.fl.augment import DSA
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.fedlap import client_approximation, init_synthetic
from fedlap_privacy.fl.simulation import client_parts, default_model_config
from fedlap_privacy.models import build_model
from fedlap_privacy.threads import threads_for, usable_cpus

SPIN = "while True:\n    pass\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
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


if __name__ == "__main__":
    main()
