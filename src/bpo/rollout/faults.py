"""What the rollout engine does when a sandbox fails: a rollout hit by a fault is undone and
started again or dropped (:meth:`bpo.rollout.engine.RolloutEngine.run` says what a drop means
for the estimator), and a batch that loses too many stops with :class:`RolloutError` (raised
too when the policy keeps failing)."""

from __future__ import annotations

import contextlib

from bpo.rollout.records import _Cursor, _Rollout, _TreeRun
from bpo.rollout.snapshots import abandon, release, restore
from bpo.sandbox.protocol import Observation

__all__ = ["RolloutError", "check_faults", "checked_obs", "end_rollout", "fault", "undo"]


class RolloutError(RuntimeError):
    """Too many rollouts of a batch were lost to faults, or the policy kept failing."""


class _Fault(Exception):
    """A sandbox result that breaks the protocol (wrapped so that it is handled as a fault)."""


def check_faults(faults: dict[str, int], max_fault_frac: float, final: bool) -> None:
    """Over the bound: at the end of the batch (at least 4 lost), or already during it
    once the loss is beyond doubt (at least 20 lost)."""
    lost = faults["failed_rollouts"]
    if lost >= (4 if final else 20) and lost > max_fault_frac * max(faults["rollouts"], 1):
        raise RolloutError(
            f"{lost} of {faults['rollouts']} rollouts were lost to sandbox faults (more than "
            f"max_fault_frac={max_fault_frac}); check the sandbox (bpo check-sandbox) or its "
            "resources"
        )


def checked_obs(obs: object) -> Observation:
    if not isinstance(getattr(obs, "text", None), str):
        raise _Fault(f"the sandbox returned a malformed observation: {obs!r}"[:300])
    return obs  # type: ignore[return-value]


def end_rollout(run: _TreeRun) -> None:
    cur = run.current
    if cur is not None and cur.owns_snapshot and cur.snapshot is not None:
        release(run, cur.snapshot)
    run.current = None


def fault(run: _TreeRun, max_retries: int, faults: dict[str, int]) -> None:
    """The rollout in flight hit a fault: undo it, then start it again or drop it."""
    cur = run.current
    assert cur is not None
    undo(run, cur)
    cur.attempts += 1
    while cur.attempts <= max_retries:
        run.compute.retries += 1
        faults["retries"] += 1
        try:
            if cur.snapshot is None:  # the root backbone: the task from its reset
                obs = checked_obs(run.sandbox.reset(run.tree.task, run.tree.seed))
            else:
                obs = checked_obs(restore(run, cur.snapshot))
        except Exception:
            run.broken = True  # cannot get back to a known state in this sandbox
            break
        run.cursor = _Cursor(cur.start, cur.depth, obs, fork_start=cur.fork_start)
        return
    run.compute.failed_rollouts += 1
    faults["failed_rollouts"] += 1
    run.cursor = None
    with contextlib.suppress(Exception):
        end_rollout(run)
    run.current = None
    if run.broken:  # what is still queued cannot be restored here
        abandon(run)


def undo(run: _TreeRun, cur: _Rollout) -> None:
    """Remove what the failed rollout added: its nodes, prompts, branch points (their
    snapshots released) and, for a root backbone of width 1, the root's decision."""
    tree = run.tree
    while len(run.pending) > cur.pending:
        with contextlib.suppress(Exception):
            release(run, run.pending.pop().snapshot)
    for _, snap, _ in run.backbone[cur.backbone :]:
        with contextlib.suppress(Exception):
            release(run, snap)
    del run.backbone[cur.backbone :]
    if cur.nodes < len(tree):
        tree.truncate(cur.nodes)
    for node in [n for n in run.prompts if n >= cur.nodes]:
        del run.prompts[node]
    if cur.snapshot is None and run.root_width < 2:
        tree.nodes[0].branch_k = 1
    run.branches = cur.branches
    run.cursor = None
