"""The one door to the fast paths (fedlap_privacy.compute.fast_paths).

The switches are read from the environment in one place (``FEDLAP_FAST_PATHS`` and the
per-path variables), and :func:`fast_paths.disabled` turns them off in a block. With every
path off the reference implementations run (torch's modules, autograd's double backward,
the hook path's per-record gradients) and compute what the fast paths compute: a ConvNet
forward and a DP step agree up to rounding (the whole client round in float64:
test_kernels.py, the server optimisation: test_second_order.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.allocator import AllocatorState, tune_allocator
from fedlap_privacy.compute.fast_paths import (
    ALLOCATOR_ENV,
    FAST_PATHS_ENV,
    FOLLOW_ENV,
    KERNELS_ENV,
    PATHS,
    FastPaths,
)
from fedlap_privacy.compute.per_sample import per_sample_grads
from fedlap_privacy.compute.runtime_env import apply_runtime_defaults
from fedlap_privacy.compute.second_order import supported_blocks
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.models import ModelConfig, build_model

ALL_ON = FastPaths()


@pytest.fixture
def all_on() -> Iterator[None]:
    """Every path on and the kernels required (skipped where they are switched off)."""
    if not fast_paths.current().kernels:
        pytest.skip("the kernels are switched off (FEDLAP_KERNELS, FEDLAP_FAST_PATHS)")
    with fast_paths.using(ALL_ON, require_kernels=True):
        yield


def test_the_environment_is_read_in_one_place():
    assert FastPaths.from_env({}) == ALL_ON
    assert FastPaths.from_env({FAST_PATHS_ENV: "off"}) == FastPaths.all_off()
    assert not any(getattr(FastPaths.all_off(), name) for name in PATHS)
    some = FastPaths.from_env({FAST_PATHS_ENV: "-second-order, -per-sample"})
    assert (some.second_order, some.per_sample, some.kernels, some.allocator) == (
        False, False, True, True)
    # the per-path variables keep working, and a path is on only where both leave it on
    assert not FastPaths.from_env({KERNELS_ENV: "off"}).kernels
    assert FastPaths.from_env({KERNELS_ENV: "require"}).require_kernels
    assert not FastPaths.from_env({ALLOCATOR_ENV: "system"}).allocator
    assert not FastPaths.from_env({FOLLOW_ENV: "0"}).follow_load
    assert not FastPaths.from_env({FAST_PATHS_ENV: "off", KERNELS_ENV: "auto"}).kernels
    no_kernels = FastPaths.from_env({FAST_PATHS_ENV: "-kernels"})
    assert no_kernels.second_order and not no_kernels.effective().second_order
    assert not no_kernels.effective().per_sample and no_kernels.effective().allocator
    for env, name in (({FAST_PATHS_ENV: "fast"}, FAST_PATHS_ENV),
                      ({FAST_PATHS_ENV: "-cuda"}, FAST_PATHS_ENV),
                      ({KERNELS_ENV: "fast"}, KERNELS_ENV),
                      ({ALLOCATOR_ENV: "jemalloc"}, ALLOCATOR_ENV)):
        with pytest.raises(ConfigError, match=name):
            FastPaths.from_env(env)


def test_disabled_switches_off_and_restores(all_on):
    with fast_paths.disabled() as off:
        assert off == dataclasses.replace(FastPaths.all_off(), require_kernels=True)
        assert fast_paths.current() is off
        with fast_paths.using(kernels=True):  # nested: one path back on
            assert fast_paths.current().kernels and not fast_paths.current().second_order
        assert not fast_paths.current().kernels
    assert fast_paths.current() == dataclasses.replace(ALL_ON, require_kernels=True)
    with fast_paths.disabled("second-order", "per_sample") as some:
        assert (some.second_order, some.per_sample, some.kernels) == (False, False, True)
    with pytest.raises(ConfigError, match="unknown fast path"), fast_paths.disabled("cuda"):
        pass


def test_each_path_asks_the_door(all_on):
    model = build_model(ModelConfig(1, 8, 10, width=8, depth=2))
    x = torch.randn(4, 1, 8, 8)
    y = torch.arange(4)
    assert model.fused_blocks(x) is not None and supported_blocks(model, x) is not None
    with fast_paths.disabled("kernels"):  # the others run on the kernels
        assert model.fused_blocks(x) is None and supported_blocks(model, x) is None
    with fast_paths.disabled("second-order"):
        assert model.fused_blocks(x) is not None and supported_blocks(model, x) is None
    per_sample_grads(model, x, y, method="fused")
    with fast_paths.disabled("per-sample"), pytest.raises(ConfigError, match="per-sample"):
        per_sample_grads(model, x, y, method="fused")
    with fast_paths.disabled("allocator"):
        assert tune_allocator().state is AllocatorState.SYSTEM
    env: dict[str, str] = {FAST_PATHS_ENV: "-huge-pages"}
    assert apply_runtime_defaults(env) == {} and "THP_MEM_ALLOC_ENABLE" not in env
    env = {}
    assert apply_runtime_defaults(env) == {"THP_MEM_ALLOC_ENABLE": "1"}


def test_a_convnet_forward_with_everything_off_equals_the_fast_one(all_on):
    torch.manual_seed(0)
    model = build_model(ModelConfig(1, 28, 10, width=16))
    x = torch.randn(5, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    fast = model(x)
    with fast_paths.disabled():
        reference = model(x)
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)


def test_a_dp_step_with_everything_off_equals_the_fast_one(all_on):
    """dp_gradient at sigma 0 (clipped, averaged per-record gradients): the fused per-record
    gradients against the hook path on torch's modules, to 1e-12 in float64."""
    from fedlap_privacy.fl.methods.dp import dp_gradient

    torch.manual_seed(0)
    model = build_model(ModelConfig(1, 8, 10, width=16, depth=2)).double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 1, 8, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (40,), generator=g)

    def step() -> list[torch.Tensor]:
        return dp_gradient(model, x, y, 0.5, 0.0, 32, torch.Generator().manual_seed(3))

    fast = step()
    with fast_paths.disabled():
        reference = step()
    for a, b in zip(fast, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    assert any(a.abs().max() > 1e-3 for a in fast)  # not vacuously zero


def test_a_bad_switch_is_one_line_from_the_cli():
    from typer.testing import CliRunner

    from fedlap_privacy.cli.main import app

    result = CliRunner().invoke(app, ["train", "--rounds", "1"],
                                env={FAST_PATHS_ENV: "fastest"})
    assert result.exit_code == 2
    assert FAST_PATHS_ENV in result.output and "Traceback" not in result.output
