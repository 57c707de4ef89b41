"""Secure aggregation in process: the masking arithmetic of Bell et al. 2020 (SecAgg+) with
every secret drawn from the operating system and every mask expanded by ChaCha20.

Each pair of clients i < j shares a 256-bit seed, agreed as in SecAgg+: each client draws a
fresh X25519 key pair a round and advertises its public key (the server relays public keys
only), and the pair's seed is HKDF-SHA256 of their Diffie-Hellman secret (:func:`pair_seed`),
which only the two of them can compute; client i adds the pair's mask, j subtracts it, so
pair masks cancel in the sum. Each client also adds a self mask from its own 256-bit
seed (double masking). The server holds only masked uploads. To unmask it names the
survivors (clients whose upload arrived); each survivor answers with its self seed and its
pair seeds with the clients that dropped, never both kinds for one client: a dropped client's
upload that arrives late stays hidden behind its self mask. The clients of a round hold the
server to ONE survivor set (the consistency check of Bell et al. 2020, where every client
signs the set it is shown): naming a client a survivor to itself and dropped to its peers
would unmask it, so any second, different set is refused. Below ``min_survivors`` the round
is refused. A survivor can answer for a dropped peer because it derives their pair seed
itself; the server learns nothing about a seed from the public keys it relays (a server that
substitutes keys is an active attacker: SecAgg+ then needs the keys signed).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedlap_privacy.errors import FedlapError

__all__ = ["SEED_BYTES", "Answer", "MaskingClient", "Reveal", "RoundRefused", "SecureSumServer",
           "SurvivorSet", "expand_mask", "pair_seed", "setup_round"]

#: bytes of every seed (256 bits)
SEED_BYTES = 32
_NONCE = bytes(16)  # each seed expands one mask of one round: a fixed nonce is sound


class RoundRefused(FedlapError):
    """The round cannot be released: too few survivors, or an inconsistent request."""


#: a survivor's answer to the unmasking: its self seed and its pair seeds with dropped peers
Answer = tuple[bytes, dict[int, bytes]]
#: asks the survivors (a set) for their answers, by client id
Reveal = Callable[[frozenset[int]], dict[int, Answer]]


def expand_mask(seed: bytes, size: int, bits: int) -> np.ndarray:
    """``size`` uniform values mod 2^bits from a 256-bit seed (ChaCha20 keystream)."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"mask seeds have {SEED_BYTES * 8} bits, not {len(seed) * 8}")
    stream = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor()
    words = np.frombuffer(stream.update(bytes(8 * size)), dtype="<u8")
    return words & np.uint64((1 << bits) - 1)


@dataclass
class SurvivorSet:
    """The survivor set the round's clients agreed to answer about (set once)."""

    members: frozenset[int] | None = None

    def agree(self, alive: frozenset[int]) -> None:
        if self.members is None:
            self.members = alive
        elif self.members != alive:
            raise RoundRefused("the server named another survivor set in the same round: "
                               "refused (it could unmask a client)")


@dataclass
class MaskingClient:
    """One client's secrets for one round: its pair seeds and its self seed."""

    cid: int
    bits: int
    pair_seeds: dict[int, bytes] = field(repr=False)
    self_seed: bytes = field(default_factory=lambda: secrets.token_bytes(SEED_BYTES),
                             repr=False)
    agreed: SurvivorSet = field(default_factory=SurvivorSet, repr=False)
    masked: bool = field(default=False, repr=False)

    def mask(self, share: np.ndarray) -> np.ndarray:
        """The upload: share + self mask + sum_{j > i} m_ij - sum_{j < i} m_ji (mod 2^b).
        Once per object: the seeds expand the same masks every time (a fixed nonce), so a
        second upload under them would let the server subtract the two; a new round takes
        new seeds (:func:`setup_round`)."""
        if self.masked:
            raise RoundRefused(f"client {self.cid} already masked an upload under these seeds: "
                               "a new round needs new seeds (setup_round)")
        self.masked = True
        top = np.uint64((1 << self.bits) - 1)
        out = (np.asarray(share, dtype=np.uint64) + expand_mask(self.self_seed, share.size,
                                                                self.bits)) & top
        for peer, seed in self.pair_seeds.items():
            m = expand_mask(seed, share.size, self.bits)
            out = (out + m) & top if self.cid < peer else (out - m) & top
        return out

    def reveal(self, survivors: Iterable[int]) -> Answer:
        """Answer the server's unmasking request: the self seed and the pair seeds with the
        peers that did not survive, for the round's one agreed survivor set."""
        alive = frozenset(survivors)
        if self.cid not in alive:
            raise RoundRefused(f"client {self.cid} is not among the survivors it is asked about")
        self.agreed.agree(alive)
        return self.self_seed, {p: s for p, s in self.pair_seeds.items() if p not in alive}


