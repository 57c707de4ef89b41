"""The fused GroupNorm -> ReLU -> 2x2 pooling kernels (fedlap_privacy.compute.kernels).

torch's own modules are the oracle: the forward, the backward and the backward of the
backward (what gradient matching differentiates) agree with them up to rounding in float32
and to 1e-12 in float64, where gradcheck and gradgradcheck also check them against finite
differences. The ConvNet uses the kernels only where nothing must see its modules run
(hooks, TorchScript, export), and its per-record gradients equal the hook path's. The build
is cached per machine in a private directory (its attacks: test_kernel_cache.py), and a
missing compiler falls back, the ConvNet's per-record gradients included (or, with
FEDLAP_KERNELS=require, fails with one line).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.fast_paths import KERNELS_ENV, FastPaths
from fedlap_privacy.compute.kernels import (
    block_forward,
    gn_relu_pool,
    load_kernels,
    reference_block,
)
from fedlap_privacy.compute.kernels import library as klib
from fedlap_privacy.compute.per_sample import per_sample_grads
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.models import ModelConfig, build_model

SHAPES = [(3, 4, 8, 8), (2, 3, 5, 7), (2, 2, 2, 2), (1, 5, 32, 32)]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    z = (torch.randn(shape, generator=g, dtype=dtype) * 2 + 0.3).requires_grad_()
    w = (torch.rand(c, generator=g, dtype=dtype) + 0.5).requires_grad_()
    b = (torch.randn(c, generator=g, dtype=dtype) * 0.3).requires_grad_()
    return z, w, b


def _fused(z, w, b):
    return gn_relu_pool(z, w, b, 1e-5)


def _reference(z, w, b):
    return reference_block(z, w, b, 1e-5)


@pytest.fixture(autouse=True)
def _kernels_on() -> Iterator[None]:
    """These tests exercise the kernels: the fallback would make every comparison vacuous."""
    if not fast_paths.current().kernels:
        pytest.skip("the kernels are switched off (FEDLAP_KERNELS, FEDLAP_FAST_PATHS)")
    with fast_paths.using(require_kernels=True):
        yield


def test_the_kernels_build_on_this_machine():
    library = load_kernels()
    assert library is not None and library.path.parent == klib.FOLDER  # the installed one


def test_the_reference_is_the_convnets_modules():
    model = build_model(ModelConfig(1, 8, 10, width=4, depth=1))
    z, w, b = _inputs((3, 4, 8, 8), torch.float32)
    norm, relu, pool = model.features[1:4]
    with torch.no_grad():
        norm.weight.copy_(w)
        norm.bias.copy_(b)
    assert torch.equal(_reference(z, w, b), pool(relu(norm(z))))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_backward_equal_torchs_kernels(shape, dtype):
    z, w, b = _inputs(shape, dtype)
    out, ref = _fused(z, w, b), _reference(z, w, b)
    assert out.shape == ref.shape
    tol = 2e-6 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    gp = torch.randn_like(ref)
    got = torch.autograd.grad(out, [z, w, b], gp)
    want = torch.autograd.grad(ref, [z, w, b], gp)
    for g_got, g_want in zip(got, want, strict=True):
        torch.testing.assert_close(g_got, g_want, atol=20 * tol, rtol=20 * tol)


@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (2, 2, 5, 3)])
def test_gradcheck_and_gradgradcheck_in_float64(shape):
    z, w, b = _inputs(shape, torch.float64, seed=1)
    assert torch.autograd.gradcheck(_fused, (z, w, b))
    assert torch.autograd.gradgradcheck(_fused, (z, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_double_backward_equals_torchs(dtype):
    """The matching step's pattern: gradients with create_graph, a loss on them, its
    gradient with respect to the input and the normalisation weight."""
    z, w, b = _inputs((4, 6, 8, 8), dtype, seed=2)
    upstream = torch.randn(4, 6, 4, 4, dtype=dtype, generator=torch.Generator().manual_seed(3))
    results = []
    for block in (_fused, _reference):
        out = block(z, w, b)
        grads = torch.autograd.grad((torch.tanh(out) * upstream).sum(), [z, w, b],
                                    create_graph=True)
        loss = sum((g.sin() * g).sum() for g in grads)
        results.append(torch.autograd.grad(loss, [z, w, b]))
    tol = 1e-4 if dtype == torch.float32 else 1e-11
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_a_third_derivative_is_refused():
    z, w, b = _inputs((2, 2, 4, 4), torch.float64)
    (gz,) = torch.autograd.grad(_fused(z, w, b).sum(), [z], create_graph=True)
    (gzz,) = torch.autograd.grad((gz * gz).sum(), [z], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gzz.sum().backward()


def test_planes_split_over_threads_give_the_same_result():
    z, w, b = _inputs((64, 32, 16, 16), torch.float32)  # above the per-thread threshold
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = block_forward(z, w, b, 1e-5)
        torch.set_num_threads(3)
        three = block_forward(z, w, b, 1e-5)
    finally:
        torch.set_num_threads(threads)
    for a, c in zip(one, three, strict=True):
        assert torch.equal(a, c)


def test_convnet_fuses_and_equals_its_modules():
    model = build_model(ModelConfig(1, 28, 10))
    x = torch.randn(6, 1, 28, 28)
    assert model.fused_blocks(x) is not None
    fused = model(x)
    with fast_paths.disabled("kernels"):
        assert model.fused_blocks(x) is None
        unfused = model(x)
    torch.testing.assert_close(fused, unfused, atol=1e-5, rtol=1e-5)


def test_a_hook_on_a_skipped_module_gets_the_modules_run():
    """Opacus' GradSampleModule and the per-sample hook path hook the GroupNorm: the fused
    forward would skip it, so the model runs its modules."""
    model = build_model(ModelConfig(1, 8, 10, width=8, depth=2))
    x = torch.randn(4, 1, 8, 8)
    seen: list[tuple[int, ...]] = []
    handle = model.features[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        assert model.fused_blocks(x) is None
        model(x)
    finally:
        handle.remove()
    assert seen == [(4, 8, 8, 8)]
    assert model.fused_blocks(x) is not None


def test_torchscript_and_export_run_the_modules(tmp_path: Path):
    model = build_model(ModelConfig(1, 8, 10, width=8, depth=2)).eval()
    x = torch.randn(3, 1, 8, 8)
    want = model(x)
    scripted = torch.jit.script(model)
    torch.testing.assert_close(scripted(x), want, atol=1e-5, rtol=1e-5)
    program = torch.export.export(model, (x,))
    torch.testing.assert_close(program.module()(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", [ModelConfig(1, 28, 10), ModelConfig(1, 8, 10, width=32,
                                                                         depth=2)])
@pytest.mark.parametrize("chunk", [None, 5])
def test_fused_per_sample_grads_equal_the_hook_path(config, chunk):
    # A fixed init: with an unseeded one, about one draw in ten puts a pre-ReLU value within
    # rounding of 0 (9.5e-8 seen), the two paths' rounding give it opposite signs, and that
    # unit's gradient is passed by one and stopped by the other: a kink, not an error.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_model(config)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(12, 1, config.image_size, config.image_size, generator=g)
    y = torch.randint(0, 10, (12,), generator=g)
    fused = per_sample_grads(model, x, y, chunk, method="fused")
    hooks = per_sample_grads(model, x, y, chunk, method="hooks")
    for (name, p), a, c in zip(model.named_parameters(), fused, hooks, strict=True):
        assert a.shape == (12, *p.shape), name
        # a conv bias before GroupNorm has a gradient of exactly 0: both are rounding noise;
        # Winograd's F(4x4, 3x3) rounds to about 1e-5 of a tensor's scale in float32
        scale = c.abs().max().item()
        torch.testing.assert_close(a, c, atol=max(1e-6, 2e-5 * scale), rtol=1e-4, msg=name)
    assert per_sample_grads(model, x, y)[0].data_ptr() != fused[0].data_ptr()


def test_fused_per_sample_grads_need_the_convnet():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="fused"):
        per_sample_grads(model, torch.randn(3, 1, 2, 2), torch.zeros(3, dtype=torch.int64),
                         method="fused")


def test_a_bad_mode_is_one_line():
    with pytest.raises(ConfigError, match="FEDLAP_KERNELS must be one of auto, off, require"):
        FastPaths.from_env({KERNELS_ENV: "fast"})


def test_without_the_library_auto_falls_back_and_require_refuses(
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(klib, "library_path", lambda: None)  # installed without a compiler
    klib._load.cache_clear()
    klib._warn_fallback.cache_clear()
    try:
        with pytest.raises(ConfigError, match="cannot be loaded: they were not built"):
            load_kernels()
        with fast_paths.using(require_kernels=False):
            with pytest.warns(RuntimeWarning, match="torch's kernels"):
                assert load_kernels() is None
            z, w, b = _inputs((2, 3, 4, 4), torch.float32)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # warned once per process, not per call
                torch.testing.assert_close(_fused(z, w, b), _reference(z, w, b))
                # a DP client's per-record gradients run on torch's kernels: each record's
                # is its own loss's gradient, and they sum to the batch's
                torch.manual_seed(0)
                model = build_model(ModelConfig(1, 8, 3)).double()
                x = torch.randn(5, 1, 8, 8, dtype=torch.float64)
                y = torch.tensor([0, 1, 2, 0, 1])
                assert model.fused_blocks(x) is None
                per_record = per_sample_grads(model, x, y)
                loss = F.cross_entropy(model(x[3:4]), y[3:4])
                one = torch.autograd.grad(loss, list(model.parameters()))
                batch = torch.autograd.grad(F.cross_entropy(model(x), y, reduction="sum"),
                                            list(model.parameters()))
                for g, o, s in zip(per_record, one, batch, strict=True):
                    torch.testing.assert_close(g[3], o, rtol=1e-10, atol=1e-12)
                    torch.testing.assert_close(g.sum(0), s, rtol=1e-10, atol=1e-12)
    finally:
        klib._load.cache_clear()
        klib._warn_fallback.cache_clear()


def test_a_library_built_from_other_sources_or_for_another_processor_is_not_loaded(
        monkeypatch: pytest.MonkeyPatch):
    """An edited source in a checkout, or an installation shared with another processor:
    the library's recorded key no longer matches, and it is refused, not run."""
    library = load_kernels()
    assert library is not None
    native = not library.library.fedlap_kernels_key().endswith(b":portable")
    for name in ("sources_digest", "processor") if native else ("sources_digest",):
        with monkeypatch.context() as m:
            m.setattr(klib, name, lambda *_: "0" * 16)
            klib._load.cache_clear()
            try:
                with pytest.raises(ConfigError, match=r"other sources|another processor"):
                    load_kernels()
            finally:
                klib._load.cache_clear()
    assert load_kernels() is not None


