"""``ExactRDPAccountant`` (fedlap_privacy.accountant.opacus) inside Opacus.

* A real Opacus training loop (Poisson sampling, a tiny linear model, the noise multiplier
  changed mid-run) run twice, once with Opacus' ``accountant="rdp"`` and once with ours by
  its registered name: both record the same history, and the epsilons agree to 1e-6 relative
  (Opacus' RDP is sound at these q and sigma).
* At q = 0.4, sigma = 12 and the fractional order 58.75, Opacus' RDP is NEGATIVE (its signed
  series stops too early) and so is the epsilon it reports there; ours is positive and lies
  between its neighbouring integer orders, as the RDP of a mechanism must (RDP is
  non-decreasing in the order).
* state_dict round trip, including a checkpoint written by Opacus' RDPAccountant.
"""

from __future__ import annotations

import io
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from opacus import PrivacyEngine
from opacus.accountants import RDPAccountant, create_accountant
from opacus.accountants.analysis.rdp import compute_rdp
from opacus.accountants.utils import get_noise_multiplier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedlap_privacy.accountant import DEFAULT_ORDERS, sgm_rdp
from fedlap_privacy.accountant.opacus import (
    MECHANISM,
    PLD_MECHANISM,
    ExactRDPAccountant,
    HistoryEntry,
    TightPLDAccountant,
)

DELTA = 1e-5
RTOL = 1e-6

pytestmark = pytest.mark.filterwarnings(
    "ignore:Secure RNG turned off:UserWarning",  # Opacus, on every PrivacyEngine
    "ignore:Full backward hook is firing:UserWarning",  # torch: the inputs need no grad
    "ignore:Optimal order is the:UserWarning",  # Opacus' calibration probes huge sigmas
)


