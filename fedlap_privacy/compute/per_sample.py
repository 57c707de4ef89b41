"""Per-record gradients, gradient norms and losses (docs/accounting.md, docs/audit.md).

Shared by DP training (``fl.methods.dp``: per-record gradients to clip) and the membership-inference
audit (per-record losses and gradient norms). The loss of a record is the cross-entropy of
that record alone, so the per-record gradient is ``grad_w CE(model(x_i), y_i)``.

Three implementations, the same numbers up to rounding:

* ``"fused"`` (the default for the package's ConvNet on the CPU,
  :func:`fedlap_privacy.models.ConvNet.fused_blocks`): the forward through the fused
  GroupNorm -> ReLU -> pooling kernels (:mod:`fedlap_privacy.compute.kernels`) and a backward
  written out layer by layer without autograd: the per-record cross-entropy gradient
  ``softmax - onehot``, the linear layer's outer products, each block's fused backward (which
  also returns every record's GroupNorm weight and bias gradients, per plane) and the
  per-record convolution weight gradients below. The hook path is its oracle in the tests.
  It is the ``per_sample`` fast path of :mod:`fedlap_privacy.compute.fast_paths`: switched off
  there (or the kernels), ``"auto"`` takes the hook path.
* ``"hooks"`` (the default for other models where it applies): one forward pass with the
  model's parameters detached (``torch.func.functional_call``) and forward hooks that record
  each parametrised layer's input and output; one backward pass for the gradients with
  respect to the layer outputs only (no batch-summed weight gradients are computed); then the
  per-record parameter gradients layer by layer — Conv2d through a weight-gradient
  convolution with the batch folded into the groups (unfold + batched matmul on maps of at
  most 32 positions), Linear through a batched matmul, GroupNorm through
  ``sum(grad_out * x_hat)``. Measured
  faster than both ``torch.func.vmap(grad)`` and Opacus' ``GradSampleModule`` on the ConvNet
  (``benchmarks/speed/dp_step.py``). Applies when every module that owns parameters is exactly a
  ``Conv2d`` (zero, numeric padding), ``Linear`` or ``GroupNorm`` and no parameter is shared;
  if a recorded layer input/output is modified in place, ``"auto"`` falls back to ``"vmap"``.
* ``"vmap"``: ``torch.func.vmap(torch.func.grad(...))`` over the records, for any model
  torch.func can trace. Its batched GroupNorm rounds differently from the native kernel; on a
  pre-activation that lands exactly on a ReLU kink in one and not the other, that record's
  gradient differs visibly from a per-record backward loop (seen on 1 of 256 MNIST-sized
  records at ~1e-2 absolute). The hook path uses the same kernels as the loop.

The fused and hook paths' passes (each layer's input and output gradient) are shared with
:mod:`fedlap_privacy.compute.ghost_clipping`, which computes DP's clipped sum from them without
forming every per-record gradient.

All assume records do not interact in the forward pass (no BatchNorm in training mode),
as per-record gradients (and DP-SGD) require. None leaves anything on the model: the
hooks are removed in ``finally``, parameters are never written, the module mode is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.kernels import block_backward, block_forward, winograd
from fedlap_privacy.compute.kernels.winograd import conv2d, conv2d_backward
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.models import ConvNet, has_hooks

Method = Literal["auto", "fused", "hooks", "vmap"]

__all__ = [
    "hooks_supported",
    "per_sample_grad_norms",
    "per_sample_grads",
    "per_sample_losses",
]

_HOOK_TYPES: tuple[type[nn.Module], ...] = (nn.Conv2d, nn.Linear, nn.GroupNorm)


class _InPlaceModified(RuntimeError):
    """A recorded layer input/output was changed in place; the hook path cannot be used."""


def hooks_supported(model: nn.Module) -> bool:
    """True when :func:`per_sample_grads` can use the hook-based implementation on ``model``."""
    seen: set[int] = set()
    for module in model.modules():
        direct = dict(module.named_parameters(recurse=False))
        if not direct:
            continue
        if type(module) not in _HOOK_TYPES or not set(direct) <= {"weight", "bias"}:
            return False
        if isinstance(module, nn.Conv2d) and (
            module.padding_mode != "zeros" or isinstance(module.padding, str)
        ):
            return False
        for p in direct.values():
            if id(p) in seen:
                return False
            seen.add(id(p))
    return True


# Output positions up to which the unfold + bmm route beats the grouped convolution (measured
# on the ConvNet on CPU: at 2x2 and 4x4 maps the grouped weight gradient is memory-bound).
_UNFOLD_MAX_POSITIONS = 32


def _conv_weight_grads(module: nn.Conv2d, inp: Tensor, gy: Tensor) -> Tensor:
    """Per-record Conv2d weight gradients, shape ``(B, *weight.shape)``."""
    batch, groups = inp.shape[0], module.groups
    c_in, c_out = module.in_channels, module.out_channels
    positions = gy.shape[2] * gy.shape[3]
    if positions <= _UNFOLD_MAX_POSITIONS:
        # Small maps: im2col and one batched matrix product per group.
        cols = F.unfold(inp, module.kernel_size, module.dilation, module.padding, module.stride)
        cols = cols.view(batch, groups, -1, positions)  # (B, g, c_in/g * kh * kw, T)
        g = gy.reshape(batch, groups, c_out // groups, positions)
        gw = torch.matmul(g, cols.transpose(2, 3))  # (B, g, c_out/g, c_in/g * kh * kw)
        return gw.reshape(batch, *module.weight.shape)
    # Large maps: a convolution with the batch folded into the groups, so that the weight
    # gradient of group (b, j) is record b's gradient for group j.
    weight_shape = [batch * c_out, c_in // groups, *module.kernel_size]
    gw = torch.ops.aten.convolution_backward(
        gy.reshape(1, batch * c_out, *gy.shape[2:]),
        inp.reshape(1, batch * c_in, *inp.shape[2:]),
        inp.new_empty(weight_shape),  # only its shape is read; empty avoids touching memory
        None,
        list(module.stride),
        list(module.padding),
        list(module.dilation),
        False,
        [0, 0],
        batch * groups,
        [False, True, False],
    )[1]
    return gw.view(batch, *module.weight.shape)


def _layer_grads(module: nn.Module, inp: Tensor, gy: Tensor) -> dict[str, Tensor]:
    """Per-record gradients of ``module``'s own parameters from its input and output gradient."""
    batch = inp.shape[0]
    out: dict[str, Tensor] = {}
    if isinstance(module, nn.Conv2d):
        if module.weight is not None:
            out["weight"] = _conv_weight_grads(module, inp, gy)
        if module.bias is not None:
            out["bias"] = gy.sum(dim=(2, 3))
    elif isinstance(module, nn.Linear):
        x2 = inp.reshape(batch, -1, module.in_features)
        g2 = gy.reshape(batch, -1, module.out_features)
        if module.weight is not None:
            out["weight"] = torch.bmm(g2.transpose(1, 2), x2)
        if module.bias is not None:
            out["bias"] = g2.sum(dim=1)
    elif isinstance(module, nn.GroupNorm):
        channels = module.num_channels
        g2 = gy.reshape(batch, channels, -1)
        if module.weight is not None:
            x_hat = F.group_norm(inp, module.num_groups, None, None, module.eps)
            out["weight"] = (g2 * x_hat.reshape(batch, channels, -1)).sum(dim=2)
        if module.bias is not None:
            out["bias"] = g2.sum(dim=2)
    else:  # pragma: no cover - guarded by hooks_supported
        raise TypeError(f"no per-sample rule for {type(module).__name__}")
    return out


