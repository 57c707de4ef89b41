"""Composition of discrete PLDs by one FFT; epsilon for delta (docs/accounting.md#pld-accounting).

Composing ``n_k`` copies of discrete PLDs ``p_k`` (losses on the grid ``i * h``) is the
convolution ``p_1^{*n_1} * p_2^{*n_2} * ...``: one real FFT of length ``L`` per distinct
``p_k``, powers in the frequency domain, one inverse FFT. A length-``L`` FFT computes the
convolution modulo ``L`` (aliasing): the value at grid index ``j`` of the window
``[a, a + L - 1]`` is the sum of the true masses at ``j + kL`` over all integers k. The
window is chosen by Chernoff bounds on the composed loss S (``P(S >= b) <= exp(K(lam) -
lam b)``, ``K`` the log moment generating function of the composed finite part, the sum of
the steps' ``n_k K_k``), so that at most ``TAIL`` of the mass lies above the window and at
most ``TAIL`` below it. The result stays an upper bound on the hockey-stick divergence
``delta(eps) = P(S = inf) + sum_s P(S = s) (1 - e^(eps - s))_+`` for every eps >= a:

* mass from above the window, wrapped into it: its true contribution is at most its mass,
  at most ``TAIL``, which is CHARGED to the mass at +infinity (its wrapped copy only adds a
  non-negative term);
* mass from below the window, wrapped into it: its true contribution at eps >= a is 0 (the
  loss is below eps), its wrapped copy again only adds a non-negative term.

So ``delta_window(eps) + TAIL >= delta_true(eps)`` for every eps in the window, and an epsilon
below the window is reported as the window's lowest loss (conservative). Negative values
from rounding in the FFT are set to 0. The mass at +infinity composes as
``1 - prod_k (1 - inf_k)^{n_k}``.

Epsilon for delta: the hockey-stick divergence at every row of 64 grid points at once (row
sums, one matrix-vector product, suffix sums over rows), then at every point of the row that
holds the answer, the first grid point at or below delta, and the exact solution between two
grid points (as dp-accounting's ``get_epsilon_for_delta``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import fft

from fedlap_privacy.accountant.pld_sgm import DiscretePLD
from fedlap_privacy.errors import ConfigError

__all__ = [
    "MAX_FFT_LENGTH",
    "TAIL",
    "ComposedPLD",
    "Window",
    "compose",
    "epsilon_for_delta",
    "window",
]

#: Mass allowed above (charged) and below the FFT window, each.
TAIL = 1e-20
#: Largest FFT length (grid points of the composed loss), about 0.4 GB of working memory.
MAX_FFT_LENGTH = 2**23
#: Chernoff's lam is tried at these multiples of the Gaussian optimum (small ones: heavy tails).
_LAMBDA_FACTORS = 2.0 ** np.arange(-10, 3)

_LOG_UNDERFLOW = -745.0
#: Points per row in the blocked search of epsilon_for_delta.
_ROW = 64

Parts = Sequence[tuple[DiscretePLD, int]]


@dataclass(frozen=True, eq=False)
class ComposedPLD:
    """A composed discrete PLD on its window: mass ``probs[j]`` at loss
    ``(lower + j) * interval``, ``infinity`` at +infinity (aliasing charge included);
    ``span``: the width of the Chernoff window in loss units (``probs`` may be longer, to a
    fast FFT length)."""

    interval: float
    lower: int
    probs: np.ndarray
    infinity: float
    span: float = 0.0


@dataclass(frozen=True)
class Window:
    """Where one composition is computed: grid indices ``lower..upper``, the tilt ``theta``
    and the mass charged for what lies above ``upper``."""

    lower: int
    upper: int
    theta: float
    charge: float


def _k_total(parts: Parts, lam: np.ndarray) -> np.ndarray:
    """Log moment generating function of the composed finite part at each ``lam``."""
    return sum(n * p.log_mgf(lam) for p, n in parts)


def window(parts: Parts, delta: float) -> Window:
    """The FFT window of the composition of ``parts`` and its exponential tilt.

    The tilt ``theta`` is Chernoff's optimum for ``delta`` (the minimiser of
    ``(K(lam) - log delta) / lam``): the tilted distribution ``e^{theta s} P(S = s) / M``
    is centred near the epsilon sought, so the FFT's rounding, relative to the tilted
    peak, stays far below delta there. The window holds all but ``TAIL`` of the TILTED mass
    on each side; the untilted mass above it, bounded by Chernoff, is charged.
    """
    h = parts[0][0].interval
    low = sum(n * p.lower for p, n in parts)
    high = sum(n * p.upper for p, n in parts)
    var = sum(n * p.variance for p, n in parts)
    if var <= 0.0:
        return Window(low, high, 0.0, 0.0)
    log_tail = math.log(TAIL)
    lam = math.sqrt(-2.0 * log_tail / var) * _LAMBDA_FACTORS
    k_plain = _k_total(parts, lam)
    with np.errstate(invalid="ignore", over="ignore"):
        chernoff = (k_plain - math.log(delta)) / lam
    best = int(np.nanargmin(chernoff)) if np.isfinite(chernoff).any() else None
    theta = 0.0 if best is None else float(lam[best])
    k_theta = 0.0 if best is None else float(k_plain[best])
    shifted = _k_total(parts, np.concatenate([theta + lam, theta - lam])) - k_theta
    k_up, k_down = shifted[: len(lam)], shifted[len(lam):]
    with np.errstate(invalid="ignore", over="ignore"):
        b = np.nanmin((k_up - log_tail) / lam)
        a = np.nanmax((log_tail - k_down) / lam)
    b_idx = high if not np.isfinite(b) else min(math.ceil(b / h), high)
    a_idx = low if not np.isfinite(a) else max(math.floor(a / h), low)
    a_idx = min(a_idx, b_idx)
    charge = 0.0
    if b_idx < high:
        with np.errstate(over="ignore"):
            charge = float(np.nanmin(np.exp(k_plain - lam * b_idx * h)))
    return Window(a_idx, b_idx, theta, charge)


def _fold(probs: np.ndarray, length: int) -> np.ndarray:
    """``probs`` wrapped modulo ``length`` (the circular convolution sees the same)."""
    if len(probs) <= length:
        return probs
    padded = np.zeros(-(-len(probs) // length) * length)
    padded[: len(probs)] = probs
    return padded.reshape(-1, length).sum(axis=0)


def _length(span: int) -> int:
    length = fft.next_fast_len(span, real=True)
    if length > MAX_FFT_LENGTH:
        raise ConfigError(
            f"the PLD accountant cannot discretise this composition: its privacy loss spans "
            f"{span:.1e} buckets (at most {MAX_FFT_LENGTH:.1e} within its memory budget); "
            "use the RDP accountant (--accountant rdp)"
        )
    return length


def _power(spectrum: np.ndarray, n: int) -> np.ndarray:
    """``spectrum ** n``, computed only where ``|spectrum|^n`` does not underflow to 0 (the
    tilted distribution is smooth, so most of its spectrum vanishes after a few powers)."""
    with np.errstate(divide="ignore"):
        log_abs = np.log(np.abs(spectrum))
    alive = np.flatnonzero(n * log_abs > _LOG_UNDERFLOW)
    out = np.zeros_like(spectrum)
    out[alive] = spectrum[alive] ** n
    return out


def compose(parts: Parts, delta: float) -> ComposedPLD:
    """The composition of ``(pld, count)`` parts by one FFT on the tilted window (module
    docstring): tilt each distinct step, one forward FFT each, powers, one inverse FFT,
    untilt."""
    win = window(parts, delta)
    h = parts[0][0].interval
    length = _length(win.upper - win.lower + 1)
    product = None
    log_scale = 0.0
    for p, n in parts:
        k = float(p.log_mgf(np.array([win.theta]))[0])
        losses = (p.lower + np.arange(len(p.probs))) * h
        with np.errstate(divide="ignore"):
            tilted = np.exp(np.log(p.probs) + win.theta * losses - k)
        term = _power(fft.rfft(_fold(tilted, length), length), n)
        product = term if product is None else product * term
        log_scale += n * k
    circular = fft.irfft(product, length)
    low = sum(n * p.lower for p, n in parts)
    tilted = np.maximum(np.roll(circular, -((win.lower - low) % length)), 0.0)
    losses = (win.lower + np.arange(length)) * h
    with np.errstate(divide="ignore", over="ignore"):
        probs = np.minimum(np.exp(np.log(tilted) + log_scale - win.theta * losses), 1.0)
    log_finite = sum(n * math.log1p(-p.infinity) for p, n in parts)
    return ComposedPLD(h, win.lower, probs, -math.expm1(log_finite) + win.charge,
                       (win.upper - win.lower) * h)


def _geometric_suffix(values: np.ndarray, factor: float, log_factor: float) -> np.ndarray:
    """``y_a = values_a + factor * y_{a+1}`` (``y`` past the end 0), ``factor = e^log_factor
    <= 1``: reverse cumulative sums of ``factor^(a - c) values_a`` over chunks in which the
    scale ``factor^(a - c)`` stays above ``e^-64``, carried from chunk to chunk."""
    m = len(values)
    chunk = m if log_factor == 0.0 else max(int(64.0 / -log_factor), 1)
    out = np.empty(m)
    carry = 0.0
    for c in range(((m - 1) // chunk) * chunk, -1, -chunk):
        seg = values[c:c + chunk]
        scale = np.exp(log_factor * np.arange(len(seg)))
        sums = np.cumsum((seg * scale)[::-1])[::-1]
        out[c:c + chunk] = sums / scale + carry * factor ** (len(seg) - np.arange(len(seg)))
        carry = out[c]
    return out


def epsilon_for_delta(pld: ComposedPLD, delta: float) -> float:
    """Smallest eps >= 0 with ``delta(eps) <= delta`` (inf if the mass at +infinity exceeds
    delta), searched from the last grid point at or below 0. On the grid,
    ``delta(x_j) = inf + U_j - G_j`` with ``U_j = sum_{i>j} p_i`` and
    ``G_j = sum_{i>j} p_i e^{-(i-j) h}``, non-increasing in j; between ``x_{j-1}`` and
    ``x_j`` it is ``inf + U_{j-1} - e^{eps - x_{j-1}} G_{j-1}``, solved for eps (as
    dp-accounting's ``get_epsilon_for_delta``).

    Blocked: with the grid cut into rows of :data:`_ROW` points, U and G at every row's
    start come from the rows' sums and ``e^{-bh}``-weighted sums (one matrix-vector
    product) and a suffix recursion over rows; the first row boundary at or below delta
    fixes the row holding the answer, where U and G are computed point by point."""
    if pld.infinity > delta:
        return math.inf
    h = pld.interval
    # only eps >= 0 is reported: start at the last grid point at or below 0 (U and G at j
    # only sum over i > j)
    start = min(max(-pld.lower, 0), len(pld.probs) - 1)
    p, lower = pld.probs[start:], pld.lower + start
    n = len(p)
    rows = -(-n // _ROW)
    padded = np.zeros(rows * _ROW)  # no mass past the last point: delta there is inf <= delta
    padded[:n] = p
    blocks = padded.reshape(rows, _ROW)
    local = np.exp(-h * np.arange(_ROW))  # e^{-bh}
    # over i >= a * _ROW: U_rows[a] = sum p_i, G_rows[a] = sum p_i e^{-(i - a _ROW) h}
    u_rows = np.append(np.cumsum(blocks.sum(axis=1)[::-1])[::-1], 0.0)
    g_rows = np.append(_geometric_suffix(blocks @ local, math.exp(-h * _ROW), -h * _ROW), 0.0)
    # delta at the point just below row a (a >= 1): inf + U_rows[a] - e^{-h} G_rows[a]
    boundary = pld.infinity + u_rows[1:rows] - local[1] * g_rows[1:rows]
    below = np.flatnonzero(boundary <= delta)
    r = int(below[0]) if len(below) else rows - 1  # the answer lies in row r
    row = blocks[r]
    # within row r, j = r _ROW + b: sums over b' > b, then the rows above
    u = np.append(np.cumsum(row[::-1])[::-1][1:], 0.0) + u_rows[r + 1]
    weighted = np.append(np.cumsum((row * local)[::-1])[::-1][1:], 0.0)
    g = (weighted + local[-1] * local[1] * g_rows[r + 1]) / local
    b = int(np.flatnonzero(pld.infinity + u - g <= delta)[0])
    j = r * _ROW + b
    if j == 0:
        return max(lower * h, 0.0)
    if b > 0:
        u_prev, g_prev = u[b - 1], g[b - 1]
    else:  # the point just below row r
        u_prev, g_prev = u_rows[r], local[1] * g_rows[r]
    x_prev = (lower + j - 1) * h
    excess = pld.infinity + u_prev - delta
    if g_prev <= 0.0 or excess <= 0.0:
        return max(x_prev, 0.0)
    return max(x_prev + math.log(excess / g_prev), 0.0)
