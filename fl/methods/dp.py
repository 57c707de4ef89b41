"""Record-level DP mechanics: Poisson batches and the clipped, noised gradient.

See docs/accounting.md#sampled-gaussian-mechanism and docs/algorithms.md#fedlap-dp-client.

Contract — exactly the sampled Gaussian mechanism (SGM) the accountant (``accountant/``,
docs/accounting.md) assumes:

* Sampling: Poisson sampling at rate ``q``: every record of the client's dataset enters the
  batch independently with probability ``q`` (:func:`poisson_sample`); the realised batch
  size is random and may be zero. Shuffled fixed-size batches do NOT satisfy the accounting.
* Neighbouring datasets: add/remove one record.
* Sensitivity: each record's gradient (all parameters flattened into one vector) is clipped
  to L2 norm ``C``, so adding or removing a record moves the sum by at most ``C``.
* Noise: ONE draw of ``N(0, sigma^2 C^2 I)`` added to the SUM of the clipped gradients, the
  result divided by the EXPECTED batch size ``B = q N`` (a public constant), never by the
  realised size (which depends on the data). An empty batch still runs the mechanism and
  returns pure noise / ``B``.

Everything computed from the returned gradient (synthetic-image updates, local steps) is
post-processing and costs no privacy.

Randomness: the Poisson draws and the noise come from the ``torch.Generator`` passed in:
secret (seeded by the operating system) in a private run, see
:mod:`~fedlap_privacy.fl.run.randomness`. torch's generators (Mersenne Twister on CPU, Philox on
CUDA) are NOT cryptographically secure: like Opacus' default (non-``secure_mode``) setting,
this is adequate for research and audits, not for a deployment facing an adversary who can
attack the PRNG (floating-point noise also has the known precision attacks, Mironov 2012).

White-box audit: while a :class:`DiracCanaryStep` is active (:func:`dirac_canaries`, used by
the driver around a client round of a run with canaries), every call of
:func:`release` treats the client's included Dirac canaries as records of the batch
(each Poisson-sampled at the client's rate, its raw gradient ``scale * C`` on one coordinate
clipped by the same rule as a record's) and hands the released noisy sum at every canary
coordinate of the client to the canary set (Nasr et al. 2023; Steinke, Nasr, Jagielski 2023).
With a dedicated block (``DiracCanaryStep.block > 0``) the canaries' coordinates are not
weights of the model but ``block`` extra coordinates appended to the released vector, which
no real record's gradient reaches (its gradient there is exactly zero, as on a parameter the
forward pass never uses): the block joins the sum, is noised by the same loop as every
parameter (``sigma * C`` per coordinate), is observed, and is dropped from what is returned.
Appending zero-gradient coordinates changes no record's norm, clipping or sensitivity, so the
mechanism the canaries audit is the SGM the ledger accounts; what the canaries no longer
meet is the real records' gradients on their coordinates, which blur their scores.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.ghost_clipping import ghost_clipped_sum
from fedlap_privacy.compute.per_sample import per_sample_grads
from fedlap_privacy.errors import ConfigError

__all__ = [
    "DP_CHUNK", "DiracCanaryStep", "batch_rate", "clip_and_noise", "clip_factors",
    "clipped_sum", "dirac_canaries", "dp_gradient", "poisson_sample", "release",
]

#: records whose per-record gradients :func:`dp_gradient` holds at once (memory and speed
#: only; ``benchmarks/speed/dp_step.py``). One thread, 28x28 ConvNet: at B 1,024, 0.6 GB of peak
#: memory instead of 4.6 and half the time of one chunk; at B 256, half the memory
DP_CHUNK = 128


@dataclass
class DiracCanaryStep:
    """One client's Dirac canaries during its client round (see the module docstring).

    ``coordinates``: flat parameter index of each of the client's canaries; ``included``:
    their secret inclusion bits; ``rate``: the client's Poisson rate; ``scale``: the raw
    canary gradient in units of C (> 1, so that clipping matters); ``observe`` receives,
    after every release, the released noisy SUM at ``coordinates`` (in units of C);
    ``block``: the size of the dedicated canary block (module docstring), 0 when the
    coordinates are the model's own weights.
    """

    coordinates: Tensor
    included: Tensor
    rate: float
    scale: float
    generator: torch.Generator
    observe: Callable[[Tensor], None]
    block: int = 0


_CANARIES: ContextVar[DiracCanaryStep | None] = ContextVar("dirac_canaries", default=None)


@contextmanager
def dirac_canaries(step: DiracCanaryStep) -> Iterator[None]:
    """Within the block, :func:`release` includes ``step``'s canaries."""
    token = _CANARIES.set(step)
    try:
        yield
    finally:
        _CANARIES.reset(token)