def test_matching_step_equals_the_modules_run():
    """One FedLAP-DP matching step (second-order gradients through the whole ConvNet) with
    the fused blocks and with the modules: the same image gradient up to rounding."""
    from fedlap_privacy.fl.methods.fedlap import structurally_zero
    from fedlap_privacy.fl.methods.matching import MatchTarget

    torch.manual_seed(0)  # the weights, whatever ran before
    model = build_model(ModelConfig(1, 28, 10))
    g = torch.Generator().manual_seed(5)
    images = torch.randn(20, 1, 28, 28, generator=g, requires_grad=True)
    labels = torch.arange(2).repeat_interleave(10)
    params = list(model.parameters())
    include = [not zero for zero in structurally_zero(model)]
    matched = [p for p, keep in zip(params, include, strict=True) if keep]
    target = MatchTarget([torch.randn(p.shape, generator=g) for p in params], include=include)

    def image_grad() -> torch.Tensor:
        loss = F.cross_entropy(model(images), labels)
        g_syn = torch.autograd.grad(loss, matched, create_graph=True)
        return torch.autograd.grad(target.distance(g_syn), [images])[0]

    fused = image_grad()
    with fast_paths.disabled("kernels"):
        unfused = image_grad()
    torch.testing.assert_close(fused, unfused, atol=1e-4 * unfused.abs().max().item(), rtol=0)


