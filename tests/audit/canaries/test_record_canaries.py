"""RecordCanaries: black-box canary records catch a memorising model, and a model trained
without them is consistent."""

from __future__ import annotations

import runpy

import numpy as np
import pytest
import torch
from helpers import documented_script
from sklearn.datasets import load_digits
from sklearn.neighbors import KNeighborsClassifier

from fedlap_privacy.audit import RecordCanaries
from fedlap_privacy.errors import ConfigError

DELTA = 1e-5


def _digits() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int64)


def _zero_one_losses(model: KNeighborsClassifier, canaries: RecordCanaries) -> np.ndarray:
    assert canaries.features is not None and canaries.labels is not None
    return (model.predict(canaries.features) != canaries.labels).astype(float)


@pytest.mark.parametrize("kind", ["mislabelled", "out-of-distribution"])
def test_a_memorising_model_violates_a_tiny_claim(kind: str) -> None:
    x, y = _digits()
    canaries = RecordCanaries(400, kind)
    mixed_x, mixed_y = canaries.mix(x, y)
    kept = len(x) - (400 if kind == "mislabelled" else 0)
    assert len(mixed_x) == kept + int(canaries.included.sum())
    one_nn = KNeighborsClassifier(1).fit(mixed_x, mixed_y)  # memorises every record
    canaries.score_losses(_zero_one_losses(one_nn, canaries))
    result = canaries.audit(claimed_epsilon=0.5, delta=DELTA)
    assert result.violation, result.to_json()["one_run"]
    assert result.epsilon_lower_bound > 1.0


def test_a_model_trained_without_the_canaries_is_consistent() -> None:
    x, y = _digits()
    canaries = RecordCanaries(400, "mislabelled")
    mixed_x, mixed_y = canaries.mix(x, y)
    n_users = len(mixed_x) - int(canaries.included.sum())  # the user's rows come first
    one_nn = KNeighborsClassifier(1).fit(mixed_x[:n_users], mixed_y[:n_users])
    canaries.score_losses(_zero_one_losses(one_nn, canaries))
    result = canaries.audit(claimed_epsilon=0.5, delta=DELTA)
    assert result.verdict == "consistent" and result.epsilon_lower_bound < 0.5


def test_torch_scores_of_an_overfit_mlp() -> None:
    """An MLP fitted to the mixed digits until it memorises: its logit margins (and losses)
    on the canaries give a violation at epsilon 0.5."""
    x, y = _digits()
    canaries = RecordCanaries(200, "mislabelled")
    mixed_x, mixed_y = canaries.mix(x[:900], y[:900])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only contend
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 10))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        xt, yt = torch.from_numpy(mixed_x), torch.from_numpy(mixed_y)
        for _ in range(250):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xt), yt).backward()
            opt.step()
        margins = canaries.score(model, statistic="logit-margin")
    finally:
        torch.set_num_threads(threads)
    assert margins.shape == (200,)
    assert canaries.audit(claimed_epsilon=0.5, delta=DELTA).violation
    losses = canaries.score(model)
    assert np.all(losses <= 0.0)
    assert canaries.audit(claimed_epsilon=0.5, delta=DELTA).violation


def test_misuse_is_one_clear_error() -> None:
    x, y = _digits()
    with pytest.raises(ConfigError, match="m >= 10"):
        RecordCanaries(3)
    with pytest.raises(ConfigError, match="kind"):
        RecordCanaries(100, "poisoned")  # type: ignore[arg-type]
    canaries = RecordCanaries(100)
    with pytest.raises(ConfigError, match="mix the canaries"):
        canaries.score_losses(np.zeros(100))
    with pytest.raises(ConfigError, match="score the canaries first"):
        canaries.audit(1.0, DELTA)
    with pytest.raises(ConfigError, match="1-D integers"):
        canaries.mix(x, y.astype(float))
    canaries.mix(x, y)
    with pytest.raises(ConfigError, match="already mixed"):
        canaries.mix(x, y)
    with pytest.raises(ConfigError, match="one loss per canary"):
        canaries.score_losses(np.zeros(99))
    with pytest.raises(ConfigError, match="need at least 200 records"):
        RecordCanaries(100).mix(x[:150], y[:150])


def test_coins_are_secret_draws() -> None:
    first, second = RecordCanaries(1000), RecordCanaries(1000)
    assert not np.array_equal(first.included, second.included)
    assert 400 < first.included.sum() < 600


def test_the_documented_script_runs(monkeypatch, tmp_path, capsys) -> None:
    """docs/auditing.md's record-canary script as a reader copies it: a scikit-learn model
    that memorises refutes a claim of 1 (a violation whatever the secret coins)."""
    script = tmp_path / "record_canary_audit.py"
    script.write_text(documented_script("record_canary_audit.py"))
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__main__")
    verdict, bound = capsys.readouterr().out.split()
    assert verdict == "violation" and float(bound) > 1.0
    assert (tmp_path / "runs" / "record-canary-audit" / "report.html").exists()
