"""A tree's sandbox snapshots, accounted: their time and counts go into the tree's compute, a
failed release marks the sandbox for replacement, and a dropped tree releases what it holds."""

from __future__ import annotations

import contextlib
import time

from bpo.rollout.records import _TreeRun
from bpo.sandbox.protocol import Observation, Snapshot

__all__ = ["abandon", "release", "restore", "snapshot"]


def snapshot(run: _TreeRun) -> Snapshot:
    t0 = time.perf_counter()
    snap = run.sandbox.snapshot()
    run.compute.snapshot_seconds += time.perf_counter() - t0
    run.compute.snapshots += 1
    return snap


def restore(run: _TreeRun, snap: Snapshot) -> Observation:
    t0 = time.perf_counter()
    obs = run.sandbox.restore(snap)
    run.compute.snapshot_seconds += time.perf_counter() - t0
    run.compute.restores += 1
    return obs


def release(run: _TreeRun, snap: Snapshot) -> None:
    try:
        run.sandbox.release(snap)
    except Exception:
        run.dirty = True  # its snapshots are no longer accounted for: replace it after


def abandon(run: _TreeRun) -> None:
    """Release every snapshot a dropped tree still holds; errors here are secondary."""
    snaps = [p.snapshot for p in run.pending] + [s for _, s, _ in run.backbone]
    cur = run.current
    if cur is not None and cur.owns_snapshot and cur.snapshot is not None:
        snaps.append(cur.snapshot)  # the last fork's snapshot, held until it is over
    run.pending.clear()
    run.backbone = []
    run.current = None
    for snap in snaps:
        with contextlib.suppress(Exception):
            run.sandbox.release(snap)