def test_a_whole_client_round_in_float64_equals_the_reference_run():
    """FedLAP-DP's client round on digits (10 DP gradients, 50 second-order matching steps,
    local steps) with every fast path on and with all of them off (torch's modules,
    autograd's double backward, the hook path's per-record gradients): in float64 the
    synthetic sets agree to 1e-10, so the fast paths compute the same function. (In float32
    the image step, lr_img = 100 with momentum, amplifies rounding until the sets visibly
    differ, as between any two float32 implementations.)"""
    from fedlap_privacy.data.datasets import load_dataset
    from fedlap_privacy.fl.config import TrainConfig
    from fedlap_privacy.fl.engine.simulation import client_parts, default_model_config
    from fedlap_privacy.fl.methods.augment import DSA
    from fedlap_privacy.fl.methods.fedlap import SyntheticSet, client_approximation, init_synthetic

    cfg = TrainConfig()
    data = load_dataset("digits")
    part = client_parts(cfg, data)[0]
    x = torch.from_numpy(data.x_train[part]).double()
    y = torch.from_numpy(data.y_train[part])
    torch.manual_seed(0)
    model = build_model(default_model_config(cfg, data)).double()

    def images() -> torch.Tensor:
        g = torch.Generator().manual_seed(123)
        syn = init_synthetic(x, y, cfg.ipc, cfg.init, g)
        syn = SyntheticSet(syn.images.double(), syn.labels)
        return client_approximation(model, x, y, syn, cfg, cfg.lr_net, g, DSA().draw
                                    ).synthetic.images

    fused = images()
    with fast_paths.disabled():
        unfused = images()
    assert (fused - unfused).abs().max().item() < 1e-10


def test_a_global_module_hook_gets_the_modules_run():
    model = build_model(ModelConfig(1, 8, 10, width=8, depth=2))
    x = torch.randn(2, 1, 8, 8)
    seen: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: seen.append(type(m).__name__))
    try:
        assert model.fused_blocks(x) is None
        model(x)
    finally:
        handle.remove()
    assert seen.count("GroupNorm") == 2 and seen.count("AvgPool2d") == 2