def clip_factors(norms: Tensor, clip: float) -> Tensor:
    """Per-record scale ``min(1, C / (norm + 1e-6))`` that clips a gradient to norm C."""
    return (clip / (norms + 1e-6)).clamp(max=1.0)


def poisson_sample(num_records: int, rate: float, generator: torch.Generator) -> Tensor:
    """Indices of a Poisson batch: each of ``num_records`` records independently w.p. ``rate``.

    Returns a sorted int64 tensor on the generator's device, possibly empty
    (docs/algorithms.md#batches).
    """
    if num_records < 0:
        raise ConfigError(f"num_records must be >= 0, got {num_records}")
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"sampling rate must lie in [0, 1], got {rate}")
    keep = torch.rand(num_records, generator=generator, device=generator.device) < rate
    return torch.nonzero(keep).flatten().to(torch.int64)


def batch_rate(batch_size: float, num_records: int, *, accounted: bool) -> float:
    """The Poisson rate of a client's batches of expected size ``batch_size`` B over its
    ``num_records`` N_k records (docs/algorithms.md#batches).

    ``accounted`` (record-level DP: the accountant composes q = B / N_k): exactly B / N_k; a
    client of fewer than B records has no such rate, and is refused in one line (the driver
    refuses it before round 1, naming the client: ``fl.run.privacy.run_schedule``). Not
    accounted (the non-private methods; client-level DP, whose local steps are not
    private): min(B / N_k, 1), so a client of fewer than B records takes every record in
    every step, the batch of min(B, N_k) records FedAvg's users expect."""
    if num_records <= 0:
        raise ConfigError("a client with no records has no batches")
    rate = batch_size / num_records
    if not accounted:
        return min(rate, 1.0)
    if rate > 1.0:
        raise ConfigError(f"batch size {batch_size:g} is larger than the client's "
                          f"{num_records} records: the accounted rate B / N_k exceeds 1")
    return rate


def _check(clip: float, sigma: float, expected_batch_size: float) -> None:
    if not clip > 0:
        raise ConfigError(f"clipping bound C must be > 0, got {clip}")
    if not sigma >= 0:
        raise ConfigError(f"noise multiplier sigma must be >= 0, got {sigma}")
    if not expected_batch_size > 0:
        raise ConfigError(f"expected batch size B must be > 0, got {expected_batch_size}")


def clipped_sum(per_sample: list[Tensor], clip: float) -> list[Tensor]:
    """The sum over records of each record's gradient clipped to total L2 norm ``clip``.

    ``per_sample`` holds one ``(n, *param.shape)`` tensor per parameter (``n`` may be 0). A
    record's norm is taken over ALL parameters jointly and its gradient scaled by
    :func:`clip_factors` (docs/accounting.md#sampled-gaussian-mechanism). One tensor per
    parameter, of the parameter's shape.
    """
    if not per_sample:
        return []
    batch = per_sample[0].shape[0]
    if batch == 0:
        return [g.new_zeros(g.shape[1:]) for g in per_sample]
    flat = [g.reshape(batch, math.prod(g.shape[1:])) for g in per_sample]
    sq = torch.stack([torch.linalg.vector_norm(f, dim=1) for f in flat]).square().sum(0)
    factor = clip_factors(sq.sqrt(), clip)
    return [(factor.to(f.dtype) @ f).view(g.shape[1:]) for g, f in zip(per_sample, flat,
                                                                       strict=True)]


def release(
    total: list[Tensor],
    clip: float,
    sigma: float,
    expected_batch_size: float,
    generator: torch.Generator | None,
) -> list[Tensor]:
    """The Gaussian mechanism on a clipped sum: ``(total + noise) / expected_batch_size``.

    Noise ``sigma * clip * N(0, I)`` is drawn from ``generator`` (on its device; the default
    generator when ``None``) per parameter in list order and skipped when ``sigma == 0``.
    While a :class:`DiracCanaryStep` is active its sampled canaries join the sum first and
    it observes the release (module docstring).
    """
    _check(clip, sigma, expected_batch_size)
    if not total:
        return []
    canaries = _CANARIES.get()
    dedicated = canaries is not None and canaries.block > 0
    if dedicated:
        assert canaries is not None
        total = [*total, total[0].new_zeros(canaries.block)]
    extra = _canary_sum(canaries, clip, [t.shape for t in total]) if canaries else None
    out: list[Tensor] = []
    for i, t in enumerate(total):
        if extra is not None:
            t = t + extra[i].to(t.device, t.dtype)
        out.append(add_gaussian_noise(t, sigma * clip, generator) / expected_batch_size)
    if canaries is not None:
        released = torch.cat([o.detach().flatten() for o in out]) * expected_batch_size
        at = canaries.coordinates.to(released.device)
        if dedicated:  # block coordinates index the appended block
            at = at + (released.numel() - canaries.block)
        canaries.observe(released[at].double().cpu() / clip)
    return out[:-1] if dedicated else out


