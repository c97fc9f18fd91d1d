"""In-process sandboxes: the engine lives in this process and a *state store* saves and loads
its state. Three stores, one per backend:

* ``native``: the engine's own ``get_state``/``set_state`` (fastest where engines offer it);
* ``pickle``: a pickle of the engine's state (engines with ``get_state``) or of the engine;
* ``replay``: nothing is stored; restore resets and replays the action prefix, verified.

:class:`LocalSandbox` does the rest (episode, ledger, errors) and is what ``make_sandbox``
returns for these backends.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from bpo.sandbox.protocol import (
    Engine,
    FastReplay,
    NativeState,
    Observation,
    SandboxError,
    Snapshot,
    SnapshotError,
    SnapshotStats,
    StepResult,
)
from bpo.sandbox.snapshots.ledger import Episode, Ledger, Record, approx_nbytes
from bpo.sandbox.snapshots.replay import replay

T = TypeVar("T")


class StateStore(Protocol):
    """How an in-process backend saves and loads an engine's state."""

    name: str
    replays: bool
    """True when ``load`` rebuilds by replay (counted in ``SnapshotStats.replayed``)."""

    def save(self, engine: Engine) -> tuple[Any, int]:
        """Return (payload, bytes held by the payload) for the engine's current state."""
        ...

    def load(self, engine: Engine, record: Record) -> Engine:
        """Bring ``engine`` (or a new engine) to ``record``'s state and return it."""
        ...

    def drop(self, engine: Engine, record: Record) -> None:
        """``record`` was released: free what its payload holds outside this process."""
        ...


class NativeStore:
    """The engine's own ``get_state``/``set_state``."""

    name = "native"
    replays = False

    def save(self, engine: Engine) -> tuple[Any, int]:
        state = engine.get_state()  # type: ignore[attr-defined]
        nbytes = getattr(state, "nbytes", None)  # the engine's own size, when it knows it
        return state, nbytes if isinstance(nbytes, int) else approx_nbytes(state)

    def load(self, engine: Engine, record: Record) -> Engine:
        engine.set_state(record.payload)  # type: ignore[attr-defined]
        return engine

    def drop(self, engine: Engine, record: Record) -> None:
        release = getattr(engine, "release_state", None)  # states held outside the process
        if release is not None:
            release(record.payload)


class PickleStore:
    """A pickle of ``get_state()`` (mode ``state``) or of the whole engine (mode ``engine``)."""

    name = "pickle"
    replays = False

    def __init__(self, mode: str = "auto") -> None:
        if mode not in ("auto", "state", "engine"):
            raise ValueError(f"pickle backend: mode must be auto, state or engine, not {mode!r}")
        self.mode = mode

    def _state_mode(self, engine: Engine) -> bool:
        return self.mode == "state" or (self.mode == "auto" and isinstance(engine, NativeState))

    def save(self, engine: Engine) -> tuple[Any, int]:
        obj = engine.get_state() if self._state_mode(engine) else engine  # type: ignore[attr-defined]
        blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return blob, len(blob)

    def load(self, engine: Engine, record: Record) -> Engine:
        if self._state_mode(engine):
            engine.set_state(pickle.loads(record.payload))  # type: ignore[attr-defined]
            return engine
        return pickle.loads(record.payload)

    def drop(self, engine: Engine, record: Record) -> None:
        pass


class ReplayStore:
    """No payload: restore = reset + replay of the action prefix, verified step by step."""

    name = "replay"
    replays = True

    def save(self, engine: Engine) -> tuple[Any, int]:
        return None, 0

    def load(self, engine: Engine, record: Record) -> Engine:
        snap = record.snapshot
        fast = engine.replay if isinstance(engine, FastReplay) else None
        if fast is not None:
            # one call that builds only the final observation; checked at the end, and on a
            # mismatch the step-by-step replay below names the step that diverged
            obs = fast(snap.task, snap.seed, snap.actions)
            if obs == record.observation and engine.fingerprint() == snap.fingerprint:
                return engine
        obs = replay(engine, snap.task, snap.seed, snap.actions, snap.trail, snap.fingerprint)
        if obs != record.observation:
            raise SnapshotError(
                f"replay of snapshot {snap.id} reached the recorded fingerprint but another "
                "observation; the engine's observation depends on something outside its state"
            )
        return engine

    def drop(self, engine: Engine, record: Record) -> None:
        pass


