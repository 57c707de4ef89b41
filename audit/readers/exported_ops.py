"""The operators an exported program may call, and the checks on their arguments
(docs/audit.md#auditing-a-model-trained-elsewhere).

A positive list: the dense ``aten`` operators that ``torch.export`` writes for classifiers
(linear and convolutional layers, activations, BatchNorm / LayerNorm / GroupNorm /
InstanceNorm / RMSNorm, dropout, pooling, shape and view operators, element-wise arithmetic,
reductions, the size queries and runtime asserts of a dynamic batch), in both the training IR
``torch.export.export`` returns and the core ATen of ``run_decompositions()``, plus their
obvious dense relatives. Everything else is refused by name before the program runs: sparse
and quantized constructors, operators that take sizes or offsets on trust
(``_sparse_coo_tensor_with_dims_and_tensors``, ``as_strided``, ``set_``, ``empty``, whose
memory is uninitialised), operators with side effects (``_print``, in-place updates other
than ``detach_``, random fills), and anything not listed.

A listed operator can still trust an argument its CPU kernel does not check: the BatchNorm
kernels read one weight, bias, mean and variance per channel of the input without checking
that the tensors hold that many (a one-element weight for a 3,000,000-channel input reads
far past it). :func:`check_arguments` checks them, and runs BatchNorm and InstanceNorm in
training mode without the running statistics, which those operators would update in place.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from fedlap_privacy.audit.readers.exported_schema import Refused

__all__ = ["ALLOWED", "CONVOLUTIONS", "NO_META", "check_arguments", "check_string"]

_LINEAR = {"linear.default", "addmm.default", "mm.default", "bmm.default", "matmul.default",
           "baddbmm.default", "conv1d.default", "conv2d.default", "conv3d.default",
           "conv1d.padding", "conv2d.padding", "conv3d.padding", "convolution.default",
           "conv_transpose1d.default", "conv_transpose2d.input", "conv_transpose3d.input"}
#: the convolutions, charged their im2col buffer as well (:mod:`.exported_budget`)
CONVOLUTIONS: frozenset[str] = frozenset(name for name in _LINEAR if name.startswith("conv"))
_ACTIVATIONS = {"relu.default", "relu6.default", "gelu.default", "silu.default",
                "sigmoid.default", "tanh.default", "elu.default", "leaky_relu.default",
                "hardtanh.default", "hardswish.default", "hardsigmoid.default",
                "softplus.default", "mish.default", "prelu.default", "glu.default",
                "clamp.default", "clamp.Tensor", "clamp_min.default", "clamp_max.default",
                "softmax.int", "log_softmax.int", "_softmax.default", "_log_softmax.default"}
_BATCH_NORMS = {"batch_norm.default", "_native_batch_norm_legit_no_training.default",
                "_native_batch_norm_legit.no_stats", "instance_norm.default"}
_NORMS = {*_BATCH_NORMS, "layer_norm.default", "native_layer_norm.default",
          "group_norm.default", "native_group_norm.default", "rms_norm.default",
          "dropout.default"}
_POOLING = {"max_pool1d.default", "max_pool2d.default", "max_pool3d.default",
            "max_pool2d_with_indices.default", "max_pool3d_with_indices.default",
            "avg_pool1d.default", "avg_pool2d.default", "avg_pool3d.default",
            "adaptive_avg_pool1d.default", "adaptive_avg_pool2d.default",
            "_adaptive_avg_pool2d.default", "adaptive_avg_pool3d.default",
            "_adaptive_avg_pool3d.default", "adaptive_max_pool1d.default",
            "adaptive_max_pool2d.default"}
_SHAPES = {"view.default", "reshape.default", "_unsafe_view.default", "flatten.using_ints",
           "unflatten.int", "permute.default", "t.default", "transpose.int",
           "unsqueeze.default", "squeeze.default", "squeeze.dim", "squeeze.dims",
           "expand.default", "slice.Tensor", "select.int", "narrow.default",
           "contiguous.default", "clone.default", "cat.default", "stack.default",
           "split.Tensor", "split_with_sizes.default", "chunk.default", "unbind.int",
           "alias.default", "detach.default", "detach_.default", "lift_fresh_copy.default",
           "_to_copy.default", "to.dtype", "to.dtype_layout", "type_as.default",
           "pad.default", "constant_pad_nd.default", "repeat.default"}
_FACTORIES = {"zeros.default", "ones.default", "full.default", "zeros_like.default",
              "ones_like.default", "full_like.default", "new_zeros.default",
              "new_ones.default", "new_full.default", "arange.default", "arange.start",
              "arange.start_step", "scalar_tensor.default"}
_ELEMENTWISE = {f"{name}.{overload}" for name, overloads in {
    "add": ("Tensor", "Scalar"), "sub": ("Tensor", "Scalar"), "rsub": ("Tensor", "Scalar"),
    "mul": ("Tensor", "Scalar"), "div": ("Tensor", "Scalar", "Tensor_mode"),
    "pow": ("Tensor_Scalar", "Tensor_Tensor", "Scalar"),
    "gt": ("Tensor", "Scalar"), "ge": ("Tensor", "Scalar"), "lt": ("Tensor", "Scalar"),
    "le": ("Tensor", "Scalar"), "eq": ("Tensor", "Scalar"), "ne": ("Tensor", "Scalar"),
    "where": ("self",), **{unary: ("default",) for unary in (
        "neg", "abs", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "square",
        "reciprocal", "sign", "erf", "sin", "cos", "floor", "ceil", "round", "maximum",
        "minimum", "logical_not", "logical_and", "logical_or")},
}.items() for overload in overloads}
_REDUCTIONS = {"sum.default", "sum.dim_IntList", "mean.default", "mean.dim", "amax.default",
               "amin.default", "max.dim", "min.dim", "max.default", "min.default",
               "argmax.default", "argmin.default", "var.correction", "var_mean.correction",
               "std.correction", "logsumexp.default", "linalg_vector_norm.default"}
#: size queries, runtime asserts and data-dependent sizes of a dynamic batch
_SIZES = {"sym_size.int", "sym_numel.default", "sym_stride.int", "_assert_scalar.default",
          "_assert_tensor_metadata.default", "sym_constrain_range_for_size.default",
          "_local_scalar_dense.default", "item.default", "nonzero.default"}

#: ``name.overload`` of every ``aten`` operator a program may call
ALLOWED: frozenset[str] = frozenset({*_LINEAR, *_ACTIVATIONS, *_NORMS, *_POOLING, *_SHAPES,
                                     *_FACTORIES, *_ELEMENTWISE, *_REDUCTIONS, *_SIZES})
#: listed operators with a data-dependent output size (no meta kernel): name -> the most
#: elements of its output per element of its input, times the input's dimensions
NO_META: dict[str, int] = {"nonzero.default": 1}

_WORD = re.compile(r"[A-Za-z0-9_]{0,32}")
_ASSERT_MESSAGE = "a runtime assertion of the exported program failed"


def check_string(target: str, value: str) -> str:
    """A string argument: a plain word (``tanh``, ``same``, ``floor``, ``reflect``); the
    message of a runtime assert is replaced by this reader's own, so that nothing the file
    wrote is ever printed."""
    if target == "_assert_scalar.default":
        return _ASSERT_MESSAGE
    if not _WORD.fullmatch(value):
        raise Refused(f"the program passes aten.{target} a string argument that is not a "
                      "plain word")
    return value


def check_arguments(target: str, args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments of one call, checked where the kernel trusts them (module doc);
    returns the positional arguments to run with."""
    if target not in _BATCH_NORMS or not args or not isinstance(args[0], torch.Tensor):
        return args
    x = args[0]
    if x.dim() < 2:
        raise Refused(f"aten.{target} gets a {x.dim()}-d input: a norm needs (N, C, ...)")
    per_channel = 5 if target in ("batch_norm.default", "instance_norm.default",
                                  "_native_batch_norm_legit_no_training.default") else 3
    for value in args[1:per_channel]:
        if value is not None and (not isinstance(value, torch.Tensor)
                                  or tuple(value.shape) != (x.shape[1],)):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else value
            raise Refused(f"aten.{target} gets a per-channel argument of shape {shape} for "
                          f"an input of {x.shape[1]} channels")
    if target in ("batch_norm.default", "instance_norm.default") and len(args) > 5 and (
            args[5] is not False):
        args = [*args[:3], None, None, *args[5:]]  # training: no update of running stats
    return args
