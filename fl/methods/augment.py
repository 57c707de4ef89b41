"""Differentiable Siamese Augmentation (DSA; Zhao & Bilen, ICML 2021).

See docs/algorithms.md#differentiable-siamese-augmentation.

At every matching step ONE operation is drawn at random from the strategy
(``color_crop_cutout_flip_scale_rotate`` by default), together with its random parameters,
and the SAME draw is applied to every image of the real batch and of the synthetic batch
("siamese"). Every operation is differentiable with respect to the images (affine grids and
bilinear sampling, shifts with zero fill, multiplicative masks), so the matching loss reaches
the synthetic images through it. Ranges are those of the authors' ``ParamDiffAug``:

=========  ==================================================================================
color      brightness ``x + U(-0.5, 0.5)``, then saturation ``(x - mean_c) * U(0, 2) + mean_c``
           (per pixel over channels: a no-op on grey images), then contrast
           ``(x - mean) * U(0.5, 1.5) + mean`` (mean over each image)
crop       translation by an integer ``U{-s, ..., s}`` pixels per axis, ``s = round(0.125 * H)``,
           zero fill
cutout     a ``round(0.5 * H) x round(0.5 * W)`` square set to zero, centre uniform in the image
           (clipped at the borders)
flip       horizontal flip with probability 0.5
scale      x and y scaled independently by ``U(1/1.2, 1.2)`` (affine grid, bilinear, zeros)
rotate     rotation by ``U(-15, 15)`` degrees (affine grid, bilinear, zeros)
=========  ==================================================================================

Every operation is affine in the images, so :meth:`DSA.vjp` writes out its adjoint (the
vector-Jacobian product autograd would compute through :meth:`DSA.apply`), which the
written-out matching step of FedLAP-DP uses (docs/algorithms.md#written-out-matching-gradient).

The draw holds unit-interval numbers; pixel amounts are derived from each batch's image size
when applied, so one draw fits any size (1 or 3 channels, 8x8 to 32x32). Random numbers come
from the ``torch.Generator`` given, so a run is reproducible from its seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fedlap_privacy.errors import ConfigError

__all__ = ["DSA", "NO_AUGMENTATION", "OPERATIONS", "Augmentation", "DrawnAugmentation"]

OPERATIONS = ("color", "crop", "cutout", "flip", "scale", "rotate")

# Number of U(0, 1) draws each operation needs.
_DRAWS = {"color": 3, "crop": 2, "cutout": 2, "flip": 1, "scale": 2, "rotate": 1}


@dataclass(frozen=True)
class Augmentation:
    """One random draw: the operation and its U(0, 1) numbers (``u``), shared by all batches."""

    op: str
    u: tuple[float, ...]


class DSA:
    """Differentiable siamese augmentation with the usual DSA parameters (module docstring).

    ``strategy`` names the operations, joined by ``_``; ``"none"`` (or ``""``) disables
    augmentation. Use :meth:`sample` + :meth:`apply`, :meth:`draw` (returns a function that
    applies one draw), or ``dsa(real, syn, generator=g)``.
    """

    def __init__(
        self,
        strategy: str = "color_crop_cutout_flip_scale_rotate",
        *,
        scale: float = 1.2,
        rotate: float = 15.0,
        crop: float = 0.125,
        cutout: float = 0.5,
        flip: float = 0.5,
        brightness: float = 1.0,
        saturation: float = 2.0,
        contrast: float = 0.5,
    ) -> None:
        names = [] if strategy.lower() in ("", "none") else strategy.split("_")
        unknown = [n for n in names if n not in OPERATIONS]
        if unknown:
            raise ConfigError(
                f"unknown DSA operation(s) {unknown} in strategy {strategy!r}; "
                f"known: {', '.join(OPERATIONS)}"
            )
        if scale < 1.0 or not 0.0 <= crop < 1.0 or not 0.0 <= cutout <= 1.0:
            raise ConfigError(f"bad DSA ranges: scale={scale}, crop={crop}, cutout={cutout}")
        self.ops: tuple[str, ...] = tuple(names)
        self.scale, self.rotate, self.crop, self.cutout = scale, rotate, crop, cutout
        self.flip, self.brightness = flip, brightness
        self.saturation, self.contrast = saturation, contrast

    def sample(self, generator: torch.Generator) -> Augmentation | None:
        """Draw one operation (uniformly among the strategy's) and its random numbers."""
        if not self.ops:
            return None
        draws = torch.rand(1 + max(_DRAWS.values()), generator=generator, device=generator.device)
        values = draws.tolist()
        op = self.ops[min(int(values[0] * len(self.ops)), len(self.ops) - 1)]
        return Augmentation(op, tuple(values[1 : 1 + _DRAWS[op]]))

    def draw(self, generator: torch.Generator) -> DrawnAugmentation:
        """Draw ONE augmentation; return a function applying that same draw to any batch."""
        return DrawnAugmentation(self, self.sample(generator))

    def __call__(self, *batches: Tensor, generator: torch.Generator) -> tuple[Tensor, ...]:
        """Draw ONE augmentation and apply it to every batch (siamese); returns them in order."""
        aug = self.sample(generator)
        return tuple(self.apply(x, aug) for x in batches)

    def apply(self, x: Tensor, aug: Augmentation | None) -> Tensor:
        """Apply a drawn augmentation to a batch ``(N, C, H, W)``, differentiably (the
        identity, ``aug`` None, takes records of any shape, e.g. feature rows)."""
        if aug is None:
            return x
        if x.dim() != 4:
            raise ConfigError(f"DSA expects images (N, C, H, W), got shape {tuple(x.shape)}")
        if x.shape[0] == 0:
            return x
        u = aug.u
        if aug.op == "color":
            x = x + (u[0] - 0.5) * self.brightness
            mean_c = x.mean(dim=1, keepdim=True)
            x = (x - mean_c) * (u[1] * self.saturation) + mean_c
            mean = x.mean(dim=(1, 2, 3), keepdim=True)
            return (x - mean) * (u[2] + self.contrast) + mean
        if aug.op == "crop":
            dy, dx = self._shift(aug, x)
            return _translate(x, dy, dx)
        if aug.op == "cutout":
            return _cutout(x, u[0], u[1], self.cutout)
        if aug.op == "flip":
            return x.flip(3) if u[0] < self.flip else x
        if aug.op in ("scale", "rotate"):
            return F.grid_sample(x, _affine_grid(x, self._theta(aug)), align_corners=True)
        raise ConfigError(f"unknown DSA operation {aug.op!r}")  # pragma: no cover

    def vjp(self, x: Tensor, grad: Tensor, aug: Augmentation | None) -> Tensor:
        """The gradient with respect to ``x`` of ``<grad, apply(x, aug)>``: the adjoint of the
        drawn operation applied to ``grad`` (every operation is affine in ``x``), as autograd
        through :meth:`apply` would compute it, in a few tensor operations."""
        if aug is None or x.shape[0] == 0:
            return grad
        u = aug.u
        if aug.op == "color":
            # contrast then saturation, each its own adjoint (x -> s x + (1 - s) mean(x))
            k = u[2] + self.contrast
            g = grad * k + grad.mean(dim=(1, 2, 3), keepdim=True) * (1.0 - k)
            s = u[1] * self.saturation
            return g * s + g.mean(dim=1, keepdim=True) * (1.0 - s)
        if aug.op == "crop":
            dy, dx = self._shift(aug, x)
            return _translate(grad, -dy, -dx)
        if aug.op == "cutout":
            return _cutout(grad, u[0], u[1], self.cutout)
        if aug.op == "flip":
            return grad.flip(3) if u[0] < self.flip else grad
        if aug.op in ("scale", "rotate"):
            grid = _affine_grid(x, self._theta(aug))
            return torch.ops.aten.grid_sampler_2d_backward(
                grad, x, grid, 0, 0, True, [True, False])[0]
        raise ConfigError(f"unknown DSA operation {aug.op!r}")  # pragma: no cover

    def _shift(self, aug: Augmentation, x: Tensor) -> tuple[int, int]:
        """The (rows, columns) shift of a crop draw on ``x``'s image size."""
        dy, dx = (_randint(v, int(size * self.crop + 0.5))
                  for v, size in zip(aug.u, x.shape[2:], strict=True))
        return dy, dx

    def _theta(self, aug: Augmentation) -> list[list[float]]:
        """The affine matrix of a scale or rotate draw."""
        u = aug.u
        if aug.op == "scale":
            lo = 1.0 / self.scale
            sx, sy = (lo + v * (self.scale - lo) for v in u)
            return [[sx, 0.0, 0.0], [0.0, sy, 0.0]]
        angle = math.radians((u[0] - 0.5) * 2.0 * self.rotate)
        c, s = math.cos(angle), math.sin(angle)
        return [[c, -s, 0.0], [s, c, 0.0]]


@dataclass(frozen=True)
class DrawnAugmentation:
    """One draw bound to its :class:`DSA`: call it on any batch; :meth:`vjp` is its adjoint."""

    dsa: DSA
    aug: Augmentation | None

    def __call__(self, x: Tensor) -> Tensor:
        return self.dsa.apply(x, self.aug)

    def vjp(self, x: Tensor, grad: Tensor) -> Tensor:
        """d<grad, self(x)>/dx (:meth:`DSA.vjp`)."""
        return self.dsa.vjp(x, grad, self.aug)


def _randint(u: float, shift: int) -> int:
    """Map ``u ~ U(0, 1)`` to an integer uniform on ``{-shift, ..., shift}``."""
    return min(int(u * (2 * shift + 1)), 2 * shift) - shift


def _translate(x: Tensor, dy: int, dx: int) -> Tensor:
    """Shift the image content by (dy, dx) pixels, filling with zeros (DSA crop)."""
    h, w = x.shape[2:]
    dy, dx = max(-h, min(h, dy)), max(-w, min(w, dx))
    padded = F.pad(x, (max(dx, 0), max(-dx, 0), max(dy, 0), max(-dy, 0)))
    top, left = max(-dy, 0), max(-dx, 0)
    return padded[:, :, top : top + h, left : left + w]


def _cutout(x: Tensor, uy: float, ux: float, ratio: float) -> Tensor:
    """Zero a ``ratio``-sized square whose centre is uniform over the image (DSA cutout)."""
    h, w = x.shape[2:]
    ch, cw = int(h * ratio + 0.5), int(w * ratio + 0.5)
    # As in the authors' code: centre offset in [0, H + (1 - ch % 2)), square clipped.
    cy = min(int(uy * (h + 1 - ch % 2)), h - ch % 2) - ch // 2
    cx = min(int(ux * (w + 1 - cw % 2)), w - cw % 2) - cw // 2
    mask = torch.ones(h, w, dtype=x.dtype, device=x.device)
    mask[max(cy, 0) : max(cy + ch, 0), max(cx, 0) : max(cx + cw, 0)] = 0
    return x * mask


def _affine_grid(x: Tensor, theta: list[list[float]]) -> Tensor:
    """The sampling grid of one affine transform for the whole batch (bilinear sampling with
    zero padding, ``align_corners=True``, is applied by the caller): one image's grid, the
    same for every image."""
    t = torch.tensor(theta, dtype=x.dtype, device=x.device).unsqueeze(0)
    grid = F.affine_grid(t, [1, *x.shape[1:]], align_corners=True)
    return grid.expand(x.shape[0], -1, -1, -1)


#: the identity, as a draw (for callers that augment optionally)
NO_AUGMENTATION = DrawnAugmentation(DSA("none"), None)
