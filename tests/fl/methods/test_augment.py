"""Differentiable siamese augmentation (fl.methods.augment),
docs/algorithms.md#differentiable-siamese-augmentation."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.methods.augment import DSA, OPERATIONS, Augmentation


def _images(n: int, c: int, size: int, seed: int = 0) -> Tensor:
    return torch.randn(n, c, size, size, generator=torch.Generator().manual_seed(seed))


def _draw(op: str, dsa: DSA, seed: int) -> Augmentation:
    """A draw of the given operation: sample until the generator picks it."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(500):
        aug = dsa.sample(g)
        assert aug is not None
        if aug.op == op:
            return aug
    raise AssertionError(op)


@pytest.mark.parametrize("op", OPERATIONS)
@pytest.mark.parametrize("size", [8, 28, 32])
def test_siamese_shapes_and_same_transform(op: str, size: int) -> None:
    dsa = DSA()
    channels = 3 if size == 32 else 1
    real, syn = _images(5, channels, size, 1), _images(3, channels, size, 2)
    for seed in range(4):
        aug = _draw(op, dsa, seed)
        both = dsa.apply(torch.cat([real, syn]), aug)
        a, b = dsa.apply(real, aug), dsa.apply(syn, aug)
        assert a.shape == real.shape and b.shape == syn.shape
        # Colour statistics are per image, so the transform does not depend on the batch.
        torch.testing.assert_close(torch.cat([a, b]), both)
        # One parameter set for every image: the same image anywhere gives the same output.
        twice = dsa.apply(torch.cat([syn[:1], real, syn[:1]]), aug)
        torch.testing.assert_close(twice[0], twice[-1])


def test_call_applies_one_draw_to_all_batches() -> None:
    dsa = DSA()
    x = _images(4, 3, 32)
    for seed in range(12):
        a, b = dsa(x, x.clone(), generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(a, b)


def test_draw_returns_one_transform_for_every_batch() -> None:
    dsa = DSA()
    real, syn = _images(4, 1, 28, 3), _images(2, 1, 28, 4)
    for seed in range(12):
        aug = dsa.draw(torch.Generator().manual_seed(seed))
        torch.testing.assert_close(torch.cat([aug(real), aug(syn)]), aug(torch.cat([real, syn])))
        expect = dsa.apply(real, dsa.sample(torch.Generator().manual_seed(seed)))
        torch.testing.assert_close(aug(real), expect)


def test_deterministic_for_seed_and_varies_across_seeds() -> None:
    dsa = DSA()
    x = _images(2, 1, 28)
    outs = [dsa(x, generator=torch.Generator().manual_seed(s))[0] for s in (7, 7, 8, 9, 10)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert any(not torch.equal(outs[0], o) for o in outs[2:])
    ops = {dsa.sample(g).op for g in [torch.Generator().manual_seed(s) for s in range(200)]}
    assert ops == set(OPERATIONS)  # every operation gets drawn


@pytest.mark.parametrize("op", OPERATIONS)
def test_differentiable(op: str) -> None:
    dsa = DSA()
    for seed in range(3):
        x = _images(2, 3, 8).requires_grad_(True)
        out = dsa.apply(x, _draw(op, dsa, seed))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        assert x.grad.abs().sum() > 0


def test_operations_do_what_they_say() -> None:
    dsa = DSA()
    x = _images(2, 1, 8)
    flip = dsa.apply(x, Augmentation("flip", (0.1,)))
    torch.testing.assert_close(flip, x.flip(3))
    assert torch.equal(dsa.apply(x, Augmentation("flip", (0.9,))), x)
    shifted = dsa.apply(x, Augmentation("crop", (0.99, 0.0)))  # +1 row, -1 column at 8x8
    assert shifted[:, :, 0].abs().sum() == 0 and shifted[:, :, :, -1].abs().sum() == 0
    torch.testing.assert_close(shifted[:, :, 1:, :-1], x[:, :, :-1, 1:])
    cut = dsa.apply(x, Augmentation("cutout", (0.5, 0.5)))
    assert (cut == 0).all(dim=(0, 1)).sum() == 16  # a 4x4 square at 8x8
    same = dsa.apply(x, Augmentation("scale", (0.5, 0.5)))  # scale 1/1.2 + 0.5 * (...) ~ 1
    assert same.shape == x.shape
    unrotated = dsa.apply(x, Augmentation("rotate", (0.5,)))  # 0 degrees
    torch.testing.assert_close(unrotated, x, atol=1e-5, rtol=1e-5)
    bright = dsa.apply(x, Augmentation("color", (1.0, 0.5, 0.5)))  # +0.5, saturation x1, x1
    torch.testing.assert_close(bright, x + 0.5)


def test_empty_batch_and_none_strategy() -> None:
    dsa = DSA()
    empty = torch.zeros(0, 3, 8, 8, requires_grad=True)
    for op in OPERATIONS:
        assert dsa.apply(empty, _draw(op, dsa, 0)).shape == (0, 3, 8, 8)
    x = _images(2, 1, 8)
    assert DSA("none")(x, generator=torch.Generator())[0] is x
    assert DSA("flip_rotate").ops == ("flip", "rotate")
    with pytest.raises(ConfigError):
        DSA("colour_crop")
    with pytest.raises(ConfigError):
        dsa.apply(torch.zeros(3, 8, 8), Augmentation("flip", (0.1,)))


@pytest.mark.parametrize("op", OPERATIONS)
def test_vjp_is_the_adjoint_autograd_computes(op: str) -> None:
    """DSA.vjp (the hand-written adjoint the matching step uses) equals autograd through
    DSA.apply, for every operation, at 1 and 3 channels, square and odd sizes."""
    dsa = DSA()
    for seed in range(6):
        aug = _draw(op, dsa, seed)
        for shape in ((3, 1, 8, 8), (2, 3, 32, 32), (2, 2, 7, 9)):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(shape, dtype=torch.float64, generator=g).requires_grad_(True)
            grad = torch.randn(shape, dtype=torch.float64, generator=g)
            (expect,) = torch.autograd.grad(dsa.apply(x, aug), x, grad)
            got = dsa.vjp(x.detach(), grad, aug)
            torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-12)


def test_a_drawn_augmentation_applies_and_transposes_its_draw() -> None:
    dsa = DSA()
    x, grad = _images(2, 1, 8, 1), _images(2, 1, 8, 2)
    for seed in range(8):
        drawn = dsa.draw(torch.Generator().manual_seed(seed))
        aug = dsa.sample(torch.Generator().manual_seed(seed))
        assert drawn.aug == aug
        torch.testing.assert_close(drawn(x), dsa.apply(x, aug))
        torch.testing.assert_close(drawn.vjp(x, grad), dsa.vjp(x, grad, aug))
        # <grad, A x> == <A^T grad, x> for the affine part: A(x) - A(0) is linear
        lhs = (grad * (drawn(x) - drawn(torch.zeros_like(x)))).sum()
        rhs = (drawn.vjp(x, grad) * x).sum()
        assert abs(lhs.item() - rhs.item()) <= 1e-4 * max(1.0, abs(lhs.item()))