def _hook_capture(model: nn.Module, x: Tensor, y: Tensor) -> list[tuple[nn.Module, Tensor, Tensor]]:
    """Each parametrised layer call of one forward through hooks, as (module, its input, the
    gradient of the summed cross-entropy with respect to its output), in call order."""
    layers = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    records: list[tuple[nn.Module, Tensor, Tensor, int, int]] = []

    def record(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        records.append((module, args[0], output, args[0]._version, output._version))

    detached = {name: p.detach() for name, p in model.named_parameters()}
    handles = [m.register_forward_hook(record) for m in layers]
    try:
        with torch.enable_grad():
            # The input requires grad only so that a graph exists (parameters are detached);
            # its own gradient is never computed.
            x_in = x.detach().requires_grad_(True)
            logits = functional_call(model, detached, (x_in,))
            loss = F.cross_entropy(logits, y, reduction="sum")
            for _, inp, output, v_in, v_out in records:
                if inp._version != v_in or output._version != v_out:
                    raise _InPlaceModified
            grads_out = torch.autograd.grad(loss, [r[2] for r in records], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return [(module, inp.detach(), torch.zeros_like(output) if gy is None else gy)
            for (module, inp, output, _, _), gy in zip(records, grads_out, strict=True)]


def _hook_grads(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Per-record gradients of one chunk through forward hooks (see the module docstring)."""
    prefixes = {module: name for name, module in model.named_modules()}
    result: dict[str, Tensor] = {}
    for module, inp, gy in _hook_capture(model, x, y):
        prefix = prefixes[module]
        for pname, g in _layer_grads(module, inp, gy).items():
            key = f"{prefix}.{pname}" if prefix else pname
            result[key] = result[key] + g if key in result else g  # module called twice
    for name, p in model.named_parameters():  # a layer never called contributes zero
        if name not in result:
            result[name] = p.new_zeros((x.shape[0], *p.shape))
    return result


#: a convolution's input, kernel and output-gradient tiles where it ran through Winograd's
#: F(4x4, 3x3)
TransformedInputs = dict[nn.Module, winograd.ConvTiles]


def _fused_capture(
    model: ConvNet, blocks: list[tuple[nn.Conv2d, nn.GroupNorm]], x: Tensor, y: Tensor
) -> tuple[list[tuple[nn.Module, Tensor, Tensor]], dict[str, Tensor], TransformedInputs]:
    """The fused forward and written-out backward of one chunk (module docstring): the
    classifier's and every convolution's (module, input, output gradient), every record's
    GroupNorm gradients by parameter name (the fused backward returns them), and the input,
    kernel and (but for the first block's) output-gradient tiles of the convolutions that
    ran through Winograd's F(4x4, 3x3), which a batch weight gradient can reuse."""
    saved: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # block input, conv output, stats
    names = {module: name for name, module in model.named_modules()}
    transformed: TransformedInputs = {}
    with torch.no_grad():
        h = x
        for conv, norm in blocks:
            if has_hooks(conv):  # the module itself, so that its hooks still run
                z = conv(h)
            elif winograd.applies(h, conv.weight, conv):
                tiles = winograd.ConvTiles(winograd.input_tiles(h),
                                           winograd.weight_tiles(conv.weight))
                transformed[conv] = tiles
                z = winograd.forward(tiles.inputs, tiles.weight, conv.bias)
            else:
                z = conv2d(conv, h, conv.weight, conv.bias)
            out, mean, rstd = block_forward(z, norm.weight, norm.bias, norm.eps)
            saved.append((h, z, mean, rstd))
            h = out
        flat = h.flatten(1)
        logits = model.classifier(flat)
        g = torch.softmax(logits, dim=1)  # d CE(logits_i, y_i) / d logits_i
        g[torch.arange(len(y), device=g.device), y] -= 1
        layers: list[tuple[nn.Module, Tensor, Tensor]] = [(model.classifier, flat, g)]
        norm_grads: dict[str, Tensor] = {}
        gh = (g @ model.classifier.weight).view_as(h)
        for i in reversed(range(len(blocks))):
            conv, norm = blocks[i]
            h_in, z, mean, rstd = saved[i]
            gz, norm_grads[f"{names[norm]}.weight"], norm_grads[f"{names[norm]}.bias"] = (
                block_backward(z, gh, norm.weight, norm.bias, mean, rstd))
            layers.append((conv, h_in, gz))
            if i > 0 and conv in transformed:
                tiles = transformed[conv]
                tiles.grad = winograd.grad_tiles(gz)
                gh = winograd.input_grad(tiles.grad, tiles.weight)
            elif i > 0:
                gh, _ = conv2d_backward(conv, gz, h_in, conv.weight, (True, False))
    return layers, norm_grads, transformed


def _fused_grads(model: ConvNet, blocks: list[tuple[nn.Conv2d, nn.GroupNorm]], x: Tensor,
                 y: Tensor) -> dict[str, Tensor]:
    """Per-record gradients of one chunk through the fused blocks (module docstring)."""
    names = {module: name for name, module in model.named_modules()}
    layers, grads, _ = _fused_capture(model, blocks, x, y)
    with torch.no_grad():
        for module, inp, gy in layers:
            for pname, grad in _layer_grads(module, inp, gy).items():
                grads[f"{names[module]}.{pname}"] = grad
    return grads


def _vmap_grads(
    model: nn.Module, x: Tensor, y: Tensor, chunk_size: int | None
) -> dict[str, Tensor]:
    """Per-record gradients through ``torch.func.vmap(grad(...))``."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    def loss_one(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        logits = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return F.cross_entropy(logits, yi.unsqueeze(0))

    fn: Callable[..., dict[str, Tensor]] = vmap(
        grad(loss_one), in_dims=(None, 0, 0), chunk_size=chunk_size
    )
    with torch.enable_grad():
        return fn(params, x, y)


def _chunked(
    grads_of: Callable[[Tensor, Tensor], dict[str, Tensor]],
    named: list[tuple[str, nn.Parameter]],
    x: Tensor,
    y: Tensor,
    chunk_size: int | None,
) -> list[Tensor]:
    """``grads_of`` over chunks of ``chunk_size`` records, as one tensor per parameter."""
    batch = x.shape[0]
    step = batch if chunk_size is None else chunk_size
    if step >= batch:
        grads = grads_of(x, y)
        return [grads[name] for name, _ in named]
    out = [p.new_empty((batch, *p.shape)) for _, p in named]
    for start in range(0, batch, step):
        chunk = grads_of(x[start : start + step], y[start : start + step])
        for dst, (name, _) in zip(out, named, strict=True):
            dst[start : start + step] = chunk[name]
    return out


def per_sample_grads(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    chunk_size: int | None = None,
    *,
    method: Method = "auto",
) -> list[Tensor]:
    """Gradient of each record's cross-entropy loss with respect to every parameter.

    Returns one tensor per parameter, in the order of ``model.parameters()``, of shape
    ``(B, *param.shape)`` with ``B = x.shape[0]`` (``B = 0`` gives empty tensors). Records are
    processed ``chunk_size`` at a time (all at once when ``None``) to bound memory. ``x`` and
    ``y`` must be on the parameters' device. ``method`` picks the implementation (module
    docstring); ``"auto"`` takes ``"fused"`` for the ConvNet where its kernels run and the
    ``per_sample`` fast path is on (:mod:`fedlap_privacy.compute.fast_paths`), else ``"hooks"``
    where :func:`hooks_supported` holds, else ``"vmap"``.
    """
    if x.shape[0] != y.shape[0]:
        raise ConfigError(f"x has {x.shape[0]} records but y has {y.shape[0]} labels")
    if chunk_size is not None and chunk_size < 1:
        raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
    if method not in ("auto", "fused", "hooks", "vmap"):
        raise ConfigError(f"unknown per-sample method {method!r}")
    named = list(model.named_parameters())
    batch = x.shape[0]
    if batch == 0:
        return [p.new_zeros((0, *p.shape)) for _, p in named]
    fused_on = fast_paths.current().per_sample
    blocks = model.fused_blocks(x) if fused_on and isinstance(model, ConvNet) else None
    if method == "fused" and blocks is None:
        raise ConfigError("per_sample_grads(method='fused') needs the package's ConvNet on the "
                          "CPU with the fused kernels built (fedlap_privacy.compute.kernels) "
                          "and the per-sample fast path on (fedlap_privacy.compute.fast_paths)")
    if blocks is not None and method in ("auto", "fused"):
        return _chunked(lambda xc, yc: _fused_grads(model, blocks, xc, yc), named, x, y,
                        chunk_size)
    use_hooks = method == "hooks" or (method == "auto" and hooks_supported(model))
    if method == "hooks" and not hooks_supported(model):
        raise ConfigError("per_sample_grads(method='hooks') does not support this model")
    if use_hooks:
        try:
            return _chunked(lambda xc, yc: _hook_grads(model, xc, yc), named, x, y,
                            chunk_size)
        except _InPlaceModified:
            if method == "hooks":
                raise ConfigError(
                    "per_sample_grads(method='hooks'): a layer's input or output is modified "
                    "in place (e.g. ReLU(inplace=True)); use method='vmap'"
                ) from None
    grads = _vmap_grads(model, x, y, chunk_size)
    return [grads[name] for name, _ in named]


def _model_device(model: nn.Module, fallback: torch.device) -> torch.device:
    p = next(model.parameters(), None)
    return fallback if p is None else p.device


def per_sample_grad_norms(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 256) -> Tensor:
    """L2 norm of each record's gradient over ALL parameters jointly, shape ``(N,)``.

    The white-box audit feature (docs/audit.md#features-and-attacks) and the quantity DP
    clips (docs/accounting.md#sampled-gaussian-mechanism).
    Computed ``batch_size`` records at a time on the model's device; returned on ``x``'s.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    device = _model_device(model, x.device)
    norms: list[Tensor] = []
    for start in range(0, x.shape[0], batch_size):
        xb = x[start : start + batch_size].to(device)
        yb = y[start : start + batch_size].to(device)
        grads = per_sample_grads(model, xb, yb)
        sq = sum(torch.linalg.vector_norm(g.flatten(1), dim=1).square() for g in grads)
        norms.append(torch.as_tensor(sq, device=device).sqrt().to(x.device))
    if not norms:
        return x.new_zeros((0,))
    return torch.cat(norms)


def per_sample_losses(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 512) -> Tensor:
    """Cross-entropy loss of each record, shape ``(N,)``, without gradients (the black-box
    audit feature, docs/audit.md#features-and-attacks).

    Computed ``batch_size`` records at a time on the model's device, in the model's current
    mode (call ``model.eval()`` first where it matters); returned on ``x``'s device.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    device = _model_device(model, x.device)
    losses: list[Tensor] = []
    with torch.no_grad():
        for start in range(0, x.shape[0], batch_size):
            xb = x[start : start + batch_size].to(device)
            yb = y[start : start + batch_size].to(device)
            losses.append(F.cross_entropy(model(xb), yb, reduction="none").to(x.device))
    if not losses:
        return x.new_zeros((0,))
    return torch.cat(losses)