def pair_seed(own: X25519PrivateKey, peer: X25519PublicKey, i: int, j: int,
              round_: int = 0) -> bytes:
    """The 256-bit seed of clients ``i`` and ``j`` in round ``round_``: HKDF-SHA256 of their
    X25519 secret, bound to the pair and the round (either end computes the same from its own
    key and the other's public key; a key pair kept for a run gives fresh seeds each round)."""
    info = b"fedlap-privacy pair seed %d %d %d" % (round_, min(i, j), max(i, j))
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=None,
                info=info).derive(own.exchange(peer))


def setup_round(client_ids: Iterable[int], bits: int) -> dict[int, MaskingClient]:
    """A round's key agreement (module docstring): fresh X25519 key pairs, every pair's seed
    from :func:`pair_seed` (in process, the smaller id's end computes it for both: the
    secret is the same from either end); the clients share one :class:`SurvivorSet`."""
    ids = sorted(set(client_ids))
    agreed = SurvivorSet()
    keys = {i: X25519PrivateKey.generate() for i in ids}
    public = {i: key.public_key() for i, key in keys.items()}  # what the server relays
    seeds = {(i, j): pair_seed(keys[i], public[j], i, j) for k, i in enumerate(ids)
             for j in ids[k + 1:]}
    return {i: MaskingClient(i, bits, {(j if a == i else a): s for (a, j), s in seeds.items()
                                       if i in (a, j)}, agreed=agreed) for i in ids}


@dataclass
class SecureSumServer:
    """What the server holds: the masked uploads, then their unmasked sum."""

    bits: int
    size: int
    min_survivors: int
    uploads: dict[int, np.ndarray] = field(default_factory=dict)

    def receive(self, cid: int, masked: np.ndarray) -> None:
        if cid in self.uploads:
            raise RoundRefused(f"client {cid} uploaded twice")
        self.uploads[cid] = np.asarray(masked, dtype=np.uint64)

    @property
    def survivors(self) -> frozenset[int]:
        return frozenset(self.uploads)

    def unmask(self, clients: dict[int, MaskingClient] | Reveal) -> np.ndarray:
        """The sum mod 2^b of the survivors' shares: ask the survivors to reveal (``clients``:
        the clients themselves, or a :data:`Reveal` that asks them over the network), remove
        the self masks and the dropped clients' pair masks from the sum of uploads."""
        alive = self.survivors
        if len(alive) < self.min_survivors:
            raise RoundRefused(f"{len(alive)} uploads arrived, the round needs at least "
                               f"{self.min_survivors}: not released")
        answers = (clients(alive) if callable(clients)
                   else {cid: clients[cid].reveal(alive) for cid in alive})
        if set(answers) != set(alive):
            raise RoundRefused(f"{len(alive) - len(answers.keys() & alive)} survivors did not "
                               "answer the unmasking: not released")
        top = np.uint64((1 << self.bits) - 1)
        total = np.zeros(self.size, dtype=np.uint64)
        for upload in self.uploads.values():
            total = (total + upload) & top
        for cid in sorted(alive):
            self_seed, dropped = answers[cid]
            total = (total - expand_mask(self_seed, self.size, self.bits)) & top
            for peer, seed in dropped.items():
                m = expand_mask(seed, self.size, self.bits)
                # the survivor added m if it is the smaller id, subtracted it otherwise
                total = (total - m) & top if cid < peer else (total + m) & top
        return total
