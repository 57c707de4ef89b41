"""Distributed DP over secure aggregation, in process
(docs/accounting.md#distributed-dp-over-secure-aggregation).

Client side (:mod:`.encoding`): clip, pad, rotate (randomised Hadamard, :mod:`.hadamard`),
scale, round conditionally, add an integer noise share (:mod:`.noise`), reduce mod 2^b.
Masking (:mod:`.masking`): pairwise masks that cancel in the sum (their seeds from X25519 key
agreement) and a self mask per client, all expanded with ChaCha20 from 256-bit seeds; the
server object holds only masked vectors and, after unmasking, their sum, which it decodes.
"""

from fedlap_privacy.fl.secure_sum.encoding import SecureSumSpec, decode, encode
from fedlap_privacy.fl.secure_sum.masking import (
    MaskingClient,
    RoundRefused,
    SecureSumServer,
    setup_round,
)

__all__ = [
    "MaskingClient",
    "RoundRefused",
    "SecureSumServer",
    "SecureSumSpec",
    "decode",
    "encode",
    "setup_round",
]
