"""The fork-server backend: the engine lives in a child process; a snapshot is a frozen
forked copy of it, and a restore forks that copy again (copy-on-write memory). Exact for any
in-process engine, C library state included, with these limits: threads of the engine do not
survive a fork, and whatever the engine shares with the outside (a connection to another
process such as a JVM, the offset of an open file) is shared by all copies, not copied.

See :mod:`bpo.sandbox.snapshots.forkserver` for the processes. One more frozen copy, taken
right after the engine is built, serves resets after a timeout or crash. Frozen copies count
against a memory budget (their private pages); the least recently used ones are evicted
beyond it and restore by replay (``SnapshotStats.evicted``/``replayed``). A ForkSandbox is
not thread-safe: use one per thread (or per asyncio task, through the Ray pool).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bpo.sandbox.protocol import (
    Engine,
    Observation,
    SandboxError,
    Snapshot,
    SnapshotError,
    SnapshotStats,
    StepResult,
)
from bpo.sandbox.snapshots import forkserver
from bpo.sandbox.snapshots.ledger import Episode, Ledger, Record
from bpo.sandbox.snapshots.procs import Channel, ChannelClosed, private_bytes

DEFAULT_MEMORY_BUDGET = 2 << 30
"""Bytes of private memory the frozen copies of one sandbox may hold (2 GiB)."""


@dataclass
class _Proc:
    """An engine-side process and this process's channel to it."""

    pid: int
    chan: Channel
    rss: int = 0
    """Resident memory of the engine when this frozen copy was taken (an upper bound of what
    the copy can come to hold privately)."""

    def close(self) -> None:
        """Close the channel: the process exits on end-of-file."""
        self.chan.close()


