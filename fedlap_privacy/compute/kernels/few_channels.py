"""The ConvNet's first convolution, 3x3 over images of one to three channels, and its
gradients, as C kernels (``few_channels.c``) on the CPU.

Its matrix product is only 9 or 27 deep, so torch's (oneDNN's) kernel runs it far below the
rate of the 128-channel convolutions behind it while it writes 128 planes per image: on
FashionMNIST's 28x28 images (padding 3) the forward of a DP chunk of 128 records took 32 to
37 ms of a DP gradient's 830 (two chunks), and 13 to 14 ms here (2.4 to 2.65x on one thread;
``benchmarks/speed/winograd.py`` times both ways). The kernel computes each output plane from the
image's padded planes held in the first-level cache and writes it once; three-channel images
gained little (1.06x at 32x32). The same layout serves the two gradients a FedLAP-DP round
asks of this layer: the images' gradient in the matching step
(:func:`input_grad_sum`, the block's two convolutions summed without concatenating them)
and every record's weight and bias gradients in a DP gradient (:func:`per_record_grads`,
one pass over the output gradient where torch makes a grouped convolution and a separate
sum). Part of the ``kernels`` fast path (:mod:`fedlap_privacy.compute.fast_paths`); the same sums as
torch's in another order, so equal up to rounding (``tests/core/compute/test_few_channels.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from fedlap_privacy.compute.kernels.block import fusable, run_split

__all__ = ["MAX_CHANNELS", "applies", "conv", "input_grad_sum", "per_record_grads"]

#: the most input channels the kernel takes
MAX_CHANNELS = 3


def applies(x: Tensor, weight: Tensor, module: nn.Conv2d) -> bool:
    """Whether ``module``'s convolution of ``x`` with ``weight`` runs here: 3x3, stride 1,
    zero padding given as numbers, no dilation, one group, at most :data:`MAX_CHANNELS`
    input channels, and tensors the kernels take."""
    if x.dim() != 4 or weight.dim() != 4 or isinstance(module.padding, str):
        return False
    geometry = (tuple(module.kernel_size), tuple(module.stride), tuple(module.dilation),
                module.groups, module.padding_mode)
    if geometry != ((3, 3), (1, 1), (1, 1), 1, "zeros"):
        return False
    if x.shape[1] > MAX_CHANNELS or tuple(weight.shape[1:]) != (x.shape[1], 3, 3):
        return False
    return fusable(x, weight)


def conv(x: Tensor, weight: Tensor, bias: Tensor | None, padding: tuple[int, int]) -> Tensor:
    """The convolution of ``x`` (N, C, H, W) with ``weight`` (C_out, C, 3, 3), plus
    ``bias``, with zero ``padding``: (N, C_out, H + 2 ph - 2, W + 2 pw - 2)."""
    n, c_in, h, w = x.shape
    c_out = weight.shape[0]
    ph, pw = padding
    src = x.detach().contiguous()
    kernel = weight.detach().contiguous()
    b = src.new_zeros(c_out) if bias is None else bias.detach().contiguous()
    y = src.new_empty(n, c_out, h + 2 * ph - 2, w + 2 * pw - 2)
    run_split("conv3x3_few", src.dtype, n, y.numel(),
              (src.data_ptr(), kernel.data_ptr(), b.data_ptr(), c_in, c_out, h, w, ph, pw),
              (y.data_ptr(),))
    return y


def input_grad_sum(pairs: Sequence[tuple[Tensor, Tensor]], padding: tuple[int, int],
                   in_hw: tuple[int, int]) -> Tensor:
    """``sum_k dL/dx`` of the convolutions ``(gy_k, weight_k)`` (``gy_k`` (N, C_out_k, Ho, Wo),
    ``weight_k`` (C_out_k, C, 3, 3), the same zero ``padding``) for an input of height and
    width ``in_hw``: (N, C, H, W), without concatenating the pairs. Where :func:`applies`
    holds for the input and every weight."""
    first_gy, first_w = pairs[0]
    n, c_in = first_gy.shape[0], first_w.shape[1]
    (h, w), (ph, pw) = in_hw, padding
    dx = first_gy.new_empty(n, c_in, h, w)
    for k, (gy, weight) in enumerate(pairs):
        src, kernel = gy.detach().contiguous(), weight.detach().contiguous()
        run_split("conv3x3_few_input_grad", src.dtype, n, src.numel(),
                  (src.data_ptr(), kernel.data_ptr(), c_in, kernel.shape[0], h, w, ph, pw,
                   int(k > 0)), (dx.data_ptr(),))
    return dx


def per_record_grads(x: Tensor, gy: Tensor, padding: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Every record's own weight and bias gradients of the convolution of ``x`` (N, C, H, W)
    with zero ``padding``, from its output gradient ``gy`` (N, C_out, Ho, Wo): ``(N, C_out,
    C, 3, 3)`` and ``(N, C_out)``, in one pass over ``gy``. Where :func:`applies` holds."""
    src, grad = x.detach().contiguous(), gy.detach().contiguous()
    n, c_in, h, w = src.shape
    c_out = grad.shape[1]
    dw = src.new_empty(n, c_out, c_in, 3, 3)
    db = src.new_empty(n, c_out)
    run_split("conv3x3_few_weight_grads", src.dtype, n, grad.numel(),
              (src.data_ptr(), grad.data_ptr(), c_in, c_out, h, w, *padding),
              (dw.data_ptr(), db.data_ptr()))
    return dw, db
