"""``train(TrainConfig(...))`` from Python: a line per round on stderr in a terminal (and with
``progress=True``), the run's warnings among them; silent with ``progress=False``, outside a
terminal by default, and for the drivers that call the engine's own ``train``."""

from __future__ import annotations

import io

from fedlap_privacy.fl import TrainConfig, train
from fedlap_privacy.fl.engine.terminal_progress import progress_callback


def _tiny(rounds: int = 1, **kw) -> TrainConfig:
    return TrainConfig(method="dp-fedavg", rounds=rounds, width=4, local_steps=1, **kw)


def test_progress_lines_per_round_with_the_warnings(tmp_path, capsys):
    """sigma 0.3 on digits' small clients: epsilon far above 10, said before round 1."""
    result = train(_tiny(2, sigma=0.3), tmp_path / "a", progress=True)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("training dp-fedavg on digits: 2 rounds")
    assert any(line.startswith("warning: epsilon") and "above the usual range" in line
               for line in err)
    rounds = [line for line in err if line.startswith("round ")]
    assert [line.split(":")[0] for line in rounds] == ["round 1/2", "round 2/2"]
    assert f"epsilon {result.summary.privacy.epsilon:.3f}" in rounds[-1]


def test_silent_when_asked_and_outside_a_terminal(tmp_path, capsys):
    train(_tiny(sigma=2.0), tmp_path / "b", progress=False)
    train(_tiny(sigma=2.0), tmp_path / "c")  # pytest's stderr is not a terminal
    assert capsys.readouterr().err == ""


def test_a_terminal_gets_lines_by_default_and_a_callback_wins():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert progress_callback(None, None, Terminal()) is not None
    assert progress_callback(None, None, io.StringIO()) is None
    assert progress_callback(False, None, Terminal()) is None
    mine = lambda event: None  # noqa: E731
    assert progress_callback(True, mine, Terminal()) is mine