class LocalSandbox:
    """A :class:`~bpo.sandbox.protocol.Sandbox` whose engine runs in this process."""

    def __init__(self, engine: Engine, store: StateStore) -> None:
        self.backend = store.name
        self._engine = engine
        self._store = store
        self._ledger = Ledger(store.name)
        self._broken: str | None = None
        self._closed = False

    # -- episode -------------------------------------------------------------------------
    def reset(self, task: str, seed: int = 0) -> Observation:
        self._usable(need_episode=False)
        obs = self._call(lambda: self._engine.reset(task, seed), f"reset({task!r}, {seed})")
        _expect(obs, Observation, "reset")
        self._ledger.episode = Episode(task, int(seed), obs)
        self._broken = None
        return obs

    def step(self, action: str) -> StepResult:
        if not isinstance(action, str):
            raise TypeError(f"an action is text (str), got {type(action).__name__}")
        episode = self._usable()
        result = self._call(lambda: self._engine.step(action), f"step({action!r})")
        _expect(result, StepResult, "step")
        episode.record(action, result)
        return result

    def observation(self) -> Observation:
        return self._usable().observation

    def fingerprint(self) -> str:
        self._usable()
        return self._call(self._engine.fingerprint, "fingerprint()")

    def expert_action(self) -> str | None:
        self._usable()
        return self._call(self._engine.expert_action, "expert_action()")

    # -- snapshots -----------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        self._usable()
        t0 = time.perf_counter()
        try:
            payload, nbytes = self._store.save(self._engine)
            fingerprint = self._engine.fingerprint()
        except SnapshotError:
            raise
        except Exception as e:
            raise SnapshotError(f"{self.backend} snapshot failed", e) from e
        snap = self._ledger.add(fingerprint, payload, nbytes)
        self._ledger.snapshot_seconds += time.perf_counter() - t0
        return snap

    def restore(self, snapshot: Snapshot) -> Observation:
        self._usable(need_episode=False)
        record = self._ledger.get(snapshot)
        t0 = time.perf_counter()
        try:
            self._engine = self._store.load(self._engine, record)
        except Exception as e:
            self._broken = f"restore of snapshot {snapshot.id} failed ({e!r})"
            if isinstance(e, SnapshotError):
                raise
            raise SnapshotError(
                f"{self.backend} restore of snapshot {snapshot.id} failed", e
            ) from e
        self._broken = None
        obs = self._ledger.restored_to(record)
        self._ledger.replayed += self._store.replays
        self._ledger.restore_seconds += time.perf_counter() - t0
        return obs

    def release(self, snapshot: Snapshot) -> None:
        record = self._ledger.pop(snapshot)
        try:
            self._store.drop(self._engine, record)
        except Exception as e:  # the snapshot is gone either way; the engine's state is intact
            raise SnapshotError(f"releasing snapshot {snapshot.id} failed", e) from e

    def stats(self) -> SnapshotStats:
        return self._ledger.stats()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for record in self._ledger.records():
                self._ledger.pop(record.snapshot)
                self._store.drop(self._engine, record)
        finally:
            self._engine.close()

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------------------
    def _usable(self, need_episode: bool = True) -> Episode:
        if self._closed:
            raise SandboxError("the sandbox is closed")
        if self._broken and need_episode:
            raise SandboxError(
                f"the engine's state is unknown: {self._broken}; "
                "reset() or restore() a snapshot to continue"
            )
        return self._ledger.current() if need_episode else None  # type: ignore[return-value]

    def _call(self, fn: Callable[[], T], what: str) -> T:
        try:
            return fn()
        except Exception as e:
            self._broken = f"{what} raised {e!r}"
            raise SandboxError(f"the engine raised in {what}", e) from e


def _expect(value: object, kind: type, what: str) -> None:
    if not isinstance(value, kind):
        raise SandboxError(
            f"the engine's {what}() returned {type(value).__name__}, expected {kind.__name__}"
        )
