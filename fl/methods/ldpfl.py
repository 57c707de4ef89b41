"""LDP-FL (Sun, Qian, Chen, IJCAI 2021): local DP on the uploaded weights + parameter shuffling.

docs/algorithms.md#ldp-fl (LDP-FL) and docs/accounting.md#local-dp (local DP). A round:

1. The server broadcasts w_g and, per layer l (per ``state_dict`` tensor, in its order), an
   agreed range [c_l - r_l, c_l + r_l] (``extras["ranges"]``, an (L, 2) tensor of (c, r)).
2. Each selected client trains w_g locally WITHOUT DP (:func:`local_training`, ``dp=None``),
   then replaces every weight w of layer l by :func:`perturb` (the paper's rule, eps =
   ``cfg.ldp_epsilon``): w is clipped into [c - r, c + r], then reported as
   c + r (e^eps+1)/(e^eps-1) with probability
   ((w-c)(e^eps-1) + r(e^eps+1)) / (2r(e^eps+1)), otherwise as c - r (e^eps+1)/(e^eps-1).
3. Parameter shuffling: the reply is the flattened weights as separate (position, value)
   pairs in a random order (the paper sends each pair separately after a random delay in
   U(0, T), so the server cannot link the weights of one client).
4. The server (after a shuffler step that pools all pairs and permutes them, dropping client
   identities) sets each global weight to the plain mean of the values reported for its
   position, then sets the next round's ranges from the new global model.

Privacy (notion ``local``; the ledger's ``round_epsilon`` is ``cfg.ldp_epsilon``):

* Each reported weight is eps-LDP per round (pure DP): whatever the client's data, its
  (clipped) weight lies in [c - r, c + r], and the probabilities of either output for any two
  such weights differ by a factor of at most e^eps (equality at the range's ends). The range
  is public and data-independent for the round (set by the server from the previous global
  model, i.e. post-processing of earlier LDP outputs), and the local training is
  post-processed by the mechanism, so it costs nothing beyond the report itself.
* A client's WHOLE upload of d weights is (d * eps)-LDP per round by basic composition. The
  paper's privacy claim rests on per-weight reporting plus shuffling (unlinkability);
  we claim no amplification-by-shuffling bound here. The epsilon reported by the ledger is the
  per-weight one.
* Over rounds the per-weight epsilon composes to rounds x eps (basic composition; what the
  ledger reports as ``epsilon``).
* Unbiasedness E[w*] = w holds only for weights inside the range; clipping biases the others
  towards the range (the price of a bounded range; the range rule below trades this bias
  against the variance, which grows with r).
* ``Reply.accesses`` is 1 per round: it counts LDP reports, not SGD steps — the client's data
  feeds one eps-LDP report (of each weight) per round; the local steps before it are not
  releases. ``accounted_steps`` is 1 accordingly (the local ledger does not use it).

Aggregation is uniform over reports, not weighted by N_k: after shuffling the server cannot
link a value to the client (and so to the N_k) it came from.

Range rule (:func:`layer_ranges`), our choice (the paper only says the range is agreed per
layer and updated by the server each round): c = mean of the layer's global weights, r =
``RANGE_STDS`` (1.0) x their standard deviation, at least ``RADIUS_FLOOR_ABS`` +
``RADIUS_FLOOR_REL`` x |c| (a layer whose weights are all equal, e.g. GroupNorm's initial
scales of 1, still gets room to move). Weights beyond one standard deviation are clipped
(biased towards the range); that is deliberate. The obvious rule — midpoint and half the
range of the layer, widened by a margin — diverges: the global weights are means of
reports c +- r (e^eps+1)/(e^eps-1), so wherever the few reports agree the new global model
already spans the whole previous range times (e^eps+1)/(e^eps-1), and the range grows
geometrically (measured on digits, 5 clients: margin 0.25 at eps 10 took the mean radius
from 0.17 to 1.1 in 10 rounds; no margin at eps 1 from 0.24 to 200, at eps 2 from 0.15 to
1.5, both at chance accuracy). Of the rules tried (std x 0.75 / 1 / 1.25, 5%-95%
quantiles, fixed ranges from the initial model, min/max) the standard-deviation rule with
factor 1 was the only one stable at eps = 2 (mean radius about 0.08 throughout), with
accuracy on par with the best at eps 5-10. At eps = 1 it widens too (0.10 -> 0.40 in 10
rounds with 5 clients).

Utility: a mean of K reports of a weight has variance (r^2 (e^eps+1)^2/(e^eps-1)^2 -
(w-c)^2) / K, at least (r^2 - (w-c)^2) / K however large eps is ((e^eps+1)/(e^eps-1) -> 1:
the report becomes stochastic rounding to c +- r), so accuracy is capped by K, not by eps.
Measured on digits, 10 rounds, defaults (final accuracy, mean of seeds 0-2): 5 non-IID
clients eps 1 / 2 / 5 / 10: 0.04 / 0.41 / 0.67 / 0.61 (FedAvg 0.90); 5 IID clients:
0.08 / 0.84 / 0.91 / 0.87 (FedAvg 0.99); 20 IID clients (seed 0): 0.89 / 0.88 / 0.88 / 0.90.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from fedlap_privacy.fl.methods.fedavg import local_training
from fedlap_privacy.fl.methods.interface import Method, Reply, RoundInfo, State
from fedlap_privacy.fl.methods.method_table import LDP_MAX_EPSILON
from fedlap_privacy.state.ledger import PrivacyLedger
from fedlap_privacy.vocabulary import Notion

__all__ = [
    "LDPFL",
    "MAX_EPSILON",
    "RADIUS_FLOOR_ABS",
    "RADIUS_FLOOR_REL",
    "RANGE_STDS",
    "aggregate_reports",
    "flatten_state",
    "layer_ranges",
    "output_scale",
    "perturb",
    "perturb_probability",
    "perturb_state",
    "shuffle_report",
]

#: a layer's radius in standard deviations of its global weights (module docstring)
RANGE_STDS = 1.0
#: floor of a layer's radius: absolute part and part relative to |centre|
RADIUS_FLOOR_ABS = 0.05
RADIUS_FLOOR_REL = 0.1
#: largest per-weight epsilon accepted. The smaller output probability, 1/(e^eps+1), is
#: realised by a float64 uniform draw to within 2^-53, i.e. to a relative 2^-53 (e^eps+1):
#: 1e-3 at eps = 30 (the e^eps bound holds to that factor), but at eps ~ 37 the rarer output
#: could no longer occur at all and the pure-DP ratio would be infinite. Refused beyond.
MAX_EPSILON = LDP_MAX_EPSILON


def _check(radius: float | Tensor, eps: float) -> None:
    if not 0 < eps <= MAX_EPSILON:
        raise ValueError(f"epsilon {eps} must lie in (0, {MAX_EPSILON}] (see MAX_EPSILON)")
    small = (radius <= 0).any() if isinstance(radius, Tensor) else not radius > 0
    if small:
        raise ValueError("the radius of the range must be > 0")


def output_scale(eps: float) -> float:
    """(e^eps + 1) / (e^eps - 1) = 1 + 2 e^-eps / (1 - e^-eps): outputs are c +- r x this.

    Written with exp(-eps) and expm1 so that it neither overflows for large eps (tends to 1)
    nor loses precision for small eps (about 2 / eps).
    """
    return 1.0 + 2.0 * math.exp(-eps) / -math.expm1(-eps)


def perturb_probability(
    w: Tensor, centre: float | Tensor, radius: float | Tensor, eps: float, upper: bool = True,
) -> Tensor:
    """Probability (float64) that :func:`perturb` reports c + r (e^eps+1)/(e^eps-1) (``upper``)
    or, with ``upper=False``, c - r (e^eps+1)/(e^eps-1).

    Sun et al.: p = ((w-c)(e^eps-1) + r(e^eps+1)) / (2r(e^eps+1)) for w clipped into [c-r, c+r].
    With u = (w-c)/r in [-1, 1] this is (1+u)/2 sigmoid(eps) + (1-u)/2 sigmoid(-eps), which
    is exact at both ends (e^eps/(e^eps+1) at u = 1, 1/(e^eps+1) at u = -1) and does not
    overflow for large eps; the complement 1 - p is computed the same way (u -> -u), not by
    subtraction, so that small probabilities keep their relative precision. A NaN weight
    (diverged training) is treated as w = c, so the e^eps bound holds for every input.
    """
    _check(radius, eps)
    c = torch.as_tensor(centre, dtype=torch.float64, device=w.device)
    r = torch.as_tensor(radius, dtype=torch.float64, device=w.device)
    u = ((w.to(torch.float64) - c) / r).clamp(-1.0, 1.0)  # clipping; +-inf land on the ends
    u = torch.where(torch.isnan(u), torch.zeros_like(u), u)  # NaN reported as if w = c
    if not upper:
        u = -u
    tail = math.exp(-eps)  # eps > 0: no overflow
    hi, lo = 1.0 / (1.0 + tail), tail / (1.0 + tail)  # sigmoid(eps), sigmoid(-eps)
    return 0.5 * (1 + u) * hi + 0.5 * (1 - u) * lo


def perturb(
    w: Tensor,
    centre: float | Tensor,
    radius: float | Tensor,
    eps: float,
    generator: torch.Generator,
) -> Tensor:
    """LDP-FL's eps-LDP report of each entry of ``w`` (Sun et al. 2021, Alg. 1).

    ``w`` is clipped into [c - r, c + r], then each entry independently becomes
    c + r (e^eps+1)/(e^eps-1) with probability :func:`perturb_probability`, otherwise
    c - r (e^eps+1)/(e^eps-1). Unbiased (E = w) for entries inside the range only; clipping
    biases the others. ``centre`` and ``radius`` broadcast against ``w``; output in ``w``'s
    dtype. The rarer of the two outputs is drawn as ``U < its probability`` with a float64
    uniform U, so each probability is realised to within 2^-53 (see ``MAX_EPSILON``).
    """
    p_up = perturb_probability(w, centre, radius, eps, upper=True)
    p_down = perturb_probability(w, centre, radius, eps, upper=False)
    draw = torch.rand(p_up.shape, generator=generator, device=w.device, dtype=torch.float64)
    upper = torch.where(p_up <= 0.5, draw < p_up, ~(draw < p_down))
    c = torch.as_tensor(centre, dtype=torch.float64, device=w.device)
    half = torch.as_tensor(radius, dtype=torch.float64, device=w.device) * output_scale(eps)
    return torch.where(upper, c + half, c - half).to(w.dtype)


def flatten_state(state: dict[str, Tensor]) -> Tensor:
    """All entries of a state dict, in its key order, as one float32 vector."""
    for key, t in state.items():
        if not t.is_floating_point():
            raise ValueError(f"LDP-FL reports floating-point weights only; {key!r} is {t.dtype}")
    return torch.cat([t.detach().reshape(-1).float() for t in state.values()])


def layer_ranges(state: dict[str, Tensor]) -> Tensor:
    """(L, 2) float32 tensor of (c, r) per state-dict tensor: the range rule (module docstring).

    c = mean, r = max(RANGE_STDS x std, RADIUS_FLOOR_ABS + RADIUS_FLOOR_REL |c|) > 0 (std
    over the layer's weights, population form). Computed from the global model only, which is
    public post-processing of earlier LDP reports.
    """
    rows = []
    for t in state.values():
        flat = t.detach().reshape(-1).to(torch.float64)
        c = float(flat.mean())
        std = float(flat.std(correction=0))
        rows.append((c, max(RANGE_STDS * std, RADIUS_FLOOR_ABS + RADIUS_FLOOR_REL * abs(c))))
    return torch.tensor(rows, dtype=torch.float32)


def perturb_state(
    state: dict[str, Tensor], ranges: Tensor, eps: float, generator: torch.Generator
) -> Tensor:
    """Every weight of every layer perturbed with its layer's (c, r); flattened (float32)."""
    if ranges.shape != (len(state), 2):
        raise ValueError(f"ranges of shape {tuple(ranges.shape)} for {len(state)} layers")
    out = []
    for (c, r), t in zip(ranges.tolist(), state.values(), strict=True):
        out.append(perturb(t.detach().reshape(-1).float(), c, r, eps, generator))
    return torch.cat(out)


def shuffle_report(values: Tensor, generator: torch.Generator) -> dict[str, Tensor]:
    """Parameter shuffling: (position, value) pairs of a flat report, in a random order."""
    perm = torch.randperm(values.numel(), generator=generator, device=values.device)
    return {"positions": perm.to(torch.int32), "values": values[perm].float()}


def aggregate_reports(
    payloads: list[dict[str, Tensor]], size: int, generator: torch.Generator,
    previous: Tensor | None = None,
) -> Tensor:
    """Shuffler then server: the plain mean of the values reported for each of ``size`` positions.

    All pairs are pooled and permuted at once (the shuffler: from here on no client identity
    is used); the mean is uniform over reports (the server cannot link a value to its client's
    N_k). Sums are accumulated in float64, so the result does not depend on the order of the
    reports beyond float64 rounding. Positions nobody reported keep ``previous`` (zeros if
    None).
    """
    positions = torch.cat([p["positions"].long() for p in payloads])
    values = torch.cat([p["values"].to(torch.float64) for p in payloads])
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= size):
        raise ValueError(f"a reported position lies outside 0..{size - 1}")
    perm = torch.randperm(positions.numel(), generator=generator, device=positions.device)
    positions, values = positions[perm], values[perm]
    sums = torch.zeros(size, dtype=torch.float64, device=values.device)
    counts = torch.zeros(size, dtype=torch.float64, device=values.device)
    sums.index_add_(0, positions, values)
    counts.index_add_(0, positions, torch.ones_like(values))
    base = (torch.zeros(size, dtype=torch.float64, device=values.device) if previous is None
            else previous.to(torch.float64))
    mean = torch.where(counts > 0, sums / counts.clamp(min=1), base)
    return mean.float()


