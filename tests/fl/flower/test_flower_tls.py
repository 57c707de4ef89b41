"""A Flower round over TLS (a throw-away CA) with authenticated SuperNodes: registered nodes
run the round and keep their own ledgers; an unregistered node is refused by the SuperLink."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

flwr = pytest.importorskip("flwr")

from flower_grid import write_policy  # noqa: E402

from fedlap_privacy.fl.config import TrainConfig  # noqa: E402

#: one DP-FedAvg round of two nodes (the policy tests' configuration)
ROUND = TrainConfig(method="dp-fedavg", width=8, rounds=1, batch_size=32, local_steps=2,
                    clients=2, sigma=1.0)

def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1 (openssl)."""
    folder.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test CA",
        "-keyout", "ca.key", "-out", "ca.crt")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout",
        "server.key", "-out", "server.csr")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", "server.pem")
    return folder / "ca.crt", folder / "server.pem", folder / "server.key"


def _node_key(path: Path) -> Path:
    """An ECDSA key pair in OpenSSH format (what flower-supernode and `flwr supernode
    register` read): ``path`` and ``path.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    path.with_name(path.name + ".pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    return path


@pytest.mark.flower
def test_round_over_tls_with_authenticated_supernodes(tmp_path):
    """SuperLink with TLS (throw-away CA) and --enable-supernode-auth; two SuperNodes whose
    public keys were registered run one round; a SuperNode with an unregistered key is
    refused by the SuperLink (Flower exit code 305) and never joins."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make the test certificates")
    from fedlap_privacy.fl.engine.flower_app import LocalDeployment, Secure, run_on

    ca, cert, key = _certificates(tmp_path / "certs")
    keys = tuple(_node_key(tmp_path / "certs" / f"node{k}") for k in range(2))
    rogue = _node_key(tmp_path / "certs" / "rogue")
    policy = write_policy(tmp_path / "policy.toml", min_sigma=1.0)
    secure = Secure(ca, cert, key, keys)
    with LocalDeployment(2, tmp_path / "work", "cpu", policy_file=policy,
                         secure=secure) as dep:
        intruder = dep.start_node(0, key=rogue, log_name="rogue.log")
        result = run_on(dep, ROUND, tmp_path / "run", "cpu")
        assert result.summary.rounds_run == 1 and result.history[0].replies == 2
        end = time.monotonic() + 30
        while intruder.poll() is None and time.monotonic() < end:
            time.sleep(0.5)
        log = (tmp_path / "work" / "rogue.log").read_text(errors="replace")
        assert intruder.returncode not in (None, 0), log[-500:]
        assert "Failed to activate SuperNode" in log
        listed = subprocess.run([dep.exe("flwr"), "supernode", "list", dep.CONNECTION,
                                 "--format", "json"], env=dep.env, capture_output=True,
                                text=True, timeout=60)
        assert listed.stdout.count('"status": "online"') == 2, listed.stdout[-800:]
    for k in range(2):  # each node kept its own ledger, in its own state folder
        (path,) = (tmp_path / "work" / f"node-{k}").glob("run-*.json")
        saved = json.loads(path.read_text())
        assert [e["round"] for e in saved["entries"]] == [1]
