"""A node's part of secure aggregation over Flower messages (docs/flower.md#secure-aggregation).

The protocol of :mod:`fedlap_privacy.fl.secure_sum.masking` with its seeds agreed over the
network, as SecAgg+ (Bell et al. 2020) agrees them:

* discovery: the node makes an X25519 key pair for the run (pyca ``cryptography``), keeps the
  private key in its own ``context.state`` and answers with the public key;
* ``train``: the instruction carries the round's peers (their partition ids and public keys,
  as the server relays them) and the public rotation seed; the node checks that the key the
  server relays for it is its own, runs its client step, encodes the clipped update with the
  noise share it computes itself from the run's configuration
  (:meth:`~fedlap_privacy.fl.secure_sum.training.SecurePlan.of`), masks it with a pair mask per
  peer (seeds: :func:`~fedlap_privacy.fl.secure_sum.masking.pair_seed` of its key and the
  peer's, bound to the round) and a fresh self mask, and answers with the masked vector only;
* ``query.unmask``: the survivors the server names; the node answers once per round for ONE
  survivor set (a second, different one is refused: it could unmask the node), only if
  it is among them and they are at least ``min_survivors``, with its self seed and its pair
  seeds with the peers that dropped.

Against a server that follows the protocol. An active one could relay forged keys for a
node's peers, or name a node a survivor to itself and dropped to its peers (the nodes do not
compare their survivor sets: SecAgg+'s signed consistency round is not done here).
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from flwr.app import ConfigRecord, Context

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.secure_sum.encoding import SecureSumSpec, encode
from fedlap_privacy.fl.secure_sum.masking import (
    MaskingClient,
    RoundRefused,
    SurvivorSet,
    pair_seed,
)
from fedlap_privacy.fl.secure_sum.training import SecurePlan

__all__ = ["SECURE_RECORD", "UNMASK", "UPLOAD_RECORD", "mask_update", "public_key",
           "raw_public_key", "unmask_answer"]

#: the instruction's record of the round's peers and rotation seed
SECURE_RECORD = "secure-sum"
#: the reply's record holding the masked vector
UPLOAD_RECORD = "secure-upload"
#: the unmasking: the request's message type (``query.unmask``) and the name of the record
#: the request and the answer carry
UNMASK = "unmask"
_KEY = "secure-sum-key"  # context.state: the node's private key for the run
_ROUND = "secure-sum-round"  # context.state: the last round's self seed, peers and survivors


def raw_public_key(key: X25519PublicKey) -> bytes:
    """The 32 raw bytes of an X25519 public key (as messages carry it)."""
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _private_key(context: Context) -> X25519PrivateKey:
    """The node's key for this run, made on first use and kept in its ``context.state``."""
    record = context.state.config_records.get(_KEY)
    if record is None:
        key = X25519PrivateKey.generate()
        context.state.config_records[_KEY] = ConfigRecord({"private": key.private_bytes_raw()})
        return key
    return X25519PrivateKey.from_private_bytes(bytes(record["private"]))


def public_key(context: Context) -> bytes:
    """The node's X25519 public key for this run (raw, 32 bytes), sent at discovery."""
    return raw_public_key(_private_key(context).public_key())


def _peers(record: ConfigRecord, cid: int, own: bytes) -> dict[int, X25519PublicKey]:
    """The round's peers and their public keys from the instruction; refuses a round where
    the key the server relays for this node is not its own."""
    try:
        ids = [int(k) for k in record["peers"]]
        keys = [bytes(k) for k in record["keys"]]
    except (KeyError, TypeError, ValueError):
        raise ConfigError("malformed secure-sum instruction (peers and keys)") from None
    if len(ids) != len(keys) or len(set(ids)) != len(ids) or cid not in ids:
        raise ConfigError("malformed secure-sum instruction: the peers must be distinct and "
                          "include this client")
    if keys[ids.index(cid)] != own:
        raise ConfigError("the server relays another public key for this client than its "
                          "own: refused (it could unmask it)")
    try:
        return {k: X25519PublicKey.from_public_bytes(key) for k, key in zip(ids, keys,
                                                                             strict=True)}
    except ValueError:
        raise ConfigError("malformed secure-sum instruction: a public key is not X25519") from None


def mask_update(plan: SecurePlan, update: np.ndarray, record: ConfigRecord, cid: int,
                round_: int, context: Context) -> ConfigRecord:
    """The reply's masked upload of client ``cid``'s clipped ``update`` (flat, the model's
    size) with the node's own noise share (``plan``, :meth:`SecurePlan.of` of the run's
    configuration) in ``round_`` (module docstring); the round's self seed and peers are
    kept in the node's ``context.state`` for the unmasking."""
    key = _private_key(context)
    peers = _peers(record, cid, raw_public_key(key.public_key()))
    try:
        spec = SecureSumSpec(plan.mechanism, plan.bits, plan.model_size,
                             bytes(record["rotation-seed"]))
    except KeyError:
        raise ConfigError("malformed secure-sum instruction (rotation seed)") from None
    try:
        seeds = {j: pair_seed(key, peer, cid, j, round_) for j, peer in peers.items() if j != cid}
    except ValueError:  # a low-order point: no shared secret
        raise ConfigError("a peer's public key gives no shared secret: refused") from None
    client = MaskingClient(cid, plan.bits, seeds)
    masked = client.mask(encode(update, spec))
    order = sorted(peers)
    context.state.config_records[_ROUND] = ConfigRecord({
        "round": round_, "self-seed": client.self_seed, "peers": order,
        "peer-keys": [raw_public_key(peers[j]) for j in order], "min-survivors": plan.min_survivors,
        "client": cid, "survivors": []})
    return ConfigRecord({"masked": masked.astype("<u8").tobytes()})


def unmask_answer(content: ConfigRecord, context: Context) -> ConfigRecord:
    """The node's answer to the unmasking of ``content["round"]`` for the survivors
    ``content["survivors"]`` (module docstring): its self seed and its pair seeds with the
    peers that dropped."""
    saved = context.state.config_records.get(_ROUND)
    try:
        round_ = int(content["round"])
        alive = frozenset(int(k) for k in content["survivors"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError("malformed unmasking request (round and survivors)") from None
    if saved is None or int(saved["round"]) != round_:
        raise ConfigError(f"this client masked no upload in round {round_}")
    peers = [int(k) for k in saved["peers"]]
    if not alive <= set(peers):
        raise ConfigError("the unmasking names survivors that were not in the round")
    if len(alive) < int(saved["min-survivors"]):
        raise ConfigError(f"the unmasking names {len(alive)} survivors, fewer than the "
                          f"round's min_survivors {int(saved['min-survivors'])}: refused")
    cid = int(saved["client"])
    agreed = SurvivorSet(frozenset(int(k) for k in saved["survivors"]) or None)
    try:  # refuses a second, different set, and a set without this client
        self_seed, _ = MaskingClient(cid, 1, {}, bytes(saved["self-seed"]), agreed).reveal(alive)
    except RoundRefused as exc:
        raise ConfigError(str(exc)) from None
    saved["survivors"] = sorted(alive)
    key = _private_key(context)
    keys = dict(zip(peers, (bytes(k) for k in saved["peer-keys"]), strict=True))
    dropped = sorted(j for j in peers if j not in alive)
    return ConfigRecord({"self-seed": self_seed, "dropped": dropped, "pair-seeds": [
        pair_seed(key, X25519PublicKey.from_public_bytes(keys[j]), cid, j, round_)
        for j in dropped]})
