"""Checkpoints: round trip, fallback past corrupt or partial ones, RNG restore."""

import random

import numpy as np
import pytest
import torch

from bpo.checkpoint import (
    CheckpointError,
    latest_valid,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


def _save(root, it, value):
    w = {"w": torch.full((3,), float(value))}
    return save_checkpoint(root, it, w, {"step": it}, {"iteration": it, "rng": rng_state()})


def test_round_trip_and_keep(tmp_path):
    for it in range(5):
        _save(tmp_path, it, it)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter-000000",
        "iter-000002",
        "iter-000003",
        "iter-000004",
    ]
    loaded = load_checkpoint(tmp_path)
    assert loaded.state["iteration"] == 4
    assert torch.equal(loaded.weights["w"], torch.full((3,), 4.0))
    assert loaded.optimizer == {"step": 4}


def test_corrupt_and_partial_fall_back(tmp_path):
    _save(tmp_path, 1, 1.0)
    newest = _save(tmp_path, 2, 2.0)
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (newest / "model.safetensors").write_bytes(bytes(data))
    (tmp_path / "iter-000003.tmp-99").mkdir()
    found, skipped = latest_valid(tmp_path)
    assert found is not None and found.name == "iter-000001"
    assert any("checksum" in s for s in skipped) and any("unfinished" in s for s in skipped)
    loaded = load_checkpoint(tmp_path)
    assert loaded.state["iteration"] == 1 and len(loaded.skipped) == 2
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(newest)


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        load_checkpoint(tmp_path)


def test_failed_write_keeps_previous(tmp_path):
    _save(tmp_path, 1, 1.0)

    class Boom:
        def __reduce__(self):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        save_checkpoint(tmp_path, 2, {"w": torch.zeros(1)}, {}, {"x": Boom()})
    assert [p.name for p in tmp_path.iterdir()] == ["iter-000001"]


def test_rng_state_restores_streams():
    s = rng_state()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(s)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a
