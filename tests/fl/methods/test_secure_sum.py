"""Distributed DP over secure aggregation, in process: the encoding, the noise samplers and
the masking, tested as the server (the adversary) would look at them."""

from __future__ import annotations

import math
import secrets

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from scipy.linalg import hadamard
from scipy.stats import chisquare

from fedlap_privacy.accountant.distributed import (
    DistributedMechanism,
    DistributedNoise,
    Quantisation,
)
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.secure_sum import (
    RoundRefused,
    SecureSumServer,
    SecureSumSpec,
    decode,
    encode,
    setup_round,
)
from fedlap_privacy.fl.secure_sum.hadamard import fwht, rotate, rotation_signs, unrotate
from fedlap_privacy.fl.secure_sum.masking import SEED_BYTES, expand_mask, pair_seed
from fedlap_privacy.fl.secure_sum.noise import discrete_gaussian, skellam
from fedlap_privacy.secret_random import os_generator

BITS = 20


def _spec(noise=DistributedNoise.SKELLAM, size=3000, dim=4096, gamma=2e-3, local_std=20.0,
          bits=BITS) -> SecureSumSpec:
    mech = DistributedMechanism(noise, Quantisation(1.0, dim, gamma), local_std)
    return SecureSumSpec(mech, bits, size, secrets.token_bytes(32))


def _updates(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0.0, 0.03, size) + 0.01 * (i + 1) for i in range(n)]


def _clipped(x: np.ndarray, c: float = 1.0) -> np.ndarray:
    return x * min(1.0, c / np.linalg.norm(x))


def _run_round(spec, updates, drop=(), min_survivors=1, skip_noise=()):
    clients = setup_round(range(len(updates)), spec.bits)
    server = SecureSumServer(spec.bits, spec.mechanism.quantisation.dim, min_survivors)
    shares = {}
    for i, u in enumerate(updates):
        shares[i] = encode(u, spec, add_noise=i not in skip_noise)
        if i not in drop:
            server.receive(i, clients[i].mask(shares[i]))
    return clients, server, shares


# ------------------------------------------------------------------------------ rotation


def test_fwht_matches_the_hadamard_matrix_and_keeps_norms():
    rng = np.random.default_rng(1)
    for d in (1, 2, 8, 64):
        x = rng.normal(size=d)
        np.testing.assert_allclose(fwht(x), hadamard(d) @ x / math.sqrt(d), atol=1e-12)
    x = rng.normal(size=2**14)
    signs = rotation_signs(b"\x01" * 32, x.size)
    y = rotate(x, signs)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-12)
    np.testing.assert_allclose(unrotate(y, signs), x, atol=1e-12)
    # a spike is spread over every coordinate: max |y| = |x| / sqrt(d)
    spike = np.zeros(1024)
    spike[5] = 1.0
    assert np.max(np.abs(rotate(spike, rotation_signs(b"\x02" * 32, 1024)))) == pytest.approx(
        1 / 32)


# ------------------------------------------------------------------------------ noise


def test_skellam_share_has_its_variance():
    x = skellam(5.0, 200_000, os_generator())
    assert x.dtype == np.int64
    assert x.var() == pytest.approx(25.0, rel=0.02)
    assert abs(x.mean()) < 0.05


@pytest.mark.parametrize("s", [0.5, 3.0])
def test_discrete_gaussian_share_matches_its_pmf(s):
    n = 200_000
    x = discrete_gaussian(s, n, os_generator())
    k = np.arange(-int(6 * s + 3), int(6 * s + 3) + 1)
    pmf = np.exp(-(k**2) / (2 * s**2))
    pmf /= pmf.sum()
    observed = np.array([np.sum(x == v) for v in k])
    assert observed.sum() == n  # nothing beyond 6 s + 3
    keep = pmf * n > 20
    expected = pmf[keep] * n
    expected *= observed[keep].sum() / expected.sum()
    assert chisquare(observed[keep], expected).pvalue > 1e-4


def test_shares_and_rounding_are_fresh_every_time():
    spec = _spec()
    u = _updates(1, spec.model_size)[0]
    assert not np.array_equal(encode(u, spec), encode(u, spec))
    assert not np.array_equal(encode(u, spec, add_noise=False), encode(u, spec, add_noise=False))


# ---------------------------------------------------------------------- encode / decode


