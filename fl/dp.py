"""Record-level DP mechanics: Poisson batches and the clipped, noised gradient (SPEC 1.1, 2.1).

Contract — exactly the sampled Gaussian mechanism (SGM) the accountant (``accountant/``,
SPEC 1.1, 1.3) assumes:

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

Randomness: the Poisson draws and the noise come from the ``torch.Generator`` passed in, so a
run is reproducible from its seed. torch's generators (Mersenne Twister on CPU, Philox on
CUDA) are NOT cryptographically secure: like Opacus' default (non-``secure_mode``) setting,
this is adequate for research and audits, not for a deployment facing an adversary who can
attack the PRNG (floating-point noise also has the known precision attacks, Mironov 2012).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.per_sample import per_sample_grads

__all__ = ["clip_and_noise", "dp_gradient", "poisson_sample"]


def poisson_sample(num_records: int, rate: float, generator: torch.Generator) -> Tensor:
    """Indices of a Poisson batch: each of ``num_records`` records independently w.p. ``rate``.

    Returns a sorted int64 tensor on the generator's device, possibly empty (SPEC 2.4).
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
    (SPEC 1.1).
    """
    _check(clip, sigma, expected_batch_size)
    if not per_sample:
        return []
    batch = per_sample[0].shape[0]
    flat = [g.reshape(batch, math.prod(g.shape[1:])) for g in per_sample]
    if batch > 0:
        sq = torch.stack([torch.linalg.vector_norm(f, dim=1) for f in flat]).square().sum(0)
        factor = (clip / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    # Draw on the generator's device (a CPU generator with CUDA parameters works too, at the
    # cost of a copy); with no generator, the default one of the parameters' device.
    draw_on = per_sample[0].device if generator is None else generator.device
    out: list[Tensor] = []
    for g, f in zip(per_sample, flat, strict=True):
        shape = g.shape[1:]
        total = (factor.to(f.dtype) @ f).view(shape) if batch > 0 else g.new_zeros(shape)
        if sigma > 0:
            noise = torch.randn(shape, generator=generator, device=draw_on, dtype=g.dtype)
            total = total + noise.to(g.device) * (sigma * clip)
        out.append(total / expected_batch_size)
    return out


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
    """The DP gradient of SPEC 2.1 on a Poisson batch ``(x, y)``: one SGM release.

    Per-record cross-entropy gradients (:func:`fedlap_privacy.per_sample.per_sample_grads`),
    then :func:`clip_and_noise`. One tensor per parameter, in ``model.parameters()`` order,
    detached. An empty batch returns pure noise / B. The model is left unchanged.
    ``chunk_size`` bounds the records whose activations are held at once (memory only).
    """
    _check(clip, sigma, expected_batch_size)
    grads = per_sample_grads(model, x, y, chunk_size)
    return clip_and_noise(grads, clip, sigma, expected_batch_size, generator)
