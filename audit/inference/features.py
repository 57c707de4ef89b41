"""Per-record attack features: loss (black box) and gradient norm (white box)
(docs/audit.md#features-and-attacks).

Paper section 6.6: the black-box attacker sees each record's loss under the released model;
the white-box attacker also has the weights and uses the L2 norm of the record's loss
gradient with respect to all weights. Both come, batched and vectorised, from
:mod:`fedlap_privacy.compute.per_sample` (the same per-record gradients DP training clips).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from fedlap_privacy.compute.per_sample import per_sample_grad_norms, per_sample_losses
from fedlap_privacy.errors import ConfigError, FedlapError

__all__ = ["FEATURES", "compute_features"]

#: Feature names accepted by :func:`compute_features` (and as attack names by the CLI).
FEATURES = ("loss", "grad-norm")


def compute_features(
    model: nn.Module,
    x: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    features: Sequence[str] = FEATURES,
    batch_size: int = 256,
) -> dict[str, np.ndarray]:
    """Each requested feature for every record, as float64 arrays of shape ``(N,)``.

    The model is put in eval mode for the duration (the ConvNet has no mode-dependent
    layers, but a checkpointed model is audited as it is deployed) and restored after.
    Computation runs on the model's device. Non-finite values (a diverged model) raise
    :class:`FedlapError`, since no attack metric is meaningful on them.
    """
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise ConfigError(f"unknown feature {unknown[0]!r}; choose from {', '.join(FEATURES)}")
    xt = torch.as_tensor(x, dtype=torch.float32)
    yt = torch.as_tensor(y, dtype=torch.int64)
    was_training = model.training
    model.eval()
    out: dict[str, np.ndarray] = {}
    try:
        for name in features:
            if name == "loss":
                values = per_sample_losses(model, xt, yt, batch_size=max(batch_size, 512))
            else:
                values = per_sample_grad_norms(model, xt, yt, batch_size=batch_size)
            arr = values.detach().cpu().to(torch.float64).numpy()
            if not np.all(np.isfinite(arr)):
                raise FedlapError(
                    f"the model gives non-finite {name} values on "
                    f"{int(np.sum(~np.isfinite(arr)))} records (diverged weights?)"
                )
            out[name] = arr
    finally:
        model.train(was_training)
    return out
