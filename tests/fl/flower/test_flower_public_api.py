"""The package uses Flower through its public API only (issue 58): every ``flwr`` import in
the package's code names a module Flower documents for users, never ``flwr.supercore``,
``flwr.supernode``, ``flwr.superlink``, ``flwr.proto`` or another internal one."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
#: the package's code (tests and benchmarks are not shipped)
PACKAGE_DIRS = ("accountant", "audit", "cli", "fedlap_privacy", "fl")
#: Flower's public modules: the app APIs, the Simulation Engine's entry point, the legacy
#: client and server APIs (strategies and the types in their signatures), records/typing
PUBLIC = ("flwr.app", "flwr.clientapp", "flwr.serverapp", "flwr.simulation", "flwr.common",
          "flwr.client", "flwr.server.strategy", "flwr.server.client_manager",
          "flwr.server.client_proxy")
EXACT = ("flwr", "flwr.server")
PRIVATE_PARTS = ("supercore", "supernode", "superlink", "proto", "ray_transport", "linkstate")


def private_imports(source: str) -> list[str]:
    """The ``flwr`` modules ``source`` imports that are not public (see :data:`PUBLIC`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name != "flwr" and not name.startswith("flwr."):
                continue
            public = name in EXACT or any(name == p or name.startswith(p + ".")
                                          for p in PUBLIC)
            if not public or any(part in PRIVATE_PARTS for part in name.split(".")):
                found.append(name)
    return found


def test_the_check_catches_the_imports_the_package_had():
    assert private_imports("from flwr.supercore.task_identity import TaskIdentity") == [
        "flwr.supercore.task_identity"]
    assert private_imports("import flwr.supernode.start_client_internal as loop") == [
        "flwr.supernode.start_client_internal"]
    assert private_imports(
        "def f():\n    from flwr.simulation.ray_transport.ray_actor import x\n") == [
        "flwr.simulation.ray_transport.ray_actor"]
    assert private_imports("from flwr.server.superlink.fleet.vce import vce_api") == [
        "flwr.server.superlink.fleet.vce"]
    assert private_imports("from flwr.app import Message\nfrom flwr.serverapp import Grid\n"
                           "from flwr.simulation import run_simulation") == []


def test_the_package_imports_only_flowers_public_api():
    files = [path for folder in PACKAGE_DIRS for path in (ROOT / folder).rglob("*.py")]
    assert len(files) > 50  # the package's code was found
    found = {str(path.relative_to(ROOT)): names for path in files
             if (names := private_imports(path.read_text()))}
    assert found == {}