def test_round_trip_without_noise_is_within_the_rounding_bound():
    spec = _spec(gamma=1e-3)
    q = spec.mechanism.quantisation
    for u in [*_updates(3, spec.model_size), np.full(spec.model_size, 0.5)]:  # last clipped
        share = encode(u, spec, add_noise=False)
        out = decode(share, spec)
        err = np.linalg.norm(out - _clipped(u))
        assert err <= q.gamma * math.sqrt(q.dim)  # each coordinate within one grid step
        assert err > 0
        centred = share.astype(np.int64)
        centred[centred >= spec.modulus // 2] -= spec.modulus
        assert np.linalg.norm(centred) <= q.l2  # conditional rounding kept the bound


@pytest.mark.parametrize("noise", list(DistributedNoise))
def test_round_trip_error_is_the_noise_and_rounding(noise):
    spec = _spec(noise)
    q = spec.mechanism.quantisation
    updates = _updates(8, spec.model_size)
    clients, server, _ = _run_round(spec, updates)
    out = decode(server.unmask(clients), spec)
    err = out - sum(_clipped(u) for u in updates)
    # per coordinate: 8 shares of local_std^2 and at most 8 rounding variances of 1/4;
    # 3000 coordinates measure a variance to ~2.6% (one standard deviation)
    noise_var = 8 * spec.mechanism.local_std**2 * q.gamma**2
    assert 0.9 * noise_var <= err.var() <= 1.1 * (noise_var + 8 * q.gamma**2 / 4)
    assert abs(err.mean()) < 4 * math.sqrt(err.var() / err.size)


def test_bad_updates_are_refused_in_one_line():
    spec = _spec()
    with pytest.raises(ConfigError, match="expects 3000"):
        encode(np.zeros(10), spec)
    with pytest.raises(ConfigError, match="non-finite"):
        encode(np.full(spec.model_size, np.nan), spec)
    with pytest.raises(ConfigError, match="128 bits"):
        SecureSumSpec(spec.mechanism, BITS, 10, b"short")


# -------------------------------------------------------------------------- the server


def test_server_sees_uniform_uploads_uncorrelated_with_the_update():
    spec = _spec()
    updates = [np.linspace(-1, 1, spec.model_size) * 0.02 for _ in range(3)]
    _, server, shares = _run_round(spec, updates)
    d = spec.mechanism.quantisation.dim
    rotated = rotate(np.pad(_clipped(updates[0]), (0, d - spec.model_size)),
                     rotation_signs(spec.rotation_seed, d))
    for cid, upload in server.uploads.items():
        values = upload.astype(np.float64)
        assert np.all(upload < spec.modulus)
        # uniform over [0, 2^b): 16 equal bins
        assert chisquare(np.bincount((upload >> np.uint64(BITS - 4)).astype(np.int64),
                                     minlength=16)).pvalue > 1e-4
        bound = 5 / math.sqrt(d)
        assert abs(np.corrcoef(values, shares[cid].astype(np.float64))[0, 1]) < bound
        assert abs(np.corrcoef(values, rotated)[0, 1]) < bound
    # the shares themselves are strongly tied to the update (the test can fail)
    centred = shares[0].astype(np.int64)
    centred[centred >= spec.modulus // 2] -= spec.modulus
    assert np.corrcoef(centred, rotated)[0, 1] > 0.1


def test_the_sum_is_exactly_the_sum_of_the_shares():
    spec = _spec()
    clients, server, shares = _run_round(spec, _updates(5, spec.model_size))
    total = server.unmask(clients)
    expected = np.zeros_like(total)
    for s in shares.values():
        expected = (expected + s) % np.uint64(spec.modulus)
    np.testing.assert_array_equal(total, expected)


def test_dropouts_cancel_and_a_late_upload_stays_masked():
    spec = _spec()
    clients, server, shares = _run_round(spec, _updates(6, spec.model_size), drop=(2, 4),
                                         min_survivors=4)
    total = server.unmask(clients)
    expected = np.zeros_like(total)
    for cid in (0, 1, 3, 5):
        expected = (expected + shares[cid]) % np.uint64(spec.modulus)
    np.testing.assert_array_equal(total, expected)
    # client 2's upload arrives late: the server knows its pair seeds (revealed) but not its
    # self seed, so what it can strip is still uniform and uncorrelated with the share
    late = clients[2].mask(shares[2])
    top = np.uint64(spec.modulus - 1)
    for cid in (0, 1, 3, 5):
        seed = clients[cid].reveal(server.survivors)[1][2]
        m = expand_mask(seed, late.size, BITS)
        late = (late + m) & top if cid < 2 else (late - m) & top
    # what remains between the server and the share: the self mask and the mask of the pair
    # (2, 4), both dropped (client 2 adds it: 2 < 4)
    hidden = expand_mask(clients[2].self_seed, late.size, BITS) + expand_mask(
        clients[2].pair_seeds[4], late.size, BITS)
    np.testing.assert_array_equal(late, (shares[2] + hidden) & top)
    assert abs(np.corrcoef(late.astype(float), shares[2].astype(float))[0, 1]) < 0.08


def test_rounds_below_min_survivors_and_inconsistent_requests_are_refused():
    spec = _spec()
    clients, server, _ = _run_round(spec, _updates(5, spec.model_size), drop=(0, 1, 2),
                                    min_survivors=3)
    with pytest.raises(RoundRefused, match="at least 3: not released"):
        server.unmask(clients)
    clients[3].reveal({3, 4})
    with pytest.raises(RoundRefused, match="another survivor set"):
        clients[3].reveal({3, 4, 0})  # would unmask client 0 after dropping it
    # the attack: client 4 named a survivor to itself (self seed) while its peers were told
    # it dropped (pair seeds): the peers refuse once the round's set is fixed
    with pytest.raises(RoundRefused, match="another survivor set"):
        clients[4].reveal({4})
    with pytest.raises(RoundRefused, match="uploaded twice"):
        server.receive(3, np.zeros(4096, dtype=np.uint64))


def test_seeds_have_256_bits_and_differ():
    clients = setup_round(range(4), BITS)
    seeds = [c.self_seed for c in clients.values()]
    seeds += [s for c in clients.values() for s in c.pair_seeds.values()]
    assert all(len(s) == SEED_BYTES == 32 for s in seeds)
    assert len(set(seeds)) == 4 + 6  # each pair seed seen by both ends
    assert clients[0].pair_seeds[3] == clients[3].pair_seeds[0]
    # the seeds come from X25519 key agreement: either end derives the pair's seed from its
    # own private key and the other's public key, and another pair's keys give another seed
    a, b, c = (X25519PrivateKey.generate() for _ in range(3))
    assert pair_seed(a, b.public_key(), 0, 1) == pair_seed(b, a.public_key(), 1, 0)
    assert pair_seed(a, c.public_key(), 0, 1) != pair_seed(a, b.public_key(), 0, 1)
    assert pair_seed(a, b.public_key(), 0, 1) != pair_seed(a, b.public_key(), 0, 2)
    assert repr(clients[0].self_seed) not in repr(clients[0])  # secrets stay out of logs
    assert repr(clients[0].pair_seeds[3]) not in repr(clients[0])
    with pytest.raises(ValueError, match="256 bits"):
        expand_mask(b"\x00" * 4, 8, BITS)
    a, b = expand_mask(b"\x00" * 32, 8, BITS), expand_mask(b"\x00" * 31 + b"\x01", 8, BITS)
    assert not np.array_equal(a, b)


def test_a_skipped_noise_share_shows_in_the_variance_of_the_sum():
    """The audit's hook: one of 4 clients leaves its noise share out; the decoded sum's
    variance drops to ~3/4 of the planned one (d = 16384 coordinates: ~1% precision)."""
    spec = _spec(size=16384, dim=16384, gamma=1e-3, local_std=40.0)
    updates = [np.zeros(spec.model_size)] * 4
    planned = 4 * spec.mechanism.local_std**2 * spec.mechanism.quantisation.gamma**2
    clients, server, _ = _run_round(spec, updates)
    honest = decode(server.unmask(clients), spec).var() / planned
    clients, server, _ = _run_round(spec, updates, skip_noise=(1,))
    skipped = decode(server.unmask(clients), spec).var() / planned
    assert honest == pytest.approx(1.0, abs=0.05)
    assert skipped == pytest.approx(0.75, abs=0.05)


def test_a_client_masks_one_upload_per_seeds():
    """The seeds expand the same masks each time: a second upload under them would give the
    server the difference of two shares (the masks cancel). Refused; a new round's seeds
    mask afresh."""
    share = np.arange(8, dtype=np.uint64)
    client = setup_round([0, 1], bits=16)[0]
    first = client.mask(share)
    with pytest.raises(RoundRefused, match="new seeds"):
        client.mask(share + np.uint64(1))
    fresh = setup_round([0, 1], bits=16)[0].mask(share)
    assert not np.array_equal(first, fresh)