def add_gaussian_noise(t: Tensor, std: float, generator: torch.Generator | None) -> Tensor:
    """``t + N(0, std^2 I)``: the one place where every Gaussian mechanism of the package draws
    its noise (the record-level SGM of :func:`release`; the client-level sums of DP-FedAvg and
    DP-NormFedAvg, McMahan et al. 2018, Algorithm 1).

    The draw comes from ``generator`` on its own device (a CPU generator with CUDA tensors
    works too, at the cost of a copy; the default generator of ``t``'s device when ``None``),
    in ``t``'s dtype, and is added on ``t``'s device. ``std == 0`` draws nothing and returns
    ``t``; a negative or non-finite ``std`` is refused.
    """
    if not (math.isfinite(std) and std >= 0):
        raise ConfigError(f"the noise's standard deviation must be finite and >= 0, got {std}")
    if std == 0:
        return t
    draw_on = t.device if generator is None else generator.device
    noise = torch.randn(t.shape, generator=generator, device=draw_on, dtype=t.dtype)
    return t + noise.to(t.device) * std


def clip_and_noise(
    per_sample: list[Tensor],
    clip: float,
    sigma: float,
    expected_batch_size: float,
    generator: torch.Generator | None,
) -> list[Tensor]:
    """Clip each record's gradient to total L2 norm ``clip``, sum, add noise, divide by B:
    :func:`release` of :func:`clipped_sum` (docs/accounting.md#sampled-gaussian-mechanism)."""
    return release(clipped_sum(per_sample, clip), clip, sigma, expected_batch_size, generator)


def _canary_sum(step: DiracCanaryStep, clip: float, shapes: list[torch.Size]) -> list[Tensor]:
    """The clipped gradients of the canaries Poisson-sampled into this batch, per parameter."""
    drawn = torch.rand(len(step.coordinates), generator=step.generator,
                       device=step.generator.device).cpu() < step.rate
    sampled = step.coordinates[drawn & step.included.cpu()]
    if step.block > 0:  # the block is the last piece
        sampled = sampled + (sum(math.prod(s) for s in shapes) - step.block)
    raw = torch.full((len(sampled),), step.scale * clip, dtype=torch.float64)
    values = clip_factors(raw, clip) * raw  # clipped exactly as a record's gradient is
    flat = torch.zeros(sum(math.prod(s) for s in shapes), dtype=torch.float64)
    flat.index_add_(0, sampled.cpu(), values)
    pieces = flat.split([math.prod(s) for s in shapes])
    return [piece.view(shape) for piece, shape in zip(pieces, shapes, strict=True)]


def dp_gradient(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    clip: float,
    sigma: float,
    expected_batch_size: float,
    generator: torch.Generator | None,
    *,
    chunk_size: int | None = DP_CHUNK,
) -> list[Tensor]:
    """The DP gradient on a Poisson batch ``(x, y)``: one SGM release
    (docs/algorithms.md#fedlap-dp-client).

    Per-record cross-entropy gradients (:func:`fedlap_privacy.compute.per_sample.per_sample_grads`)
    of ``chunk_size`` records at a time (all at once when ``None``), each chunk clipped and
    summed (:func:`clipped_sum`) before the next is computed, then one :func:`release` of
    the total. With the ``ghost_clipping`` fast path on (:mod:`fedlap_privacy.compute.fast_paths`)
    a chunk's clipped sum comes from its records' gradient norms and one weighted sum per
    layer (:func:`fedlap_privacy.compute.ghost_clipping.ghost_clipped_sum`, the same numbers up to
    rounding) where the model's layers allow it, from per-record gradients otherwise. The
    chunks change the memory held (one chunk's activations and per-record gradients, not
    the batch's) and the order of the additions, nothing else: every record
    is still clipped on its own and the noise is drawn once. One tensor per parameter, in
    ``model.parameters()`` order, detached. An empty batch returns pure noise / B. The
    model is left unchanged.
    """
    _check(clip, sigma, expected_batch_size)
    if chunk_size is not None and chunk_size < 1:
        raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
    step = chunk_size or max(x.shape[0], 1)
    ghost = fast_paths.current().ghost_clipping
    total: list[Tensor] = []
    for start in range(0, x.shape[0], step) or [0]:  # an empty batch: one empty chunk
        xc, yc = x[start : start + step], y[start : start + step]
        part = (ghost_clipped_sum(model, xc, yc, lambda n: clip_factors(n, clip))
                if ghost else None)
        if part is None:  # the ghost path is off or does not apply: per-record gradients
            ghost = False
            part = clipped_sum(per_sample_grads(model, xc, yc), clip)
        total = part if not total else [a.add_(b) for a, b in zip(total, part, strict=True)]
    return release(total, clip, sigma, expected_batch_size, generator)