def _train(accountant: str, sigmas: list[float]) -> PrivacyEngine:
    """Run one optimiser step per entry of ``sigmas`` (the DPOptimizer's noise multiplier)."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 5), torch.randint(0, 2, (64,)))
    model = nn.Linear(5, 2)
    engine = PrivacyEngine(accountant=accountant)
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=16),
        noise_multiplier=sigmas[0],
        max_grad_norm=1.0,
        poisson_sampling=True,
    )
    batches = iter(loader)
    for sigma in sigmas:
        optimizer.noise_multiplier = sigma
        x, y = next(batches, None) or next(iter(loader))
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return engine


def test_real_opacus_loop_matches_opacus_rdp() -> None:
    sigmas = [1.0, 1.0, 1.0, 1.3, 1.3, 1.0]
    ours, theirs = _train(MECHANISM, sigmas), _train("rdp", sigmas)
    assert isinstance(ours.accountant, ExactRDPAccountant)
    assert ours.accountant.mechanism() == MECHANISM
    q = 1 / 4  # Opacus' sample rate: 1 / len(data_loader), 64 records in batches of 16
    expected = [(1.0, q, 3), (1.3, q, 2), (1.0, q, 1)]
    assert theirs.accountant.history == expected
    assert ours.accountant.history == expected  # HistoryEntry is a tuple
    assert all(isinstance(e, HistoryEntry) for e in ours.accountant.history)
    assert len(ours.accountant) == len(sigmas)  # steps (Opacus' len() counts entries)
    eps_ours, eps_theirs = ours.get_epsilon(DELTA), theirs.get_epsilon(DELTA)
    assert eps_ours == pytest.approx(eps_theirs, rel=RTOL)
    assert 4.0 < eps_ours < 8.0  # six steps at q = 1/4 and sigma ~1: about 5.1
    # same composition, order by order
    rdp_opacus = sum(
        compute_rdp(q=q_, noise_multiplier=s, steps=n, orders=DEFAULT_ORDERS)
        for s, q_, n in expected
    )
    np.testing.assert_allclose(ours.accountant.rdp(), rdp_opacus, rtol=RTOL)
    assert ours.accountant.get_privacy_spent(delta=DELTA) == pytest.approx(
        theirs.accountant.get_privacy_spent(delta=DELTA), rel=RTOL
    )


@pytest.mark.parametrize(
    ("q", "sigma", "steps"), [(0.01, 1.1, 1000), (0.004, 0.8, 10_000), (0.05, 2.0, 300)]
)
def test_epsilon_equals_opacus_at_typical_settings(q: float, sigma: float, steps: int) -> None:
    ours, theirs = ExactRDPAccountant(), RDPAccountant()
    ours.history = [(sigma, q, steps)]
    theirs.history = [(sigma, q, steps)]
    assert ours.get_epsilon(DELTA) == pytest.approx(theirs.get_epsilon(DELTA), rel=RTOL)


def test_registered_name_builds_our_accountant_and_calibrates_sigma() -> None:
    assert isinstance(create_accountant(MECHANISM), ExactRDPAccountant)
    assert ExactRDPAccountant.DEFAULT_ALPHAS == RDPAccountant.DEFAULT_ALPHAS
    # make_private_with_epsilon's calibration, by name (Opacus sound here: same sigma)
    kwargs = {"target_epsilon": 3.0, "target_delta": DELTA, "sample_rate": 0.01, "epochs": 5}
    ours = get_noise_multiplier(accountant=MECHANISM, **kwargs)
    assert ours == pytest.approx(get_noise_multiplier(accountant="rdp", **kwargs), rel=1e-9)


def test_assigning_an_instance_with_custom_orders() -> None:
    engine = PrivacyEngine(accountant="rdp")
    engine.accountant = ExactRDPAccountant(orders=[2, 4, 8, 16, 32])
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(torch.randn(20, 3), torch.randn(20, 1)), 10),
        noise_multiplier=1.5,
        max_grad_norm=1.0,
        poisson_sampling=True,
    )
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    assert engine.accountant.history == [(1.5, 0.5, 2)]
    eps, order = engine.accountant.get_privacy_spent(delta=DELTA)
    assert order in {2, 4, 8, 16, 32}
    reference = RDPAccountant()
    reference.history = [(1.5, 0.5, 2)]
    assert eps == pytest.approx(reference.get_epsilon(DELTA, alphas=[2, 4, 8, 16, 32]), rel=RTOL)


def test_opacus_rdp_is_negative_at_order_58_75_ours_is_not() -> None:
    q, sigma, alpha = 0.4, 12.0, 58.75
    theirs = float(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=[alpha])[0])
    ours = float(sgm_rdp(q, sigma, [alpha])[0])
    assert theirs < 0.0  # impossible: RDP (a Rényi divergence) is >= 0
    below, above = sgm_rdp(q, sigma, [58.0, 59.0])
    assert 0.0 < below <= ours <= above  # RDP is non-decreasing in the order
    # The defect reaches epsilon: at that order Opacus reports a negative epsilon.
    ours_acc, opacus_acc = ExactRDPAccountant(), RDPAccountant()
    ours_acc.history = opacus_acc.history = [(sigma, q, 100)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Opacus: "optimal order is the largest"
        assert opacus_acc.get_epsilon(DELTA, alphas=[alpha]) < 0.0
    assert ours_acc.get_epsilon(DELTA, alphas=[alpha]) > 0.0


def test_state_dict_round_trip() -> None:
    acc = ExactRDPAccountant()
    for sigma in (1.0, 1.0, 2.0):
        acc.step(noise_multiplier=sigma, sample_rate=0.02)
    state = acc.state_dict()
    assert state["mechanism"] == MECHANISM
    buffer = io.BytesIO()
    torch.save(state, buffer)  # as PrivacyEngine.save_checkpoint stores it
    buffer.seek(0)
    restored = ExactRDPAccountant()
    restored.load_state_dict(torch.load(buffer, weights_only=False))
    assert restored.history == acc.history == [(1.0, 0.02, 2), (2.0, 0.02, 1)]
    assert restored.get_epsilon(DELTA) == acc.get_epsilon(DELTA)
    restored.step(noise_multiplier=2.0, sample_rate=0.02)  # keeps merging after a load
    assert restored.history[-1] == (2.0, 0.02, 2)
    # a checkpoint of Opacus' RDPAccountant re-accounts with ours; other mechanisms are refused
    opacus_acc = RDPAccountant()
    opacus_acc.step(noise_multiplier=1.0, sample_rate=0.02)
    from_opacus = ExactRDPAccountant()
    from_opacus.load_state_dict(opacus_acc.state_dict())
    assert from_opacus.get_epsilon(DELTA) == pytest.approx(opacus_acc.get_epsilon(DELTA), rel=RTOL)
    with pytest.raises(ValueError, match="prv"):
        from_opacus.load_state_dict({"history": [], "mechanism": "prv"})
    with pytest.raises(ValueError, match="history"):
        from_opacus.load_state_dict({"mechanism": MECHANISM})


def test_empty_history_and_bad_delta() -> None:
    acc = ExactRDPAccountant()
    assert len(acc) == 0
    assert acc.get_privacy_spent(delta=DELTA) == (0.0, 0.0)
    with pytest.raises(ValueError, match="delta"):
        acc.get_epsilon(0.0)


def test_package_import_stays_torch_free() -> None:
    code = "import sys, fedlap_privacy.accountant; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_real_opacus_loop_with_the_pld_accountant_matches_dp_accounting() -> None:
    """"fedlap-pld" in a real loop (sigma changed mid-run): the same history as Opacus' RDP
    accountant, an epsilon within 0.2% of dp-accounting's PLD on that history, below RDP;
    its state dict round-trips."""
    import dp_accounting as dpa
    from dp_accounting.pld import PLDAccountant

    sigmas = [1.0] * 6 + [1.5] * 6
    ours = _train(PLD_MECHANISM, sigmas)
    assert isinstance(ours.accountant, TightPLDAccountant)
    rdp = _train("rdp", sigmas)
    assert [tuple(e) for e in ours.accountant.history] == [tuple(e) for e in rdp.accountant.history]
    oracle = PLDAccountant()
    for sigma, q, n in ours.accountant.history:
        oracle.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), n)
    eps = ours.get_epsilon(DELTA)
    assert eps == pytest.approx(float(oracle.get_epsilon(DELTA)), rel=2e-3)
    assert eps < rdp.get_epsilon(DELTA)
    restored = TightPLDAccountant()
    restored.load_state_dict(ours.accountant.state_dict())
    assert restored.mechanism() == "fedlap-pld" and restored.get_epsilon(DELTA) == eps
    assert TightPLDAccountant().get_epsilon(DELTA) == 0.0
