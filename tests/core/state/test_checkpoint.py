"""Checkpoints: round trip, atomic writes, and refusal of anything that is not plain data."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch

from fedlap_privacy.errors import CheckpointError
from fedlap_privacy.models import ModelConfig, build_model
from fedlap_privacy.state.checkpoint import FORMAT, load_checkpoint, save_checkpoint


class _MakesMarker:
    """Pickles to a call of os.mkdir(marker): code that runs if the file is unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def _payload() -> dict:
    config = ModelConfig(in_channels=1, image_size=28, num_classes=10)
    model = build_model(config)
    return {
        "model": model.state_dict(),
        "model_config": config.to_dict(),
        "round": 7,
        "method": "fedlap-dp",
        "rng_seed": 0,
        "sigma": 1.0,
        "private": True,
        "resume_from": None,
        "ledger": [{"round": r, "epsilon": 0.1 * r, "clients": [0, 1, 2]} for r in range(3)],
        "clients": {"0": {"control": torch.zeros(3)}, "1": {"control": torch.ones(3)}},
        "shape": (1, 28, 28),
    }


def test_round_trip(tmp_path: Path) -> None:
    payload = _payload()
    path = tmp_path / "runs" / "deep" / "ckpt.pt"  # parents are created
    save_checkpoint(path, payload)
    assert "format" not in payload  # the caller's dict is left alone
    loaded = load_checkpoint(path)
    assert loaded["format"] == FORMAT
    assert loaded.keys() == {*payload, "format"}
    for name, tensor in payload["model"].items():
        assert torch.equal(loaded["model"][name], tensor)
    for key in ("model_config", "round", "method", "sigma", "private", "resume_from", "ledger"):
        assert loaded[key] == payload[key]
    assert torch.equal(loaded["clients"]["1"]["control"], torch.ones(3))
    assert tuple(loaded["shape"]) == (1, 28, 28)
    model = build_model(loaded["model_config"])
    model.load_state_dict(loaded["model"])


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"round": 1})
    save_checkpoint(path, {"round": 2})  # overwrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert load_checkpoint(path)["round"] == 2


def test_unsaveable_payload_is_refused_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    marker = tmp_path / "marker"
    with pytest.raises(CheckpointError, match="not plain data"):
        save_checkpoint(path, {"evil": _MakesMarker(marker)})
    with pytest.raises(CheckpointError, match="cannot be serialised"):
        save_checkpoint(path, {"fn": lambda: 0})
    assert list(tmp_path.iterdir()) == []


def test_tampered_checkpoint_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    marker = tmp_path / "marker"
    torch.save({"format": FORMAT, "model": _MakesMarker(marker)}, path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"refusing to load {path}: it contains code")
    assert "mkdir" in message and "\n" not in message
    assert not marker.exists()
    # The file really is dangerous: an unsafe load runs the payload.
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "nope.pt")


def test_random_bytes_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "noise.pt"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError, match="not a readable torch checkpoint") as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value)


def test_truncated_checkpoint_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, _payload())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable torch checkpoint"):
        load_checkpoint(path)


def test_other_zip_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "archive.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("hello.txt", "not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable torch checkpoint"):
        load_checkpoint(path)


@pytest.mark.parametrize("content", [{"model": {}}, {"format": "other/2"}, [1, 2, 3]])
def test_torch_file_without_format_is_refused(tmp_path: Path, content: object) -> None:
    path = tmp_path / "plain.pt"
    torch.save(content, path)
    with pytest.raises(CheckpointError, match="is not a fedlap-privacy checkpoint"):
        load_checkpoint(path)
