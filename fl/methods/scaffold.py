"""SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1 with option II): control variates.

The server keeps a control variate ``c`` and every client a node-local ``c_k`` (one tensor per
model parameter, zeros at the start / at a client's first participation). A selected client
runs K local SGD steps from the global weights w_g with the drift-corrected gradient
``g + c - c_k`` (Algorithm 1, line 10), reaching y_k, and updates its control variate with
option II (line 12)::

    c_k+ = c_k - c + (w_g - y_k) / (K lr)

It uploads ``dy = y_k - w_g`` AND ``dc = c_k+ - c_k`` (line 13), twice the model size: the
"double upload" of docs/algorithms.md#scaffold (``Reply.upload_bytes``). The server (lines
16-17) steps ``w_g += server_lr * sum_k p_k dy_k`` and ``c += (1 / N) sum_k dc_k`` with N the
number of ALL clients (``cfg.clients``), which keeps c the mean of every client's c_k.

Weights of dy (a documented choice): the paper averages dy uniformly (1/|S|); here
``p_k = N_k / N_S`` over the replying clients, the same weights as this package's FedAvg
(docs/algorithms.md#fedavg), so the baselines differ only in the control variates, and with
c = c_k = 0 and ``server_lr = 1`` a SCAFFOLD round IS a FedAvg round. On equal client sizes
the two rules coincide. The update of c keeps the paper's 1/N (it is what keeps
c = mean_k c_k).

Only ``model.parameters()`` carry control variates; state-dict buffers (none in this
package's ConvNet-GN) are averaged like FedAvg's weights.

Privacy: none (notion "none"); each local step still draws one Poisson batch and
counts as one access, like FedAvg.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from fedlap_privacy.fl.methods.fedavg import average_weights, local_training
from fedlap_privacy.fl.methods.interface import Method, Reply, RoundInfo, State, weights_of
from fedlap_privacy.state.ledger import PrivacyLedger

__all__ = ["Scaffold", "control_variate_update"]

DY, DC, BUF = "dy.", "dc.", "buffer."


def _zeros_like_params(model: nn.Module) -> dict[str, Tensor]:
    return {n: torch.zeros_like(p, memory_format=torch.contiguous_format).detach()
            for n, p in model.named_parameters()}


def _buffer_names(model: nn.Module) -> list[str]:
    params = {n for n, _ in model.named_parameters()}
    return [k for k in model.state_dict() if k not in params]


def control_variate_update(
    c_k: Tensor, c: Tensor, w_g: Tensor, y_k: Tensor, steps: int, lr: float
) -> Tensor:
    """Option II of Algorithm 1, line 12: c_k+ = c_k - c + (w_g - y_k) / (K lr)."""
    return c_k - c + (w_g - y_k) / (steps * lr)


class Scaffold(Method):
    """SCAFFOLD: local SGD with the correction c - c_k; uploads dy and dc (see module doc)."""

    def init_server_state(self, model: nn.Module, ledger: PrivacyLedger) -> State:
        """c = 0 (Algorithm 1, line 1), one tensor per parameter, keyed by parameter name."""
        return {"c": _zeros_like_params(model)}

    def extras(self, server_state: State) -> dict[str, Any]:
        """The server's control variate c, broadcast with w_g (Algorithm 1, line 7)."""
        return {"c": server_state["c"]}

    def client(
        self, model: nn.Module, x: Tensor, y: Tensor, state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> Reply:
        """Algorithm 1, lines 8-13 for one client; updates ``state["c_k"]`` in place.

        K is the number of steps actually taken: the non-private local SGD skips a step whose
        Poisson batch is empty, so y_k - w_g is the sum of K (not ``local_steps``) updates.
        A client whose batches were all empty (K = 0) learnt nothing: it keeps c_k and sends
        zeros (dy = dc = 0), which is what the update would give in the limit of no steps.
        """
        cfg = self.cfg
        names = [n for n, _ in model.named_parameters()]
        c: dict[str, Tensor] = info.extras["c"]
        c_k: dict[str, Tensor] = state.get("c_k") or _zeros_like_params(model)
        correction = [c[n] - c_k[n] for n in names]
        taken: list[int] = []
        trained, accesses = local_training(
            model, x, y, steps=cfg.local_steps, lr=info.lr, batch_size=cfg.batch_size,
            generator=generator, correction=correction,
            on_step=lambda step, grads, params: taken.append(step),
        )
        steps = len(taken)
        w_g = dict(model.named_parameters())
        y_k = dict(trained.named_parameters())
        payload: dict[str, Tensor] = {}
        new_c_k: dict[str, Tensor] = {}
        with torch.no_grad():
            for n in names:
                dy = (y_k[n] - w_g[n]).detach()
                if steps:
                    new_c_k[n] = control_variate_update(c_k[n], c[n], w_g[n], y_k[n], steps,
                                                        info.lr).detach()
                else:
                    new_c_k[n] = c_k[n].clone()
                payload[DY + n] = dy
                payload[DC + n] = new_c_k[n] - c_k[n]
        trained_state = trained.state_dict()
        for b in _buffer_names(model):
            payload[BUF + b] = trained_state[b].detach()
        state["c_k"] = new_c_k
        return Reply(payload, accesses, len(y))

    def aggregate(
        self, model: nn.Module, replies: list[Reply], server_state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> dict[str, Any]:
        """Algorithm 1, lines 16-17: w_g += server_lr sum_k p_k dy_k, c += (1/N) sum_k dc_k.

        p_k = N_k / N_S over the repliers (see the module docstring); N = ``cfg.clients``.
        """
        cfg = self.cfg
        weights = weights_of(replies)
        c: dict[str, Tensor] = server_state["c"]
        with torch.no_grad():
            for n, p in model.named_parameters():
                dy = sum(w * r.payload[DY + n] for r, w in zip(replies, weights, strict=True))
                p.add_(cfg.server_lr * dy)
                dc = sum(r.payload[DC + n] for r in replies)
                c[n] = c[n] + dc / cfg.clients
        buffers = _buffer_names(model)
        if buffers:
            states = [{b: r.payload[BUF + b] for b in buffers} for r in replies]
            model.load_state_dict(average_weights(states, weights), strict=False)
        norm = sum(float((v * v).sum()) for v in c.values()) ** 0.5
        return {"control_variate_norm": norm}
