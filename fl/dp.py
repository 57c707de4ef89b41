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
:mod:`~fedlap_privacy.fl.randomness`. torch's generators (Mersenne Twister on CPU, Philox on
CUDA) are NOT cryptographically secure: like Opacus' default (non-``secure_mode``) setting,
this is adequate for research and audits, not for a deployment facing an adversary who can
attack the PRNG (floating-point noise also has the known precision attacks, Mironov 2012).

White-box audit: while a :class:`DiracCanaryStep` is active (:func:`dirac_canaries`, used by
the driver around a client round of a run with canaries), every call of
:func:`clip_and_noise` treats the client's included Dirac canaries as records of the batch
(each Poisson-sampled at the client's rate, its raw gradient ``scale * C`` on one coordinate
clipped by the same rule as a record's) and hands the released noisy sum at every canary
coordinate of the client to the canary set (Nasr et al. 2023; Steinke, Nasr, Jagielski 2023).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.per_sample import per_sample_grads

__all__ = [
    "DiracCanaryStep", "clip_and_noise", "clip_factors", "dirac_canaries", "dp_gradient",
    "poisson_sample",
]


@dataclass
class DiracCanaryStep:
    """One client's Dirac canaries during its client round (see the module docstring).

    ``coordinates``: flat parameter index of each of the client's canaries; ``included``:
    their secret inclusion bits; ``rate``: the client's Poisson rate; ``scale``: the raw
    canary gradient in units of C (> 1, so that clipping matters); ``observe`` receives,
    after every release, the released noisy SUM at ``coordinates`` (in units of C).
    """

    coordinates: Tensor
    included: Tensor
    rate: float
    scale: float
    generator: torch.Generator
    observe: Callable[[Tensor], None]


_CANARIES: ContextVar[DiracCanaryStep | None] = ContextVar("dirac_canaries", default=None)


@contextmanager
def dirac_canaries(step: DiracCanaryStep) -> Iterator[None]:
    """Within the block, :func:`clip_and_noise` includes ``step``'s canaries."""
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


def _check(clip: float, sigma: float, expected_batch_size: float) -> None:
    if not clip > 0:
        raise ConfigError(f"clipping bound C must be > 0, got {clip}")
    if not sigma >= 0:
        raise ConfigError(f"noise multiplier sigma must be >= 0, got {sigma}")
    if not expected_batch_size > 0:
        raise ConfigError(f"expected batch size B must be > 0, got {expected_batch_size}")


def clip_and_noise(
    per_sample: list[Tensor],
    clip: float,
    sigma: float,
    expected_batch_size: float,
    generator: torch.Generator | None,
) -> list[Tensor]:
    """Clip each record's gradient to total L2 norm ``clip``, sum, add noise, divide by B.

    ``per_sample`` holds one ``(n, *param.shape)`` tensor per parameter (``n`` may be 0). A
    record's norm is taken over ALL parameters jointly and its gradient scaled by
    ``min(1, clip / (norm + 1e-6))``. Noise ``sigma * clip * N(0, I)`` is drawn from
    ``generator`` (on its device; the default generator when ``None``) per parameter in list
    order and skipped when ``sigma == 0``. Returns ``(sum + noise) / expected_batch_size``
    (docs/accounting.md#sampled-gaussian-mechanism).
    """
    _check(clip, sigma, expected_batch_size)
    if not per_sample:
        return []
    batch = per_sample[0].shape[0]
    flat = [g.reshape(batch, math.prod(g.shape[1:])) for g in per_sample]
    if batch > 0:
        sq = torch.stack([torch.linalg.vector_norm(f, dim=1) for f in flat]).square().sum(0)
        factor = clip_factors(sq.sqrt(), clip)
    canaries = _CANARIES.get()
    extra = _canary_sum(canaries, clip, [g.shape[1:] for g in per_sample]) if canaries else None
    # Draw on the generator's device (a CPU generator with CUDA parameters works too, at the
    # cost of a copy); with no generator, the default one of the parameters' device.
    draw_on = per_sample[0].device if generator is None else generator.device
    out: list[Tensor] = []
    for i, (g, f) in enumerate(zip(per_sample, flat, strict=True)):
        shape = g.shape[1:]
        total = (factor.to(f.dtype) @ f).view(shape) if batch > 0 else g.new_zeros(shape)
        if extra is not None:
            total = total + extra[i].to(g.device, g.dtype)
        if sigma > 0:
            noise = torch.randn(shape, generator=generator, device=draw_on, dtype=g.dtype)
            total = total + noise.to(g.device) * (sigma * clip)
        out.append(total / expected_batch_size)
    if canaries is not None:
        released = torch.cat([o.detach().flatten() for o in out]) * expected_batch_size
        canaries.observe(released[canaries.coordinates.to(released.device)].double().cpu() / clip)
    return out


def _canary_sum(step: DiracCanaryStep, clip: float, shapes: list[torch.Size]) -> list[Tensor]:
    """The clipped gradients of the canaries Poisson-sampled into this batch, per parameter."""
    drawn = torch.rand(len(step.coordinates), generator=step.generator,
                       device=step.generator.device).cpu() < step.rate
    sampled = step.coordinates[drawn & step.included.cpu()]
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
    chunk_size: int | None = None,
) -> list[Tensor]:
    """The DP gradient on a Poisson batch ``(x, y)``: one SGM release
    (docs/algorithms.md#fedlap-dp-client).

    Per-record cross-entropy gradients (:func:`fedlap_privacy.per_sample.per_sample_grads`),
    then :func:`clip_and_noise`. One tensor per parameter, in ``model.parameters()`` order,
    detached. An empty batch returns pure noise / B. The model is left unchanged.
    ``chunk_size`` bounds the records whose activations are held at once (memory only).
    """
    _check(clip, sigma, expected_batch_size)
    grads = per_sample_grads(model, x, y, chunk_size)
    return clip_and_noise(grads, clip, sigma, expected_batch_size, generator)
