"""fedlap_privacy.state.run_lock: one writer per run folder, and a folder only its owner can
change."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest
from lock_holder import lock_held_elsewhere

from fedlap_privacy.errors import ConfigError
from fedlap_privacy.state.run_lock import LOCK_FILE, RunBusyError, lock_run_folder


def test_a_second_writer_is_refused_until_the_first_dies(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with lock_held_elsewhere(out) as (holder, _):
        with pytest.raises(RunBusyError, match=f"another process \\(pid {holder.pid}\\) holds"):
            lock_run_folder(out)
        holder.send_signal(signal.SIGKILL)  # a crashed run: the kernel drops its lock
        holder.wait(timeout=30)
        with lock_run_folder(out) as lock:
            assert not lock.inherited and lock.covers(out)
            with pytest.raises(RunBusyError):  # this process holds it now: a second open waits
                lock_run_folder(out)
        lock_run_folder(out).release()  # released on leaving the block


def test_the_launchers_token_works_under_its_lock_and_no_other(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with lock_held_elsewhere(out) as (_, token):
        with lock_run_folder(out, inherit=token) as lock:
            assert lock.inherited and lock.token == token
        for wrong in ("", "?", token[:-1] + ("0" if token[-1] != "0" else "1")):
            with pytest.raises(RunBusyError):
                lock_run_folder(out, inherit=wrong)


def test_a_new_folder_is_made_for_its_owner_alone(tmp_path: Path) -> None:
    out = tmp_path / "a" / "run"
    with lock_run_folder(out, create=True):
        mode = stat.S_IMODE(out.stat().st_mode)
        assert mode & 0o022 == 0 and mode & 0o700 == 0o700
        assert stat.S_IMODE((out / LOCK_FILE).stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match="no run folder"):
        lock_run_folder(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_folder_others_can_change_is_refused(tmp_path: Path, mode: int) -> None:
    out = tmp_path / "run"
    out.mkdir()
    out.chmod(mode)  # e.g. pre-created by another user for this one to train into
    with pytest.raises(ConfigError, match="writable by its group or by others"):
        lock_run_folder(out, create=True)
    assert not (out / LOCK_FILE).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder away needs root")
def test_a_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir(mode=0o755)
    os.chown(out, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to another user"):
        lock_run_folder(out, create=True)
    assert not (out / LOCK_FILE).exists()


def test_links_and_files_are_refused_and_not_followed(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    with pytest.raises(ConfigError, match="symbolic link"):
        lock_run_folder(link, create=True)
    file = tmp_path / "file"
    file.write_text("keep")
    with pytest.raises(ConfigError, match="is a file"):
        lock_run_folder(file, create=True)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (real / LOCK_FILE).symlink_to(victim)  # a planted lock file
    with pytest.raises(ConfigError, match="plain file"):
        lock_run_folder(real)
    assert victim.read_text() == "precious" and file.read_text() == "keep"
    assert (real / LOCK_FILE).is_symlink()  # left as planted: never written through