def _load_flat(model: nn.Module, flat: Tensor) -> None:
    state = model.state_dict()
    new, start = {}, 0
    for key, t in state.items():
        n = t.numel()
        new[key] = flat[start : start + n].reshape(t.shape).to(t.dtype)
        start += n
    model.load_state_dict(new)


class LDPFL(Method):
    """LDP-FL (docs/algorithms.md#ldp-fl): non-private local training, per-weight eps-LDP report,
    shuffling.

    Server state: ``ranges`` (L, 2) = (c, r) per state-dict tensor, broadcast in ``extras``.
    See the module docstring for what epsilon protects (per weight, per round) and what it
    does not (the whole upload is d x eps-LDP; no shuffling amplification claimed).
    """

    def init_server_state(self, model: nn.Module, ledger: PrivacyLedger) -> State:
        if ledger.notion != Notion.LOCAL or ledger.round_epsilon != self.epsilon:
            raise ValueError("LDP-FL runs under a local ledger with round_epsilon = ldp_epsilon")
        return {"ranges": layer_ranges(model.state_dict())}

    def extras(self, server_state: State) -> dict[str, Any]:
        return {"ranges": server_state["ranges"]}

    def accounted_steps(self, server_state: State) -> int:
        return 1  # one LDP report of each weight per client-round

    @property
    def epsilon(self) -> float:
        eps = self.cfg.ldp_epsilon
        if eps is None or not 0 < eps <= MAX_EPSILON:
            raise ValueError(f"ldp-fl needs a per-weight epsilon in (0, {MAX_EPSILON}]")
        return float(eps)

    def client(
        self, model: nn.Module, x: Tensor, y: Tensor, state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> Reply:
        cfg = self.cfg
        trained, _ = local_training(
            model, x, y, steps=cfg.local_steps, lr=info.lr, batch_size=cfg.batch_size,
            generator=generator, dp=None,
        )
        ranges = info.extras["ranges"]
        weights = {k: v.detach() for k, v in trained.state_dict().items()}
        report = perturb_state(weights, ranges, self.epsilon, generator)
        return Reply(shuffle_report(report, generator), 1, len(y))

    def aggregate(
        self, model: nn.Module, replies: list[Reply], server_state: State, info: RoundInfo,
        generator: torch.Generator,
    ) -> dict[str, Any]:
        previous = flatten_state(model.state_dict())
        mean = aggregate_reports([r.payload for r in replies], previous.numel(), generator,
                                 previous)
        _load_flat(model, mean)
        server_state["ranges"] = layer_ranges(model.state_dict())
        radii = server_state["ranges"][:, 1]
        eps = self.epsilon
        return {
            "ldp_round_epsilon": eps,
            "ldp_upload_epsilon": eps * previous.numel(),  # d x eps, basic composition
            "ldp_reports": len(replies),
            "ldp_mean_radius": float(radii.mean()),
        }
