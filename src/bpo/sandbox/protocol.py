"""The sandbox contract (DESIGN section 2).

Two layers:

* :class:`Engine` is what an environment adapter implements: reset, step, a cheap fingerprint,
  and (optionally) native state get/set. Adapters are small and know nothing of snapshots.
* :class:`Sandbox` is what rollout code talks to: an engine plus a snapshot backend
  (native, fork server, replay, pickle; see ``bpo.sandbox.snapshots``). Snapshots are opaque
  handles that may be restored any number of times and are released explicitly.

Invalid or malformed action text is an *observation* ("Nothing happens."), never an
exception. A sandbox whose engine dies raises :class:`SandboxError` carrying the cause.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class SandboxError(RuntimeError):
    """The sandbox (or its engine process) failed; ``cause`` holds the underlying error."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message if cause is None else f"{message}: {cause!r}")
        self.cause = cause


class SnapshotError(SandboxError):
    """A snapshot could not be taken or restored (released, foreign, diverged, evicted)."""


@dataclass(frozen=True)
class Observation:
    """What the agent sees in a state."""

    text: str
    """The environment's observation text (the feedback of the last action, or the intro)."""
    instruction: str
    """The task's goal in words; constant over an episode."""
    admissible: tuple[str, ...] | None = None
    """Valid actions in this state where the environment enumerates them, else None."""
    done: bool = False
    """True when the state is terminal or truncated."""


@dataclass(frozen=True)
class StepResult:
    """The outcome of one action."""

    observation: Observation
    reward: float
    terminated: bool
    truncated: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    """An opaque handle to a saved sandbox state; only the sandbox that made it can restore it
    (the Ray pool falls back to replay elsewhere, using ``actions``)."""

    id: int
    owner: int
    """``id()``-like token of the sandbox that made it."""
    backend: str
    step: int
    """Number of actions applied since reset."""
    task: str
    seed: int
    actions: tuple[str, ...]
    """The action prefix since reset: enough to rebuild the state by replay."""
    fingerprint: str
    nbytes: int = 0
    """Bytes the snapshot held when taken (0 where unknown then, e.g. copy-on-write forks;
    :meth:`Sandbox.stats` reports the live total)."""
    trail: tuple[str, ...] = ()
    """A short digest of each step's outcome since reset, so that a replay names the step
    where it diverged (see ``bpo.sandbox.snapshots.replay``)."""


@dataclass(frozen=True)
class SnapshotStats:
    """Counters of one sandbox's snapshots since it was made."""

    live: int
    """Snapshots taken and not yet released (must return to 0 after every tree)."""
    live_bytes: int
    """Memory the live snapshots hold now (fork: their private pages, measured)."""
    taken: int
    restored: int
    snapshot_seconds: float
    """Total wall time spent in ``snapshot()``."""
    restore_seconds: float
    """Total wall time spent in ``restore()``."""
    evicted: int = 0
    """Snapshots dropped to respect a memory budget (they still restore, by replay)."""
    replayed: int = 0
    """Restores served by replaying the action prefix (replay backend, evicted snapshots,
    a pool actor that died)."""


@runtime_checkable
class Engine(Protocol):
    """An environment adapter. Implement this for a new environment."""

    def reset(self, task: str, seed: int) -> Observation: ...

    def step(self, action: str) -> StepResult: ...

    def fingerprint(self) -> str:
        """A cheap digest of the full environment state (equal states, equal fingerprints)."""
        ...

    def expert_action(self) -> str | None:
        """The environment's own expert/walkthrough action in this state, if it has one."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class NativeState(Protocol):
    """Optional: an engine that can export and import its own state (the *native* backend)."""

    def get_state(self) -> Any:
        """The full state as a value that later steps do not mutate (copy, don't alias)."""
        ...

    def set_state(self, state: Any) -> None:
        """Return to ``state``; may be called many times with one state, so do not keep
        references into it that later steps would mutate."""
        ...

    # Optional: ``release_state(state)``, called when the snapshot holding ``state`` is
    # released, for states that hold resources outside the Python object (the code sandbox's
    # workspace layers on disk).


@runtime_checkable
class FastReplay(Protocol):
    """Optional: reset to ``(task, seed)`` and apply ``actions`` in one call, building only the
    final observation (ScienceWorld, TextWorld-Express). The replay backend then checks the
    final observation and fingerprint, and falls back to a step-by-step replay on a mismatch."""

    def replay(self, task: str, seed: int, actions: Sequence[str]) -> Observation: ...


@runtime_checkable
class Sandbox(Protocol):
    """What rollout engines use: an engine plus snapshots."""

    def reset(self, task: str, seed: int = 0) -> Observation: ...

    def step(self, action: str) -> StepResult: ...

    def snapshot(self) -> Snapshot: ...

    def restore(self, snapshot: Snapshot) -> Observation:
        """Return to ``snapshot``'s state; returns the observation the agent saw there."""
        ...

    def release(self, snapshot: Snapshot) -> None: ...

    def fingerprint(self) -> str: ...

    def observation(self) -> Observation:
        """The current observation (the one returned by the last reset/step/restore)."""
        ...

    def expert_action(self) -> str | None: ...

    def stats(self) -> SnapshotStats: ...

    def close(self) -> None: ...


SandboxFactory = Callable[[], Sandbox]


@dataclass(frozen=True)
class EnvSpec:
    """A registered environment: how to build sandboxes and which tasks exist."""

    name: str
    make: Callable[..., Sandbox]
    """``make(backend="auto", **options) -> Sandbox``; options come from the sandbox config.
    Usually ``lambda backend="auto", **o: make_sandbox(lambda: MyEngine(**o), backend)``."""
    tasks: Callable[..., Sequence[str]]
    """``tasks(split, **options) -> task names``; split is "train", "valid" or "test"."""
    description: str = ""
