"""Sandboxes in Ray actors: :class:`SandboxPool` spreads episodes over ``num_actors`` actors,
each hosting the sandboxes of the episodes it was given.

Each episode gets a :class:`PoolSandbox` that implements the
:class:`~bpo.sandbox.protocol.Sandbox` protocol synchronously, offers the same operations as
coroutines (``areset``, ``astep``, ``asnapshot``, ``arestore``, ...) for asyncio rollout
engines, and :meth:`SandboxPool.step_many` / :meth:`SandboxPool.reset_many` batch one call
per episode into one round of Ray calls. Snapshots stay in the actor that took them and
restores go there; when that actor is gone (died, killed) the restore rebuilds the state by
replay (``Snapshot.actions``, verified) on another actor, and the pool replaces the actor.

It needs ``ray.init(...)`` first (locally: set ``object_store_memory``, see MACHINE.md; on a
cluster: ``ray.init(address=...)`` with ``bpo`` installed on the workers); nothing else
changes. Every operation is written once, as a generator that yields Ray ObjectRefs and
receives their values, and driven synchronously, asynchronously or in batches.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError

from bpo.sandbox.protocol import (
    Observation,
    SandboxError,
    Snapshot,
    SnapshotError,
    SnapshotStats,
    StepResult,
)
from bpo.sandbox.snapshots.replay import rebuild

Op = Generator[Any, Any, Any]  # yields ObjectRefs, is sent their values, returns a result


class _SandboxHost:
    """The actor: sandboxes by id. Errors come back as values, never as Ray task errors."""

    def __init__(self, env: str, backend: str, options: dict[str, Any]) -> None:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.env, self.backend, self.options = env, backend, options
        self.sandboxes: dict[int, Any] = {}
        self.next_id = 0

    def open(self) -> tuple[str, Any]:
        from bpo.sandbox import make_env

        try:
            sb = make_env(self.env, self.backend, **self.options)
        except Exception as e:
            return "err", e
        self.next_id += 1
        self.sandboxes[self.next_id] = sb
        return "ok", (self.next_id, str(getattr(sb, "backend", self.backend)), os.getpid())

    def call(self, sid: int, method: str, *args: Any) -> tuple[str, Any]:
        """``sandbox.method(*args)``; ``rebuild`` replays a snapshot (any sandbox's) here."""
        try:
            sb = self.sandboxes[sid]
            fn = functools.partial(rebuild, sb) if method == "rebuild" else getattr(sb, method)
            return "ok", fn(*args)
        except Exception as e:
            return "err", e

    def close(self, sid: int) -> None:
        sb = self.sandboxes.pop(sid, None)
        if sb is not None:
            sb.close()

    def where(self) -> dict[str, Any]:
        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


SandboxHost = ray.remote(_SandboxHost)


def _value(envelope: tuple[str, Any]) -> Any:
    if envelope[0] == "err":
        raise envelope[1]
    return envelope[1]


def run_sync(op: Op) -> Any:
    """Drive an operation with blocking ``ray.get``."""
    return run_many([op])[0]


async def run_async(op: Op) -> Any:
    """Drive an operation by awaiting its ObjectRefs (asyncio)."""
    try:
        ref = next(op)
        while True:
            try:
                value = await ref
            except Exception as e:
                ref = op.throw(e)
            else:
                ref = op.send(value)
    except StopIteration as stop:
        return stop.value


def run_many(ops: Sequence[Op]) -> list[Any]:
    """Drive several operations together: each round has one call per operation in flight.
    The first exception of an operation is raised after every operation has finished."""
    results: list[Any] = [None] * len(ops)
    errors: list[Exception] = []
    moves: dict[int, Callable[[], Any]] = {i: op.__next__ for i, op in enumerate(ops)}
    while moves:
        pending = {}
        for i, move in moves.items():  # submit this round's calls
            try:
                pending[i] = move()
            except StopIteration as stop:
                results[i] = stop.value
            except Exception as e:
                errors.append(e)
        moves = {}
        for i, ref in pending.items():
            try:
                moves[i] = functools.partial(ops[i].send, ray.get(ref))
            except Exception as e:
                moves[i] = functools.partial(ops[i].throw, e)
    if errors:
        raise errors[0]
    return results


class SandboxPool:
    """``num_actors`` Ray actors hosting sandboxes of environment ``env``."""

    def __init__(
        self,
        env: str,
        num_actors: int,
        *,
        env_options: dict[str, Any] | None = None,
        backend: str = "auto",
        num_cpus_per_actor: float = 0.5,
        memory_per_actor: int | None = None,
        actor_options: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        """``actor_options``: Ray ``.options(...)`` of each actor (e.g. a placement-group
        scheduling strategy, from :mod:`bpo.cluster.roles`), replacing the resources given by
        ``num_cpus_per_actor`` and ``memory_per_actor``; a replaced actor gets its
        predecessor's."""
        if not ray.is_initialized():
            raise SandboxError(
                "SandboxPool needs Ray: call ray.init(...) first (on one machine "
                "set num_cpus and object_store_memory; see MACHINE.md)"
            )
        if num_actors < 1:
            raise ValueError(f"num_actors must be at least 1, got {num_actors}")
        from bpo.sandbox import env_spec

        env_spec(env)  # unknown names fail here, listing the valid ones
        self.env, self.backend, self.env_options = env, backend, dict(env_options or {})
        memory = {} if memory_per_actor is None else {"memory": memory_per_actor}
        resources: dict[str, Any] = {"num_cpus": num_cpus_per_actor, **memory}
        if actor_options is not None and len(actor_options) != num_actors:
            raise ValueError(f"actor_options has {len(actor_options)} entries for {num_actors} "
                             "actors")  # fmt: skip
        self._options = list(actor_options or [resources] * num_actors)
        self.actors = [self._new_actor(i) for i in range(num_actors)]
        self._episodes: dict[Any, int] = {}  # actor -> open episodes
        self.replaced = 0

    def _new_actor(self, index: int) -> Any:
        return SandboxHost.options(**self._options[index]).remote(
            self.env, self.backend, self.env_options
        )

    def open(self) -> PoolSandbox:
        """A new episode handle (a sandbox in the least loaded actor)."""
        sb = PoolSandbox(self)
        run_sync(sb._place())
        return sb

    async def aopen(self) -> PoolSandbox:
        sb = PoolSandbox(self)
        await run_async(sb._place())
        return sb

    def step_many(
        self, sandboxes: Sequence[PoolSandbox], actions: Sequence[str]
    ) -> list[StepResult]:
        """One step in each sandbox, the calls in flight together."""
        return run_many([sb._step(a) for sb, a in zip(sandboxes, actions, strict=True)])

    def reset_many(
        self, sandboxes: Sequence[PoolSandbox], tasks: Sequence[str], seeds: Sequence[int]
    ) -> list[Observation]:
        return run_many([sb._reset(t, s) for sb, t, s in zip(sandboxes, tasks, seeds, strict=True)])

    def where(self) -> list[dict[str, Any]]:
        """The node and process of each actor."""
        return ray.get([a.where.remote() for a in self.actors])

    def close(self) -> None:
        """Kill every actor (their sandboxes and snapshots go with them)."""
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- used by PoolSandbox ---------------------------------------------------------------
    def _least_loaded(self, avoid: Any = None) -> Any:
        live = [a for a in self.actors if a != avoid] or self.actors
        return min(live, key=lambda a: self._episodes.get(a, 0))

    def _gone(self, actor: Any) -> None:
        """``actor`` died (or is unreachable): replace it in the pool (once)."""
        self._episodes.pop(actor, None)
        for i, a in enumerate(self.actors):
            if a == actor:
                ray.kill(actor)  # an unreachable actor must not linger with its sandboxes
                self.actors[i] = self._new_actor(i)
                self.replaced += 1


class PoolSandbox:
    """One episode's sandbox in a :class:`SandboxPool` (the Sandbox protocol, sync and async)."""

    def __init__(self, pool: SandboxPool) -> None:
        self.pool = pool
        self.backend = f"ray:{pool.backend}"
        self.actor: Any = None
        self.actor_pid = 0
        self._sid = 0
        self._obs: Observation | None = None
        self._snaps: dict[tuple[int, int], tuple[Any, Snapshot]] = {}
        self._released: set[tuple[int, int]] = set()
        self.taken = self.restored = self.replayed = 0
        self.snapshot_seconds = self.restore_seconds = 0.0
        self._closed = False

    # -- operations, each written once ------------------------------------------------------
    def _place(self, avoid: Any = None) -> Op:
        actor = self.pool._least_loaded(avoid)
        sid, backend, pid = _value((yield actor.open.remote()))
        self.actor, self._sid, self.actor_pid = actor, sid, pid
        self.backend = f"ray:{backend}"
        self.pool._episodes[actor] = self.pool._episodes.get(actor, 0) + 1

    def _call(self, method: str, *args: Any) -> Op:
        if self._closed:
            raise SandboxError("the sandbox is closed")
        try:
            return _value((yield self.actor.call.remote(self._sid, method, *args)))
        except RayActorError as e:
            dead = self.actor
            self.pool._gone(dead)
            if method == "reset":  # nothing to lose: start over on another actor
                yield from self._place(avoid=dead)
                return _value((yield self.actor.call.remote(self._sid, method, *args)))
            raise SandboxError(
                f"the Ray actor holding this sandbox died during {method}(); "
                "restore() a snapshot (it replays on another actor) or "
                "reset()",
                e,
            ) from e

    def _reset(self, task: str, seed: int = 0) -> Op:
        self._obs = yield from self._call("reset", task, seed)
        return self._obs

    def _step(self, action: str) -> Op:
        result = yield from self._call("step", action)
        self._obs = result.observation
        return result

    def _snapshot(self) -> Op:
        t0 = time.perf_counter()
        snap = yield from self._call("snapshot")
        self._snaps[snap.owner, snap.id] = (self.actor, snap)
        self.taken += 1
        self.snapshot_seconds += time.perf_counter() - t0
        return snap

    def _restore(self, snapshot: Snapshot) -> Op:
        actor, snap = self._record(snapshot)
        t0 = time.perf_counter()
        here = actor == self.actor  # else taken in an actor this episode has since left
        if here:
            try:
                self._obs = _value((yield self.actor.call.remote(self._sid, "restore", snap)))
            except RayActorError:
                self.pool._gone(actor)
                yield from self._place(avoid=actor)
                here = False
        if not here:  # the actor holding the snapshot is gone: replay it on this one
            self._obs = _value((yield self.actor.call.remote(self._sid, "rebuild", snap)))
            self.replayed += 1
        self.restored += 1
        self.restore_seconds += time.perf_counter() - t0
        return self._obs

    def _release(self, snapshot: Snapshot) -> Op:
        actor, snap = self._record(snapshot)
        del self._snaps[snap.owner, snap.id]
        self._released.add((snap.owner, snap.id))
        if actor == self.actor:
            with contextlib.suppress(RayActorError):  # else gone with its snapshots already
                _value((yield actor.call.remote(self._sid, "release", snap)))

    def _record(self, snapshot: Snapshot) -> tuple[Any, Snapshot]:
        key = (snapshot.owner, snapshot.id)
        if key in self._released:
            raise SnapshotError(
                f"snapshot {snapshot.id} was released; it cannot be restored or released again"
            )
        if key not in self._snaps:
            raise SnapshotError(
                f"snapshot {snapshot.id} belongs to another sandbox; rebuild "
                "it here by replay with PoolSandbox.rebuild(snapshot)"
            )
        return self._snaps[key]

    def _rebuild(self, snapshot: Snapshot) -> Op:
        self._obs = _value((yield self.actor.call.remote(self._sid, "rebuild", snapshot)))
        return self._obs

    # -- the Sandbox protocol (blocking) ---------------------------------------------------
    def reset(self, task: str, seed: int = 0) -> Observation:
        return run_sync(self._reset(task, seed))

    def step(self, action: str) -> StepResult:
        return run_sync(self._step(action))

    def snapshot(self) -> Snapshot:
        return run_sync(self._snapshot())

    def restore(self, snapshot: Snapshot) -> Observation:
        return run_sync(self._restore(snapshot))

    def release(self, snapshot: Snapshot) -> None:
        run_sync(self._release(snapshot))

    def rebuild(self, snapshot: Snapshot) -> Observation:
        """Bring this sandbox to any snapshot's state (another episode's too) by replay."""
        return run_sync(self._rebuild(snapshot))

    def fingerprint(self) -> str:
        return run_sync(self._call("fingerprint"))

    def expert_action(self) -> str | None:
        return run_sync(self._call("expert_action"))

    def observation(self) -> Observation:
        if self._obs is None:
            raise SandboxError("no episode yet: call reset(task, seed) first")
        return self._obs

    def stats(self) -> SnapshotStats:
        try:
            live_bytes = run_sync(self._call("stats")).live_bytes
        except SandboxError:
            live_bytes = 0
        return SnapshotStats(
            len(self._snaps),
            live_bytes if self._snaps else 0,
            self.taken,
            self.restored,
            self.snapshot_seconds,
            self.restore_seconds,
            replayed=self.replayed,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.pool._episodes[self.actor] = self.pool._episodes.get(self.actor, 1) - 1
        with contextlib.suppress(RayActorError):
            ray.get(self.actor.close.remote(self._sid))

    def __enter__(self) -> PoolSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the same, as coroutines -------------------------------------------------------------
    async def areset(self, task: str, seed: int = 0) -> Observation:
        return await run_async(self._reset(task, seed))

    async def astep(self, action: str) -> StepResult:
        return await run_async(self._step(action))

    async def asnapshot(self) -> Snapshot:
        return await run_async(self._snapshot())

    async def arestore(self, snapshot: Snapshot) -> Observation:
        return await run_async(self._restore(snapshot))

    async def arelease(self, snapshot: Snapshot) -> None:
        await run_async(self._release(snapshot))

    async def afingerprint(self) -> str:
        return await run_async(self._call("fingerprint"))

    async def aexpert_action(self) -> str | None:
        return await run_async(self._call("expert_action"))
