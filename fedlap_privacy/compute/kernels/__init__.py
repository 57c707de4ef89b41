"""Fused CPU kernels for the ConvNet (built at install time, loaded with ctypes).

:func:`gn_relu_pool` is the GroupNorm -> ReLU -> 2x2 average pooling block that follows
every convolution of the FedLAP-DP ConvNet, differentiable to second order
(:mod:`~fedlap_privacy.compute.kernels.block`);
:mod:`~fedlap_privacy.compute.kernels.winograd` runs the ConvNet's 3x3 convolutions through
Winograd's F(4x4, 3x3) transforms;
:mod:`~fedlap_privacy.compute.kernels.library` loads the library ``setup.py`` built
(``FEDLAP_KERNELS=auto|off|require``). Importing this package imports
torch; the package root does not import it.
"""

from fedlap_privacy.compute.kernels.block import (
    block_backward,
    block_double_backward,
    block_forward,
    fusable,
    gn_relu_pool,
    reference_block,
)
from fedlap_privacy.compute.kernels.library import KERNELS_ENV, kernel_mode, load_kernels

__all__ = [
    "KERNELS_ENV",
    "block_backward",
    "block_double_backward",
    "block_forward",
    "fusable",
    "gn_relu_pool",
    "kernel_mode",
    "load_kernels",
    "reference_block",
]
