"""The written-out second-order pass of gradient matching (fedlap_privacy.compute.second_order).

Autograd is the oracle: differentiating its own backward graph (``create_graph=True``) it
computes ``d/dx D(grad_w CE(model(x), y))``; :func:`weight_grad_input_vjp` must give the
same to 1e-10 in float64 and to float32 rounding in float32, on every ConvNet shape the
package builds (8x8 with two blocks, 28x28 whose first convolution pads by 3, 3-channel
32x32), for any dD/dg, including parameters D leaves out. Where it cannot stand in for
autograd (not the ConvNet, kernels off, hooks), :func:`supported_blocks` says so.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.second_order import supported_blocks, weight_grad, weight_grad_input_vjp
from fedlap_privacy.models import ModelConfig, build_model

# the last: 128 channels, where the 16x16 convolution of 8 records runs through Winograd's
# F(4x4, 3x3) (on up to two torch threads: 128 tiles)
CONFIGS = [ModelConfig(1, 8, 10, width=32, depth=2), ModelConfig(1, 28, 10, width=8),
           ModelConfig(3, 32, 10, width=6), ModelConfig(1, 28, 10)]


@pytest.fixture(autouse=True)
def _written_out_on() -> Iterator[None]:
    paths = fast_paths.current()
    if not (paths.kernels and paths.second_order):
        pytest.skip("the written-out pass is switched off (FEDLAP_FAST_PATHS, FEDLAP_KERNELS)")
    with fast_paths.using(require_kernels=True):
        yield


def _autograd(model, x, y, u):
    """d/dx <u, g(x)> by autograd's double backward (the parameters whose u is None left out)."""
    x = x.clone().requires_grad_(True)
    params = [p for p, ui in zip(model.parameters(), u, strict=True) if ui is not None]
    loss = F.cross_entropy(model(x), y)
    g = torch.autograd.grad(loss, params, create_graph=True)
    inner = sum((gi * ui).sum() for gi, ui in
                zip(g, [ui for ui in u if ui is not None], strict=True))
    return torch.autograd.grad(inner, [x])[0], [gi.detach() for gi in g]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.in_channels}x{c.image_size}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_equals_autograds_double_backward(config: ModelConfig, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = build_model(config).to(dtype)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, config.in_channels, config.image_size, config.image_size,
                    generator=g, dtype=dtype)
    y = torch.randint(0, 10, (8,), generator=g)
    blocks = supported_blocks(model, x)
    assert blocks is not None
    for left_out in ((), (1, 5), tuple(range(0, len(params), 2))):  # conv biases; half
        u = [None if i in left_out else torch.randn(p.shape, generator=g, dtype=dtype)
             for i, p in enumerate(params)]
        expect, grads = _autograd(model, x, y, u)
        seen: list[list[torch.Tensor]] = []

        def adjoint(weight_grads: list[torch.Tensor], u=u, seen=seen):
            seen.append(weight_grads)
            return u

        got = weight_grad_input_vjp(model, blocks, x, y, adjoint)
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        scale = expect.abs().max().item()
        torch.testing.assert_close(got, expect, rtol=0, atol=tol * scale)
        # the adjoint saw the weight gradient itself, in parameter order
        kept = [w for w, ui in zip(seen[0], u, strict=True) if ui is not None]
        for a, b in zip(kept, grads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=tol * max(1.0, b.abs().max().item()))
    assert all(p.grad is None for p in params)  # nothing left on the model


def test_supported_only_where_it_computes_what_autograd_would() -> None:
    model = build_model(CONFIGS[0])
    x = torch.randn(2, 1, 8, 8)
    assert supported_blocks(model, x) is not None
    assert supported_blocks(torch.nn.Sequential(torch.nn.Flatten()), x) is None
    handle = model.classifier.register_forward_hook(lambda *_: None)
    assert supported_blocks(model, x) is None  # the written-out pass would skip the hook
    handle.remove()
    handle = model.features[0].register_forward_pre_hook(lambda *_: None)
    assert supported_blocks(model, x) is None
    handle.remove()
    assert supported_blocks(model, x.half()) is None  # no kernels for float16
    for path in ("kernels", "second-order"):
        with fast_paths.disabled(path):
            assert supported_blocks(model, x) is None


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.in_channels}x{c.image_size}")
def test_weight_grad_equals_autograd(config: ModelConfig) -> None:
    """The written-out first-order pass (the local steps' and the server's gradient): the
    batch mean and the record-weighted mean of the cross-entropy, to 1e-12 in float64."""
    torch.manual_seed(0)
    model = build_model(config).double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, config.in_channels, config.image_size, config.image_size,
                    generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (7,), generator=g)
    w = torch.rand(7, generator=g, dtype=torch.float64) + 0.1
    blocks = supported_blocks(model, x)
    assert blocks is not None
    for weights in (None, w):
        losses = F.cross_entropy(model(x), y, reduction="none")
        loss = losses.mean() if weights is None else (losses * w).sum() / w.sum()
        expect = torch.autograd.grad(loss, list(model.parameters()))
        got = weight_grad(model, blocks, x, y, weights)
        for a, b in zip(got, expect, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_server_optimisation_in_float64_equals_autograds() -> None:
    """Eq. 14/16 on five synthetic sets with DSA, momentum and the radius, written out and
    by autograd (the second-order fast path off): the same model to 1e-10 in float64."""
    from fedlap_privacy.fl.methods.augment import DSA
    from fedlap_privacy.fl.methods.fedlap import SyntheticSet, server_optimisation

    torch.manual_seed(0)
    start = build_model(CONFIGS[0]).double()
    g = torch.Generator().manual_seed(3)
    sets = [SyntheticSet(torch.randn(20, 1, 8, 8, generator=g, dtype=torch.float64),
                         torch.arange(2).repeat_interleave(10) + 2 * k) for k in range(5)]

    def trained() -> list[torch.Tensor]:
        model = build_model(CONFIGS[0]).double()
        model.load_state_dict(start.state_dict())
        server_optimisation(model, sets, [0.1, 0.2, 0.3, 0.2, 0.2], 2.0, 0.05, 30, 64,
                            torch.Generator().manual_seed(4), 0.9, DSA().draw)
        return [p.detach() for p in model.parameters()]

    written = trained()
    with fast_paths.disabled("second-order"):
        reference = trained()
    for a, b in zip(written, reference, strict=True):
        assert (a - b).abs().max().item() < 1e-10
