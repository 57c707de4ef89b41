"""Phase timing of a FedLAP-DP client round (fl/engine/phase_timer.py): each marked phase is
counted once per occurrence, and nothing is recorded outside :func:`timing`."""

from __future__ import annotations

import itertools

import torch
from helpers import tiny

from fedlap_privacy.fl.engine.phase_timer import phase, timing
from fedlap_privacy.fl.methods.fedlap import client_approximation, init_synthetic
from fedlap_privacy.models import ModelConfig, build_model


def test_a_client_round_marks_each_access_matching_and_local_steps() -> None:
    cfg = tiny(method="fedlap-dp", reinits=1, max_loops=2, real_batches=3, syn_steps=2,
               radius=1e6, sigma=1.0).validate()
    torch.manual_seed(0)
    model = build_model(ModelConfig(1, 8, 10, width=8, depth=2))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(60, 1, 8, 8, generator=g), torch.arange(60) % 2
    syn = init_synthetic(x, y, 2, "noise", g)
    ticks = itertools.count()  # one tick a reading: each occurrence of a phase adds 1
    with timing(clock=lambda: float(next(ticks))) as times:
        update = client_approximation(model, x, y, syn, cfg, cfg.lr_net, g, None)
    assert update.accesses == 6  # 2 loops of 3 real batches: no stop at this radius
    assert times.seconds == {"real gradients": 6.0, "matching": 6.0, "local steps": 2.0}
    with phase("matching"):  # outside timing(): nothing to add to
        pass
    assert times.get("matching") == 6.0
