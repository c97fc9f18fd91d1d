"""Rebuilding a state by replay: reset, then apply the action prefix, checking every step.

Works on anything with ``reset(task, seed)``, ``step(action)`` and ``fingerprint()``: an
:class:`~bpo.sandbox.protocol.Engine` (the replay backend, evicted fork snapshots) or a
:class:`~bpo.sandbox.protocol.Sandbox` (:func:`rebuild`, the Ray pool's fallback when the actor
holding a snapshot is gone). A replay that does not reproduce the recorded outcomes raises
:class:`~bpo.sandbox.protocol.SnapshotError` naming the first step that diverged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from bpo.sandbox.protocol import Observation, Snapshot, SnapshotError, StepResult
from bpo.sandbox.snapshots.ledger import step_digest

_NONDETERMINISM = (
    "the environment is not deterministic given (task, seed, actions): look for unseeded "
    "randomness, wall-clock time, hash()-ordered sets, or state shared between instances"
)


class Replayable(Protocol):
    def reset(self, task: str, seed: int) -> Observation: ...

    def step(self, action: str) -> StepResult: ...

    def fingerprint(self) -> str: ...


def replay(
    target: Replayable,
    task: str,
    seed: int,
    actions: Sequence[str],
    trail: Sequence[str] = (),
    fingerprint: str | None = None,
) -> Observation:
    """Reset ``target`` to ``(task, seed)`` and apply ``actions``; returns the last observation.

    ``trail`` (one :func:`~bpo.sandbox.snapshots.ledger.step_digest` per action) and
    ``fingerprint`` (of the final state), when given, are verified.
    """
    if trail and len(trail) != len(actions):
        raise SnapshotError(f"replay: {len(actions)} actions but {len(trail)} step digests")
    obs = target.reset(task, seed)
    for i, action in enumerate(actions):
        result = target.step(action)
        obs = result.observation
        if trail and step_digest(result) != trail[i]:
            raise SnapshotError(
                f"replay of task {task!r} (seed {seed}) diverged at step {i + 1} of "
                f"{len(actions)} (action {action!r}): the outcome differs from the recorded one "
                f"(observation now {_short(obs.text)}); {_NONDETERMINISM}"
            )
    if fingerprint is not None:
        now = target.fingerprint()
        if now != fingerprint:
            raise SnapshotError(
                f"replay of task {task!r} (seed {seed}) reproduced every step's outcome but the "
                f"fingerprint after {len(actions)} steps differs ({now!r} != {fingerprint!r}); "
                f"{_NONDETERMINISM}, or fingerprint() reads volatile data (addresses, time)"
            )
    return obs


def rebuild(sandbox: Any, snapshot: Snapshot) -> Observation:
    """Bring any sandbox to ``snapshot``'s state by replaying its action prefix (verified).

    Use it when the sandbox that took the snapshot is gone; the state is then the
    snapshot's, while the snapshot itself stays owned by (and releasable in) its maker.
    """
    return replay(
        sandbox,
        snapshot.task,
        snapshot.seed,
        snapshot.actions,
        snapshot.trail,
        snapshot.fingerprint,
    )


def _short(text: str, n: int = 80) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")
