"""SCAFFOLD, FedSGD and FedProx (docs/algorithms.md#other-methods): the defining rule of
each, checked on tiny problems."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny
from torch import nn

from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.fl.engine.events import RoundEnded
from fedlap_privacy.fl.engine.simulation import PENDING, resume, train
from fedlap_privacy.fl.methods.dp import poisson_sample
from fedlap_privacy.fl.methods.fedavg import LocalSGD, local_training
from fedlap_privacy.fl.methods.fedsgd import FedSGD, full_gradient
from fedlap_privacy.fl.methods.interface import Reply, RoundInfo, build_method
from fedlap_privacy.fl.methods.scaffold import DC, DY, Scaffold
from fedlap_privacy.fl.methods.trust_region import clone_params, distance
from fedlap_privacy.models import ModelConfig, build_model

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: one intra-op thread is faster on a shared CPU (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(1, 8, 10, width=8, depth=2))


def _data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def _rand_like_params(model: nn.Module, seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _info(cfg: TrainConfig, method, server_state, round_: int = 1) -> RoundInfo:
    return method.round_info(round_, server_state)


# ------------------------------------------------------------------------------- SCAFFOLD
def test_scaffold_client_control_variate_update_option_ii():
    """c_k+ = c_k - c + (w_g - y_k) / (K lr), K = steps taken; y_k recomputed by hand."""
    model = _model()
    x, y = _data(40)
    lr = 0.1
    # B = 1 on 40 records: a Poisson batch is empty w.p. ~0.36, so some steps are skipped
    cfg = TrainConfig(method="scaffold", local_steps=8, batch_size=1, lr_local=lr, clients=4)
    method = Scaffold(cfg, CPU)
    server = method.init_server_state(model, None)  # type: ignore[arg-type]
    server["c"] = _rand_like_params(model, 1)
    c_k = _rand_like_params(model, 2)
    state = {"c_k": {n: t.clone() for n, t in c_k.items()}}
    info = _info(cfg, method, server)
    w_g = {n: p.detach().clone() for n, p in model.named_parameters()}
    reply = method.client(model, x, y, state, info, torch.Generator().manual_seed(7))

    # independent recomputation: the same Poisson draws, plain SGD with the correction c - c_k
    ref = _model()
    gen = torch.Generator().manual_seed(7)
    taken = 0
    for _ in range(cfg.local_steps):
        batch = poisson_sample(40, 1 / 40, gen)
        if batch.numel() == 0:
            continue
        taken += 1
        loss = F.cross_entropy(ref(x[batch]), y[batch])
        grads = torch.autograd.grad(loss, list(ref.parameters()))
        with torch.no_grad():
            for (n, p), g in zip(ref.named_parameters(), grads, strict=True):
                p.sub_(lr * (g + server["c"][n] - c_k[n]))
    assert 0 < taken < cfg.local_steps  # the seed exercises the skipped-step count
    y_k = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, w_g[n])  # the global model is untouched
        expected_ck = c_k[n] - server["c"][n] + (w_g[n] - y_k[n]) / (taken * lr)
        torch.testing.assert_close(state["c_k"][n], expected_ck, rtol=0, atol=1e-5)
        torch.testing.assert_close(reply.payload[DY + n], y_k[n] - w_g[n], rtol=0, atol=1e-6)
        torch.testing.assert_close(reply.payload[DC + n], state["c_k"][n] - c_k[n],
                                   rtol=0, atol=1e-6)
    # wrong K (the nominal local_steps) would give a different c_k+: the count matters
    n0 = next(iter(w_g))
    wrong = c_k[n0] - server["c"][n0] + (w_g[n0] - y_k[n0]) / (cfg.local_steps * lr)
    assert not torch.allclose(state["c_k"][n0], wrong, atol=1e-4)
    # the double upload: dy and dc, each the size of the parameters
    assert set(reply.payload) == {DY + n for n in w_g} | {DC + n for n in w_g}
    assert reply.upload_bytes == 2 * _param_bytes(model)
    assert reply.accesses == cfg.local_steps and reply.num_examples == 40


def test_scaffold_client_with_no_step_keeps_its_control_variate():
    model = _model()
    x, y = _data(20)
    cfg = TrainConfig(method="scaffold", local_steps=3, batch_size=0, clients=2)  # rate 0
    method = Scaffold(cfg, CPU)
    server = method.init_server_state(model, None)  # type: ignore[arg-type]
    server["c"] = _rand_like_params(model, 1)
    c_k = _rand_like_params(model, 2)
    state = {"c_k": {n: t.clone() for n, t in c_k.items()}}
    reply = method.client(model, x, y, state, _info(cfg, method, server),
                          torch.Generator().manual_seed(0))
    for n in c_k:
        assert torch.equal(state["c_k"][n], c_k[n])
        assert not reply.payload[DY + n].any() and not reply.payload[DC + n].any()


def test_scaffold_server_update_on_hand_made_replies():
    """w_g += server_lr sum_k (N_k/N) dy_k and c += (1/N_clients) sum_k dc_k."""
    model = _model()
    cfg = TrainConfig(method="scaffold", clients=5, server_lr=0.7)
    method = Scaffold(cfg, CPU)
    server = method.init_server_state(model, None)  # type: ignore[arg-type]
    assert all(not t.any() for t in server["c"].values())  # c starts at zero
    server["c"] = _rand_like_params(model, 3)
    c0 = {n: t.clone() for n, t in server["c"].items()}
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    replies = []
    for seed, size in ((10, 10), (20, 30)):
        dy, dc = _rand_like_params(model, seed), _rand_like_params(model, seed + 1)
        payload = {DY + n: t for n, t in dy.items()} | {DC + n: t for n, t in dc.items()}
        replies.append(Reply(payload, 1, size))
    method.aggregate(model, replies, server, _info(cfg, method, server), torch.Generator())
    for n, p in model.named_parameters():
        dy = 0.25 * replies[0].payload[DY + n] + 0.75 * replies[1].payload[DY + n]
        torch.testing.assert_close(p.detach(), w0[n] + 0.7 * dy, rtol=0, atol=1e-6)
        dc = replies[0].payload[DC + n] + replies[1].payload[DC + n]
        torch.testing.assert_close(server["c"][n], c0[n] + dc / 5, rtol=0, atol=1e-6)


def test_scaffold_with_zero_control_variates_is_fedavg_local_training():
    model = _model()
    x, y = _data(50)
    kw = dict(local_steps=5, batch_size=10, lr_local=0.2)
    scaffold = Scaffold(TrainConfig(method="scaffold", **kw), CPU)
    fedavg = LocalSGD(TrainConfig(method="fedavg", **kw), CPU)
    server = scaffold.init_server_state(model, None)  # type: ignore[arg-type]
    state: dict = {}  # first participation: c_k = 0
    reply = scaffold.client(model, x, y, state, _info(scaffold.cfg, scaffold, server),
                            torch.Generator().manual_seed(3))
    ref = fedavg.client(model, x, y, {}, fedavg.round_info(1, {}),
                        torch.Generator().manual_seed(3))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach() + reply.payload[DY + n], ref.payload[n],
                                   rtol=0, atol=1e-6)
    assert "c_k" in state and any(t.abs().sum() > 0 for t in state["c_k"].values())


def _drift_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two clients with shifted features and skewed labels (heterogeneous, equal sizes)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(2):
        x = torch.randn(40, 4, generator=g) + (3.0 if k else -3.0)
        y = torch.randint(0, 3, (40,), generator=g)
        y[:20] = k
        out.append((x, y))
    return out


def _global_grad_norm(method_name: str, rounds: int) -> float:
    """Full-batch local GD (B = N_k) on a convex softmax regression; ||grad f|| at the end."""
    cfg = TrainConfig(method=method_name, clients=2, local_steps=20, lr_local=0.05,
                      batch_size=40)
    method = build_method(cfg, CPU)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    server = method.init_server_state(model, None)  # type: ignore[arg-type]
    states: list[dict] = [{}, {}]
    data = _drift_data()
    for r in range(1, rounds + 1):
        info = method.round_info(r, server)
        replies = [method.client(model, x, y, states[k], info, torch.Generator().manual_seed(r))
                   for k, (x, y) in enumerate(data)]
        method.aggregate(model, replies, server, info, torch.Generator())
    x_all = torch.cat([x for x, _ in data])
    y_all = torch.cat([y for _, y in data])
    grads = torch.autograd.grad(F.cross_entropy(model(x_all), y_all), list(model.parameters()))
    return float(sum((g * g).sum() for g in grads)) ** 0.5


def test_scaffold_corrects_client_drift():
    """FedAvg with many local steps stalls at a drifted point; SCAFFOLD reaches the optimum."""
    fedavg = _global_grad_norm("fedavg", 60)
    scaffold = _global_grad_norm("scaffold", 60)
    assert fedavg > 0.1
    assert scaffold < 0.05 * fedavg  # measured: 1.3e-3 vs 0.19


#: end-to-end runs that learn: the shared tiny configuration with more local steps and rounds
LEARNS = dict(local_steps=10, lr_local=0.1, rounds=3)


def test_scaffold_trains_on_digits_with_double_upload():
    fedavg = train(tiny(method="fedavg", **LEARNS), None, device="cpu")
    scaffold = train(tiny(method="scaffold", **LEARNS), None, device="cpu")
    assert scaffold.history[-1].test_accuracy > 0.4  # chance is 0.1
    for a, b in zip(scaffold.history, fedavg.history, strict=True):
        assert a.upload_bytes == 2 * b.upload_bytes > 0
    # round 1 (c = c_k = 0, server_lr 1, N_k/N weights) is exactly a FedAvg round
    assert scaffold.history[0].test_accuracy == fedavg.history[0].test_accuracy
    assert scaffold.history[1].extras["control_variate_norm"] > 0


class _Stop(Exception):
    pass


def test_scaffold_resume_restores_control_variates(tmp_path):
    cfg = dict(LEARNS, method="scaffold")
    full = train(tiny(**cfg), tmp_path / "full", device="cpu")

    def stop(event):
        if isinstance(event, RoundEnded) and event.round == 2:
            raise _Stop

    with pytest.raises(_Stop):
        train(tiny(**cfg), tmp_path / "cut", device="cpu", callback=stop)
    assert not (tmp_path / "cut" / PENDING).exists()
    resumed = resume(tmp_path / "cut", device="cpu")
    for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values(),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------------------- FedSGD
def test_fedsgd_round_is_one_full_batch_step_on_the_union():
    model = _model()
    sizes = (7, 25, 40)
    data = [_data(n, seed=i) for i, n in enumerate(sizes)]
    cfg = TrainConfig(method="fedsgd", lr_local=0.3, clients=3)
    method = FedSGD(cfg, CPU)
    info = method.round_info(1, {})
    replies = [method.client(model, x, y, {}, info, torch.Generator()) for x, y in data]
    for r, n in zip(replies, sizes, strict=True):
        assert r.accesses == 1 and r.num_examples == n
        assert r.upload_bytes == _param_bytes(model)

    ref = _model()
    x_all = torch.cat([x for x, _ in data])
    y_all = torch.cat([y for _, y in data])
    grads = torch.autograd.grad(F.cross_entropy(ref(x_all), y_all), list(ref.parameters()))
    method.aggregate(model, replies, {}, info, torch.Generator())
    moved = 0.0
    for p, q, g in zip(model.parameters(), ref.parameters(), grads, strict=True):
        torch.testing.assert_close(p.detach(), q.detach() - 0.3 * g, rtol=0, atol=1e-5)
        moved += float((p.detach() - q.detach()).abs().sum())
    assert moved > 1e-3  # the step did move the weights


def test_fedsgd_gradient_is_exact_when_chunked():
    model = _model()
    x, y = _data(30)
    whole = full_gradient(model, x, y, chunk=1024)
    chunked = full_gradient(model, x, y, chunk=7)
    for n in whole:
        torch.testing.assert_close(chunked[n], whole[n], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------- FedProx
def test_fedprox_proximal_gradient_is_mu_times_distance():
    """Two steps on the same batches: w2(mu) - w2(0) = -lr mu (w1 - w_g) exactly."""
    model = _model()
    x, y = _data(60)
    lr, mu = 0.2, 0.7
    kw = dict(steps=2, lr=lr, batch_size=20.0)
    plain, _ = local_training(model, x, y, generator=torch.Generator().manual_seed(4), **kw)
    prox, _ = local_training(model, x, y, generator=torch.Generator().manual_seed(4), mu=mu, **kw)
    one, _ = local_training(model, x, y, steps=1, lr=lr, batch_size=20.0,
                            generator=torch.Generator().manual_seed(4))
    total = 0.0
    for w_g, w1, a, b in zip(model.parameters(), one.parameters(), plain.parameters(),
                             prox.parameters(), strict=True):
        effect = -lr * mu * (w1.detach() - w_g.detach())
        torch.testing.assert_close(b.detach() - a.detach(), effect, rtol=0, atol=1e-6)
        total += float(effect.abs().sum())
    assert total > 1e-3


def test_fedprox_large_mu_keeps_client_near_global():
    model = _model()
    x, y = _data(60)
    anchor = clone_params(model)
    dists = []
    for mu in (0.0, 1.0, 4.0, 9.0):  # lr * mu <= 0.9 keeps the proximal step contracting
        cfg = TrainConfig(method="fedprox", prox_mu=mu, local_steps=10, batch_size=20,
                          lr_local=0.1)
        method = LocalSGD(cfg, CPU)
        reply = method.client(model, x, y, {}, method.round_info(1, {}),
                              torch.Generator().manual_seed(5))
        trained = _model()
        trained.load_state_dict(reply.payload)
        dists.append(distance(trained, anchor))
    assert all(a > b for a, b in itertools.pairwise(dists))
    assert dists[-1] < 0.5 * dists[0]
    # and "fedavg" ignores prox_mu (the proximal term is FedProx's alone)
    cfg = TrainConfig(method="fedavg", prox_mu=9.0, local_steps=10, batch_size=20, lr_local=0.1)
    method = LocalSGD(cfg, CPU)
    reply = method.client(model, x, y, {}, method.round_info(1, {}),
                          torch.Generator().manual_seed(5))
    trained = _model()
    trained.load_state_dict(reply.payload)
    assert distance(trained, anchor) == pytest.approx(dists[0], rel=1e-6)


# ------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize(
    ("method", "extra", "floor"),
    [("fedprox", dict(prox_mu=0.01), 0.4), ("fedsgd", dict(rounds=30, lr_local=1.0), 0.6)],
)
def test_end_to_end_beats_chance(method, extra, floor):
    result = train(tiny(method=method, **{**LEARNS, **extra}), None, device="cpu")
    assert result.history[-1].test_accuracy > floor  # chance is 0.1
    assert result.summary.privacy.epsilon is None and result.ledger.notion == "none"
    model_bytes = _param_bytes(result.model)
    assert all(h.upload_bytes == model_bytes for h in result.history)
    if method == "fedsgd":
        assert all(h.accesses == 1 for h in result.history)
