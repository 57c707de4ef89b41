"""The Flower driver: the same training as :mod:`~fedlap_privacy.fl.engine.simulation`, across
machines.

One implementation, two drivers: the ServerApp runs :func:`simulation.train` (or
``resume``) with Flower messages as its ``ask_clients``; each SuperNode's ClientApp runs the
method's client step on the partition it holds. The code lives in
:mod:`fedlap_privacy.fl.flower` (split by job: codec, run config, node policy, client app,
server app, deployment); this module re-exports its public names and keeps
``python -m fedlap_privacy.fl.engine.flower_app DIR`` (write the Flower App into DIR).
"""

from __future__ import annotations

import sys

from fedlap_privacy.fl.flower.client_app import client_app
from fedlap_privacy.fl.flower.codec import decode_state, encode_state
from fedlap_privacy.fl.flower.deployment import LocalDeployment, Secure
from fedlap_privacy.fl.flower.grid_clients import (
    ClientFailure,
    FlowerClients,
    FlowerError,
    expected_partitions,
)
from fedlap_privacy.fl.flower.node_ledger import NodeLedger
from fedlap_privacy.fl.flower.policy import NodePolicy, PolicyRefusal
from fedlap_privacy.fl.flower.run_config import (
    DRIVER_DEFAULTS,
    config_from_run_config,
    run_config_of,
    write_app,
)
from fedlap_privacy.fl.flower.runner import FlowerResult, run_flower, run_on
from fedlap_privacy.fl.flower.server_app import STATUS, server_app

__all__ = [
    "DRIVER_DEFAULTS", "STATUS", "ClientFailure", "FlowerClients", "FlowerError",
    "FlowerResult", "LocalDeployment", "NodeLedger", "NodePolicy", "PolicyRefusal", "Secure",
    "client_app", "config_from_run_config", "decode_state",
    "encode_state", "expected_partitions", "run_config_of", "run_flower", "run_on",
    "server_app", "write_app",
]


def main(argv: list[str] | None = None) -> None:
    """``python -m fedlap_privacy.fl.engine.flower_app DIR``: write the Flower App into DIR."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m fedlap_privacy.fl.engine.flower_app APP_DIR", file=sys.stderr)
        raise SystemExit(2)
    path = write_app(args[0])
    print(f"Flower App written to {path}: flwr run {path} <connection> --run-config '...'")


if __name__ == "__main__":
    main()
