"""``train`` accepts no canary count the audit cannot use: the one-run audit ranks at least
MIN_AUDIT_CANARIES canaries (it refused a run of 1 canary after training it), so ``train``
refuses 1 at config validation, in one line with exit 2, before any data is read."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from fedlap_privacy.audit.bounds.one_run import one_run_audit
from fedlap_privacy.cli.main import app
from fedlap_privacy.errors import ConfigError
from fedlap_privacy.fl.config import TrainConfig
from fedlap_privacy.state.canary_state import MIN_AUDIT_CANARIES


def test_the_fewest_canaries_train_takes_are_the_fewest_the_audit_ranks():
    assert MIN_AUDIT_CANARIES == 2
    with pytest.raises(ConfigError, match="at least 2 canaries"):
        one_run_audit(np.zeros(MIN_AUDIT_CANARIES - 1), np.ones(1, dtype=bool), 1e-5)
    audited = one_run_audit(np.array([0.0, 1.0]), np.array([False, True]), 1e-5)
    assert audited.canaries == MIN_AUDIT_CANARIES
    with pytest.raises(ConfigError, match=r"canaries 1: the one-run audit needs at least 2"):
        TrainConfig(canaries=1).validate()
    for count in (0, MIN_AUDIT_CANARIES, 1000):
        assert TrainConfig(canaries=count).validate().canaries == count


def test_train_refuses_one_canary_in_one_line(tmp_path):
    out = tmp_path / "run"
    shown = CliRunner().invoke(app, ["train", "--canaries", "1", "--rounds", "1", "--out",
                                     str(out)], env={"COLUMNS": "300"})
    assert shown.exit_code == 2 and "Traceback" not in shown.output
    lines = [line for line in shown.output.splitlines() if line.strip()]
    assert lines == ["error: canaries 1: the one-run audit needs at least 2 canaries to rank "
                     "(0: none)"]
    assert not out.exists()  # refused at validation, before the run folder