class ForkSandbox:
    """A :class:`~bpo.sandbox.protocol.Sandbox` over a fork server.

    ``step_timeout`` (seconds) kills an engine process whose step takes longer and raises
    :class:`SandboxError`; ``memory_budget`` (bytes, None for no limit) bounds the private
    memory of live frozen copies; ``start_timeout`` bounds building the engine.
    """

    backend = "fork"

    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        *,
        step_timeout: float | None = None,
        memory_budget: int | None = DEFAULT_MEMORY_BUDGET,
        start_timeout: float | None = 600.0,
    ) -> None:
        if step_timeout is not None and step_timeout <= 0:
            raise ValueError(f"step_timeout must be positive seconds, got {step_timeout}")
        self.step_timeout = step_timeout
        self.memory_budget = memory_budget
        self._ledger = Ledger(self.backend)
        self._owner_pid = os.getpid()  # copies of this object in forked children never act
        self._closed = False
        self._broken: str | None = None
        self._active: _Proc | None = None
        self._pristine: _Proc | None = None
        self._server = forkserver.start(engine_factory)
        try:
            pid = self._answer(self._server.first, "building the engine", start_timeout)
            self._active = _Proc(pid, self._server.first)
            # a frozen copy of the engine as built, before any reset: the source of fresh
            # engine processes after a timeout, a crash, or for replays
            self._pristine = self._freeze(fingerprint=False)[0]
        except BaseException:
            self.close()
            raise

    # -- episode -------------------------------------------------------------------------
    def reset(self, task: str, seed: int = 0) -> Observation:
        self._check_open()
        if self._active is None or self._broken:  # start over from the engine as built
            self._activate(self._pristine)  # type: ignore[arg-type]
        obs = self._call(("reset", task, seed), f"reset({task!r}, {seed})")
        _expect(obs, Observation, "reset")
        self._ledger.episode = Episode(task, int(seed), obs)
        self._broken = None
        return obs

    def step(self, action: str) -> StepResult:
        if not isinstance(action, str):
            raise TypeError(f"an action is text (str), got {type(action).__name__}")
        episode = self._usable()
        result = self._call(("step", action), f"step({action!r})", self.step_timeout)
        _expect(result, StepResult, "step")
        episode.record(action, result)
        return result

    def observation(self) -> Observation:
        return self._usable().observation

    def fingerprint(self) -> str:
        self._usable()
        return self._call(("fingerprint",), "fingerprint()")

    def expert_action(self) -> str | None:
        self._usable()
        return self._call(("expert",), "expert_action()")

    @property
    def engine_pid(self) -> int | None:
        """The pid of the active engine process (None after a timeout or crash)."""
        return self._active.pid if self._active else None

    @property
    def server_pid(self) -> int:
        """The pid of the fork server (the subreaper parent of every engine process)."""
        return self._server.pid

    # -- snapshots -----------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        self._usable()
        t0 = time.perf_counter()
        frozen, fingerprint = self._freeze()
        snap = self._ledger.add(fingerprint, frozen, 0)
        self._enforce_budget(keep=snap.id)
        self._ledger.snapshot_seconds += time.perf_counter() - t0
        return snap

    def restore(self, snapshot: Snapshot) -> Observation:
        self._check_open()
        record = self._ledger.get(snapshot)
        t0 = time.perf_counter()
        if record.payload is not None:
            try:
                self._activate(record.payload)
            except SnapshotError:  # its frozen copy died: fall back to replay
                self._evict(record)
        if record.payload is None:
            self._replay(record)
        self._broken = None
        obs = self._ledger.restored_to(record)
        self._ledger.restore_seconds += time.perf_counter() - t0
        return obs

    def release(self, snapshot: Snapshot) -> None:
        record = self._ledger.pop(snapshot)
        if record.payload is not None:
            record.payload.close()

    def stats(self) -> SnapshotStats:
        held = sum(private_bytes(r.payload.pid) for r in self._ledger.records() if r.payload)
        return self._ledger.stats(live_bytes=held)

    def frozen_pids(self) -> list[int]:
        """Pids of the live frozen copies (snapshots not evicted), oldest use first."""
        return [r.payload.pid for r in self._ledger.records() if r.payload is not None]

    def close(self) -> None:
        """Kill and reap every process of this sandbox (engine, frozen copies, server)."""
        if self._closed or os.getpid() != self._owner_pid:
            return
        self._closed = True
        procs = [r.payload for r in self._ledger.records() if r.payload is not None]
        for proc in [*procs, self._pristine, self._active]:
            if proc is not None:
                proc.close()
        self._active = self._pristine = None
        self._server.shutdown()

    def __enter__(self) -> ForkSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close()

    # -- processes -----------------------------------------------------------------------
    def _freeze(self, fingerprint: bool = True) -> tuple[_Proc, str]:
        """Ask the active engine process to fork a frozen copy of itself."""
        chan, far = Channel.pair()
        try:
            pid, fp, rss = self._call(("snapshot", fingerprint), "snapshot()", fds=(far.fileno(),))
        except BaseException:
            chan.close()
            raise
        finally:
            far.close()
        return _Proc(pid, chan, rss), fp

    def _activate(self, frozen: _Proc) -> None:
        """Make a fresh fork of ``frozen`` the active engine process; end the old one."""
        chan, far = Channel.pair()
        try:
            frozen.chan.send(("fork",), fds=(far.fileno(),))
            pid = self._answer(frozen.chan, "forking a frozen copy", 60.0)
        except (ChannelClosed, SandboxError) as e:
            chan.close()
            raise SnapshotError(f"the frozen process {frozen.pid} is gone", e) from e
        finally:
            far.close()
        if self._active is not None:
            self._active.close()
        self._active = _Proc(pid, chan)

    def _replay(self, record: Record) -> None:
        if self._active is None:
            self._activate(self._pristine)  # type: ignore[arg-type]
        snap = record.snapshot
        self._call(
            ("replay", snap.task, snap.seed, snap.actions, snap.trail, snap.fingerprint),
            f"replay of snapshot {snap.id}",
        )
        self._ledger.replayed += 1

    def _evict(self, record: Record) -> None:
        record.payload.close()
        record.payload = None
        self._ledger.evicted += 1

    def _enforce_budget(self, keep: int) -> None:
        """Evict least recently used frozen copies until their private memory fits."""
        if self.memory_budget is None:
            return
        frozen = [r for r in self._ledger.records() if r.payload is not None]
        if sum(r.payload.rss for r in frozen) <= self.memory_budget:
            return  # cheap upper bound: nothing to measure
        sizes = {r.snapshot.id: private_bytes(r.payload.pid) for r in frozen}
        total = sum(sizes.values())
        for r in frozen:  # least recently used first
            if total <= self.memory_budget:
                break
            if r.snapshot.id != keep:
                total -= sizes[r.snapshot.id]
                self._evict(r)

    def _call(
        self,
        msg: tuple[Any, ...],
        what: str,
        timeout: float | None = None,
        fds: tuple[int, ...] = (),
    ) -> Any:
        if self._active is None:
            raise SandboxError(
                f"{what}: no engine process (after a timeout or crash); "
                "reset() or restore() a snapshot to continue"
            )
        try:
            self._active.chan.send(msg, fds=fds)
        except ChannelClosed as e:
            self._lost(f"{what} found the engine process {self._active.pid} gone")
            raise SandboxError(f"{what}: the engine process died earlier", e) from e
        return self._answer(self._active.chan, what, timeout, active=True)

    def _answer(self, chan: Channel, what: str, timeout: float | None, active: bool = False) -> Any:
        try:
            msg, _ = chan.recv(timeout)
        except TimeoutError:
            if not active:
                raise SandboxError(f"{what} timed out after {timeout} s") from None
            os.kill(self._active.pid, signal.SIGKILL)  # type: ignore[union-attr]
            self._lost(f"{what} timed out")
            raise SandboxError(
                f"{what} timed out after {timeout} s; the engine process was killed. "
                "reset() or restore() a snapshot to continue"
            ) from None
        except ChannelClosed as e:
            if active:
                self._lost(f"{what} ended the engine process")
            raise SandboxError(
                f"the engine process died during {what} (killed by a signal or "
                "crashed in native code)",
                e,
            ) from e
        if msg[0] == "ok":
            return msg[1]
        _, text, blob, trace = msg
        if active:
            self._broken = f"{what} raised {text}"
        cause = _unpickle(blob) or RuntimeError(f"{text}\n{trace}")
        if isinstance(cause, SnapshotError):
            raise cause
        raise SandboxError(f"the engine raised in {what}", cause) from cause

    def _lost(self, reason: str) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None
        self._broken = reason

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the sandbox is closed")

    def _usable(self) -> Episode:
        self._check_open()
        if self._broken:
            raise SandboxError(
                f"the engine's state is unknown: {self._broken}; "
                "reset() or restore() a snapshot to continue"
            )
        return self._ledger.current()


def _unpickle(blob: bytes | None) -> BaseException | None:
    if blob is None:
        return None
    try:
        value = pickle.loads(blob)
    except Exception:
        return None
    return value if isinstance(value, BaseException) else None


def _expect(value: object, kind: type, what: str) -> None:
    if not isinstance(value, kind):
        raise SandboxError(
            f"the engine's {what}() returned {type(value).__name__}, expected {kind.__name__}"
        )
