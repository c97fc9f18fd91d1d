"""Checkpoints on a full disk: a real 1 MiB tmpfs, not a simulated error.

Saving a checkpoint larger than the free space must raise OSError with errno ENOSPC (whichever
file hits the limit: weights, optimizer state or trainer state), leave no partial directory and
no space held, and keep the previous checkpoint loadable; a later, smaller save succeeds.

Mounting a tmpfs needs root (CI runs as root). Where mounting is refused this test FAILS with
the reason: a skipped full-disk test would hide that the promise is untested.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bpo.checkpoint import latest_valid, load_checkpoint, save_checkpoint, verify

DISK_BYTES = 1 << 20  # 1 MiB
BIG = torch.zeros(DISK_BYTES // 2)  # float32: 2 MiB, twice the whole disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted at a fresh directory; unmounted afterwards."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mnt)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.fail(f"cannot run {' '.join(cmd)}: {e}; this test needs mount(8) and root")
    if done.returncode != 0:
        pytest.fail(
            f"`{' '.join(cmd)}` failed (exit {done.returncode}: {done.stderr.strip()}); the "
            f"full-disk test needs root or CAP_SYS_ADMIN to mount a tmpfs (uid {os.getuid()})"
        )
    try:
        yield mnt
    finally:
        res = subprocess.run(["umount", str(mnt)], capture_output=True, text=True)
        if res.returncode != 0:  # something still holds it: detach it anyway
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, text=True)


def _free_blocks(path: Path) -> int:
    return os.statvfs(path).f_bfree


def _parts(where: str) -> dict[str, object]:
    parts: dict[str, object] = {
        "weights": {"w": torch.full((8,), 2.0)},
        "optimizer": {"step": 2},
        "state": {"iteration": 2},
    }
    if where == "weights":
        parts["weights"] = {"w": BIG}
    elif where == "optimizer":
        parts["optimizer"] = {"exp_avg": BIG}
    else:
        parts["state"] = {"iteration": 2, "buffer": BIG}
    return parts


@pytest.mark.parametrize("where", ["weights", "optimizer", "state"])
def test_full_disk_raises_enospc_and_keeps_the_previous_checkpoint(small_disk, where):
    root = small_disk / "checkpoints"
    first = save_checkpoint(root, 1, {"w": torch.full((8,), 1.0)}, {"step": 1}, {"iteration": 1})
    free_before = _free_blocks(small_disk)

    with pytest.raises(OSError) as info:
        save_checkpoint(root, 2, **_parts(where))  # type: ignore[arg-type]
    assert info.value.errno == errno.ENOSPC, f"{type(info.value).__name__}: {info.value}"

    assert sorted(p.name for p in root.iterdir()) == ["iter-000001"], "partial directory left"
    assert _free_blocks(small_disk) == free_before, "the failed write still holds disk space"
    verify(first)
    found, skipped = latest_valid(root)
    assert found == first and skipped == []
    loaded = load_checkpoint(root)
    assert loaded.state == {"iteration": 1} and loaded.optimizer == {"step": 1}
    assert torch.equal(loaded.weights["w"], torch.full((8,), 1.0))

    # the run can go on once the checkpoint fits
    second = save_checkpoint(root, 2, {"w": torch.full((8,), 2.0)}, {"step": 2}, {"iteration": 2})
    assert load_checkpoint(root).path == second
