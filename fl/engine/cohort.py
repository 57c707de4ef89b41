"""A cohort's local SGD in lockstep: one vectorised step for many clients at once.

FedAvg's client step (:func:`fedlap_privacy.fl.methods.fedavg.local_training`, without record-level
DP) runs ``steps`` SGD steps on Poisson batches drawn at rate B/N_k from the client's own
generator. Here the clients of a cohort take those steps together: their parameters are
stacked on a leading client axis and one call of ``torch.func.vmap`` over
``torch.func.grad`` of ``torch.func.functional_call`` forms every client's gradient of its
own batch. Each client's batches are drawn from its own generator, in the loop's order, so
the clients see exactly the records they would see in the loop. Batches of different sizes
are grouped by size, padded to the largest one in their group and masked out of the loss
(the loss is the sum over the client's real records over their count, as
``F.cross_entropy``'s mean); a client whose batch is empty skips the step, as in the loop.
Padding is exact only for layers that treat records independently, so the cohort is
vectorised only for models built from the layers in :data:`PER_RECORD_LAYERS` (BatchNorm
mixes the records of a batch, dropout draws randomness the loop would draw otherwise);
anything else, or a module with hooks, falls back
to the loop (:func:`vectorise_refusal` says why).

For the ConvNet, ``packed=True`` forms each group's gradients by one forward and backward of
the clients' networks packed into one (:mod:`~fedlap_privacy.fl.engine.packed_cohort`: grouped
convolutions and the loop's fused normalisation kernels), with the same batches, padding,
masks and steps. The cohort reports step t of T after each step
(:func:`~fedlap_privacy.fl.engine.progress.report_step`).

The result equals the loop's up to floating-point rounding (the summation order differs);
``tests/fl/engine/test_cohort.py`` checks the aggregated update of both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from fedlap_privacy.fl.engine.packed_cohort import PackedConvNet
from fedlap_privacy.fl.engine.progress import report_step
from fedlap_privacy.fl.methods.dp import batch_rate, poisson_sample

__all__ = [
    "PER_RECORD_LAYERS", "ClientBatches", "cohort_local_sgd", "size_groups",
    "vectorise_refusal",
]

#: layers whose output for one record depends on that record only, and that draw nothing:
#: the layers a padded, masked batch gives the loop's gradient through
PER_RECORD_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.Bilinear, nn.GroupNorm, nn.LayerNorm,
    nn.ReLU, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Softplus,
    nn.AvgPool1d, nn.AvgPool2d, nn.MaxPool1d, nn.MaxPool2d, nn.AdaptiveAvgPool2d,
    nn.Flatten, nn.Identity, nn.Sequential, nn.ModuleList,
)

#: the most padded records one vectorised call holds (clients x largest batch): a group is
#: cut to fit, so the activations' memory stays that of one large batch
RECORDS_PER_CALL = 2048
#: a group's batches are padded by at most this share of its smallest batch (clients are
#: grouped by batch size: padded records cost as much as real ones)
MAX_PADDING = 0.25


def vectorise_refusal(model: nn.Module) -> str | None:
    """Why the cohort cannot be vectorised for ``model`` (None: it can)."""
    from fedlap_privacy.models import ConvNet, TabularMLP, has_hooks

    for name, module in model.named_modules():
        if has_hooks(module):
            return f"module {name or 'model'} has hooks"
        if not isinstance(module, (ConvNet, TabularMLP, *PER_RECORD_LAYERS)):
            return (f"layer {name or 'model'} ({type(module).__name__}) is not known to treat "
                    "records independently")
    return None


@dataclass(frozen=True)
class ClientBatches:
    """One client's records (index views into the training set) and its Poisson batches:
    ``batches[t]`` are positions in ``index`` of step t's batch."""

    index: Tensor
    batches: list[Tensor]

    @classmethod
    def draw(cls, index: Tensor, steps: int, batch_size: float,
             generator: torch.Generator) -> ClientBatches:
        """The ``steps`` batches at rate B / N_k (at most 1: the cohort's local steps are not
        accounted, :func:`~fedlap_privacy.fl.methods.dp.batch_rate`), drawn from ``generator``
        in the loop's order (one :func:`~fedlap_privacy.fl.methods.dp.poisson_sample` per
        step)."""
        rate = batch_rate(batch_size, index.numel(), accounted=False)
        return cls(index, [poisson_sample(index.numel(), rate, generator).to(index.device)
                           for _ in range(steps)])


