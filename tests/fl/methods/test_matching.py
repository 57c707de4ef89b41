"""The gradient-matching distance of docs/algorithms.md#matching-distance (Eq. 9-10),
fl.methods.matching."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.methods.matching import layer_distance, match_distance


def _one_minus_cos(a: list[float], b: list[float]) -> float:
    dot = sum(u * v for u, v in zip(a, b, strict=True))
    na = math.sqrt(sum(u * u for u in a))
    nb = math.sqrt(sum(v * v for v in b))
    return 1.0 - dot / (na * nb + 1e-6)


def _grads(seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 2, 2, 2), (3,), (4, 5), (4,)]  # conv weight, bias, linear weight, bias
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def test_layer_distance_by_hand() -> None:
    conv_r = torch.arange(1.0, 9.0).reshape(2, 1, 2, 2)  # rows (1..4), (5..8)
    conv_s = torch.tensor([[1.0, 0.0, 0.0, 0.0], [-5.0, -6.0, -7.0, -8.0]]).reshape(2, 1, 2, 2)
    expect = (
        _one_minus_cos([1, 2, 3, 4], [1, 0, 0, 0]) + _one_minus_cos([5, 6, 7, 8], [-5, -6, -7, -8])
    ) / 2
    assert layer_distance(conv_r, conv_s).item() == pytest.approx(expect, rel=1e-6)

    lin_r = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])
    lin_s = torch.tensor([[0.0, 1.0], [0.0, 5.0], [4.0, 3.0]])
    expect = (1.0 + _one_minus_cos([0, 2], [0, 5]) + _one_minus_cos([3, 4], [4, 3])) / 3
    assert expect == pytest.approx((1.0 + 0.0 + (1.0 - 24.0 / 25.0)) / 3, abs=1e-6)
    assert layer_distance(lin_r, lin_s).item() == pytest.approx(expect, rel=1e-6)

    bias_r, bias_s = torch.tensor([1.0, 2.0, 2.0]), torch.tensor([2.0, 1.0, 2.0])
    expect = _one_minus_cos([1, 2, 2], [2, 1, 2])  # a 1-D tensor is ONE row
    assert layer_distance(bias_r, bias_s).item() == pytest.approx(expect, rel=1e-6)
    total = match_distance([conv_r, lin_r, bias_r], [conv_s, lin_s, bias_s])
    parts = [layer_distance(conv_r, conv_s), layer_distance(lin_r, lin_s), expect]
    assert total.item() == pytest.approx(sum(float(p) for p in parts), rel=1e-6)


def test_identical_and_opposite() -> None:
    real = _grads(0)
    assert match_distance(real, [g.clone() for g in real]).item() == pytest.approx(0, abs=1e-4)
    opposite = match_distance(real, [-g for g in real]).item()
    assert opposite == pytest.approx(2.0 * len(real), abs=1e-4)
    for g in real:  # scale invariance of the cosine, per row (up to the 1e-6 in the cosine)
        assert layer_distance(g, 7.0 * g).item() == pytest.approx(0, abs=1e-5)


def test_zero_real_gradient_layer_is_skipped() -> None:
    real, syn = _grads(1), _grads(2)
    real[1] = torch.zeros_like(real[1])  # a conv bias before GroupNorm
    expect = sum(
        layer_distance(r, s) for i, (r, s) in enumerate(zip(real, syn, strict=True)) if i != 1
    )
    assert match_distance(real, syn).item() == pytest.approx(float(expect), rel=1e-9)
    only = match_distance(real, syn, include=[True, True, False, True])
    assert only.item() == pytest.approx(float(expect - layer_distance(real[2], syn[2])), rel=1e-9)


def test_mse_term() -> None:
    real, syn = _grads(3), _grads(4)
    real[3] = torch.zeros_like(real[3])  # skipped by the cosine, still in the MSE
    mse = sum(float((r - s).square().sum()) for r, s in zip(real, syn, strict=True))
    base = match_distance(real, syn).item()
    assert match_distance(real, syn, 0.1).item() == pytest.approx(base + 0.1 * mse, rel=1e-9)


def test_gradients_flow_to_synthetic() -> None:
    real = _grads(5)
    syn = [g.clone().requires_grad_(True) for g in _grads(6)]
    match_distance(real, syn, mse_weight=0.1).backward()
    for s in syn:
        assert s.grad is not None and torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0
    # Through a graph, as in FedLAP-DP: d distance / d image via create_graph.
    image = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    loss = (image @ w.T).square().sum()
    (g_syn,) = torch.autograd.grad(loss, [w], create_graph=True)
    match_distance([torch.randn(4, 3, dtype=torch.float64)], [g_syn]).backward()
    assert image.grad is not None and image.grad.abs().sum() > 0


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        match_distance(_grads(0), _grads(0)[:2])
    with pytest.raises(ConfigError):
        layer_distance(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ConfigError):
        match_distance([], [])


def test_match_target_equals_the_definition_on_convnet_gradients() -> None:
    """The fused MatchTarget (all layers in two segment sums, real side prepared once) equals
    the per-layer definition of Eq. 9-10 up to float32 rounding, with and without ``include``
    and the MSE term, and so does its gradient with respect to the synthetic gradients."""
    from fedlap_privacy.fl.methods.matching import MatchTarget
    from fedlap_privacy.models import ModelConfig, build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(1, 8, 10, width=16, depth=2))
    params = list(model.parameters())

    def grads(seed: int) -> list[Tensor]:
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(12, 1, 8, 8, generator=g), torch.randint(0, 10, (12,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        return list(torch.autograd.grad(loss, params))

    real = grads(1)
    syn = [g.requires_grad_(True) for g in grads(2)]
    include = [i % 3 != 1 for i in range(len(real))]
    for mse, inc in ((0.0, None), (0.1, include)):
        keep = [True] * len(real) if inc is None else inc
        expect = sum(
            layer_distance(r, s) * bool(r.ne(0).any()) + mse * (r - s).square().sum()
            for r, s, k in zip(real, syn, keep, strict=True) if k
        )
        target = MatchTarget(real, mse, include=inc)
        got = target.distance([syn[i] for i in target.included])
        want = float(expect.detach())
        assert abs(got.item() - want) <= 1e-5 * max(1.0, abs(want))
        d_expect = torch.autograd.grad(expect, syn, allow_unused=True)
        d_got = torch.autograd.grad(got, syn, allow_unused=True)
        for a, b in zip(d_expect, d_got, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert (a - b).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item())


def test_match_target_gradient_is_the_derivative_of_its_distance() -> None:
    """MatchTarget.gradient, the closed form the written-out matching step uses, equals
    autograd through MatchTarget.distance in float64 (with the MSE term, a layer left out,
    a real layer of zeros), and to float32 rounding in float32. At a synthetic row of zeros,
    where autograd's norm gives NaN, it is finite: the cosine's derivative along the real
    row."""
    from fedlap_privacy.fl.methods.matching import MatchTarget

    real = [*_grads(3), torch.zeros(2, 3, dtype=torch.float64)]
    syn = [*_grads(4), torch.randn(2, 3, dtype=torch.float64)]
    for mse, include in ((0.0, None), (0.3, [True, False, True, True, True])):
        target = MatchTarget(real, mse, include=include)
        parts = [syn[i].clone().requires_grad_(True) for i in target.included]
        expect = torch.autograd.grad(target.distance(parts), parts)
        got = target.gradient([p.detach() for p in parts])
        for e, g in zip(expect, got, strict=True):
            assert g.shape == e.shape
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
        single = MatchTarget([r.float() for r in real], mse, include=include)
        got32 = single.gradient([syn[i].float() for i in single.included])
        for e, g in zip(expect, got32, strict=True):
            torch.testing.assert_close(g, e.float(), rtol=1e-5, atol=1e-6)
    syn[0][1] = 0.0
    target = MatchTarget(real)
    zero_row = target.gradient(syn)[0][1]
    torch.testing.assert_close(zero_row, -real[0][1] / 3 / 1e-6)  # -w_r a_r / (0 + eps)
    with pytest.raises(ConfigError):
        target.gradient(syn[:2])
