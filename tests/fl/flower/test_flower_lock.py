"""The Flower run folder has one writer: ``train --engine flower`` holds its lock before any
SuperNode starts, and the ServerApp works under that lock (its token) or takes it itself;
a folder another process holds is refused, and nothing is written into it."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

flwr = pytest.importorskip("flwr")

import helpers  # noqa: E402
from flower_grid import FakeGrid, task_identity  # noqa: E402, F401
from flwr.app import Context, RecordDict  # noqa: E402
from lock_holder import lock_held_elsewhere  # noqa: E402

from fedlap_privacy.fl.engine.flower_app import run_config_of, run_flower  # noqa: E402
from fedlap_privacy.fl.flower.server_app import STATUS, _server_main  # noqa: E402
from fedlap_privacy.fl.run.run_files import holds_run, load_release  # noqa: E402
from fedlap_privacy.state.run_lock import LOCK_FILE, RunBusyError  # noqa: E402

tiny = partial(helpers.tiny, clients=2, reproducible_noise=True, method="dp-fedavg", width=8,
               local_steps=1, rounds=1)


def _context(out: Path, token: str) -> Context:
    run_config = run_config_of(tiny(), out=str(out), device="cpu", node_wait=5.0,
                               run_lock=token)
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                   run_config=run_config)


def test_the_server_app_works_under_its_launchers_lock_only(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with lock_held_elsewhere(out) as (_, token):  # the launcher, holding the folder
        for stranger in ("", "0" * len(token)):  # a second server on the same folder
            with pytest.raises(RunBusyError, match="holds the run"):
                _server_main(FakeGrid(2), _context(out, stranger))  # type: ignore[arg-type]
            assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # no status either
        _server_main(FakeGrid(2), _context(out, token))  # type: ignore[arg-type]
    assert [e["status"] for e in load_release(out).ledger] == ["completed"]
    assert '"completed"' in (out / STATUS).read_text()


def test_train_engine_flower_refuses_a_held_folder_before_any_node_starts(
    tmp_path: Path, monkeypatch
) -> None:
    from fedlap_privacy.fl.flower import runner

    def no_deployment(*args, **kwargs):
        raise AssertionError("a deployment was started for a folder another process holds")

    monkeypatch.setattr(runner, "LocalDeployment", no_deployment)
    out = tmp_path / "run"
    with lock_held_elsewhere(out) as (holder, _):
        with pytest.raises(RunBusyError, match=f"pid {holder.pid}"):
            run_flower(tiny(), out, device="cpu")
        assert not holds_run(out)