def size_groups(sizes: Sequence[int]) -> list[list[int]]:
    """The clients of one step with a non-empty batch (positions; an empty batch skips the
    step, as in the loop), in groups trained by one vectorised call: sorted by batch size,
    a group padded to its largest batch, cut where that would pad by more than
    :data:`MAX_PADDING` or exceed :data:`RECORDS_PER_CALL` padded records."""
    groups: list[list[int]] = []
    for i in sorted((i for i, n in enumerate(sizes) if n), key=lambda i: sizes[i]):
        group = groups[-1] if groups else None
        if (group is None or sizes[i] > (1 + MAX_PADDING) * sizes[group[0]]
                or (len(group) + 1) * sizes[i] > RECORDS_PER_CALL):
            groups.append([i])
        else:
            group.append(i)
    return groups


def cohort_local_sgd(
    global_model: nn.Module,
    x: Tensor,
    y: Tensor,
    clients: Sequence[ClientBatches],
    *,
    lr: float,
    mu: float = 0.0,
    packed: bool = False,
) -> list[dict[str, Tensor]]:
    """Each client's weights after its local SGD steps from w_g, trained together.

    ``x, y``: the whole training set (the clients' ``index`` views point into it). Step t
    of client k: ``w_k -= lr (g_k + mu (w_k - w_g))`` with g_k the mean cross-entropy
    gradient on its batch t (FedProx's proximal term when ``mu``), skipped when the batch
    is empty: :func:`fedlap_privacy.fl.methods.fedavg.local_training` without DP, vectorised.
    ``packed``: each group's gradients come from one forward and backward of the clients'
    ConvNets packed into one network (:mod:`~fedlap_privacy.fl.engine.packed_cohort`, the model
    must pack), else from ``vmap``. Reports step t of T after each step
    (:func:`~fedlap_privacy.fl.engine.progress.report_step`). Returns one state dict per client
    (parameters trained, buffers as w_g's).
    """
    names = [n for n, _ in global_model.named_parameters()]
    anchor = {n: p.detach() for n, p in global_model.named_parameters()}
    buffers = {n: b.detach() for n, b in global_model.named_buffers()}

    def loss(params: dict[str, Tensor], xb: Tensor, yb: Tensor, mask: Tensor,
             count: Tensor) -> Tensor:
        out = functional_call(global_model, (params, buffers), (xb,))
        per_record = F.cross_entropy(out, yb, reduction="none")
        return (per_record * mask).sum() / count.clamp(min=1)

    step_grad = vmap(grad(loss))
    packed_net = PackedConvNet(global_model) if packed else None

    def packed_grad(mine: dict[str, Tensor], rows: Tensor, mask: Tensor,
                    count: Tensor) -> dict[str, Tensor]:
        assert packed_net is not None
        leaves = {n: mine[n].detach().requires_grad_() for n in names}
        with torch.enable_grad():
            total = packed_net.loss(leaves, x[rows.T], y[rows], mask, count)
            grads = torch.autograd.grad(total, [leaves[n] for n in names])
        return dict(zip(names, grads, strict=True))

    params = {n: anchor[n].unsqueeze(0).repeat(len(clients), *[1] * anchor[n].dim())
              for n in names}
    steps = len(clients[0].batches) if clients else 0
    for t in range(steps):
        sizes = [int(c.batches[t].numel()) for c in clients]
        for group in size_groups(sizes):
            width = sizes[group[-1]]
            rows = torch.zeros(len(group), width, dtype=torch.int64, device=x.device)
            mask = torch.zeros(len(group), width, dtype=x.dtype, device=x.device)
            for j, i in enumerate(group):
                rows[j, :sizes[i]] = clients[i].index[clients[i].batches[t]]
                mask[j, :sizes[i]] = 1
            at = torch.tensor(group, device=x.device)
            mine = {n: params[n][at] for n in names}
            count = torch.tensor([sizes[i] for i in group], dtype=x.dtype, device=x.device)
            if packed_net is not None:
                grads = packed_grad(mine, rows, mask, count)
            else:
                grads = step_grad(mine, x[rows], y[rows], mask, count)
            with torch.no_grad():
                for n in names:
                    d = grads[n] + mu * (mine[n] - anchor[n]) if mu else grads[n]
                    params[n][at] = mine[n] - lr * d
        report_step(t + 1, steps)
    states: list[dict[str, Tensor]] = []
    for j in range(len(clients)):
        state = {n: params[n][j].clone() for n in names}
        states.append({k: state[k] if k in state else buffers[k]
                       for k in global_model.state_dict()})
    return states
