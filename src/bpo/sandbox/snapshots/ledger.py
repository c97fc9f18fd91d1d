"""Bookkeeping every sandbox shares, whatever its backend: the current episode (task, seed,
action prefix, per-step digests, observation), the live snapshots and their counters.

A backend stores its payload (an engine state, a pickle, a frozen process) in the ledger's
record; the ledger decides whether a handle may be restored (not released, not foreign) and
keeps :class:`~bpo.sandbox.protocol.SnapshotStats`.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from bpo.sandbox.protocol import (
    Observation,
    SandboxError,
    Snapshot,
    SnapshotError,
    SnapshotStats,
    StepResult,
)


def step_digest(result: StepResult) -> str:
    """A short digest of one step's outcome (what a replay must reproduce exactly)."""
    obs = result.observation
    text = repr(
        (obs.text, obs.admissible, obs.done, result.reward, result.terminated, result.truncated)
    )
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def approx_nbytes(obj: Any, samples: int = 32, budget: int = 2000) -> int:
    """Approximate memory of a Python value, cheaply: ``sys.getsizeof`` of the object plus,
    for containers, the size of up to ``samples`` elements scaled to the container's length
    (so a list of a million tuples costs microseconds); at most ``budget`` objects visited."""
    seen: set[int] = set()
    visits = [budget]

    def size(x: Any) -> float:
        if id(x) in seen or visits[0] <= 0:
            return 0.0
        seen.add(id(x))
        visits[0] -= 1
        total = float(sys.getsizeof(x, 64))
        if isinstance(x, (str, bytes, bytearray, int, float, bool)) or x is None:
            return total
        if isinstance(x, dict):
            n, items = len(x), [v for kv in itertools.islice(x.items(), samples) for v in kv]
        elif isinstance(x, (list, tuple)):
            n, stride = len(x), max(1, len(x) // samples)
            items = list(x[::stride][:samples])
        elif isinstance(x, (set, frozenset)):
            n, items = len(x), list(itertools.islice(x, samples))
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            return total + size(vars(x))
        else:
            return total
        per_item = 2 if isinstance(x, dict) else 1
        shown = max(len(items) // per_item, 1)
        return total + sum(size(i) for i in items) * (n / shown if n > shown else 1)

    return int(size(obj))


@dataclass
class Episode:
    """Where the sandbox is: the task, seed, actions since reset and their digests."""

    task: str
    seed: int
    observation: Observation
    actions: list[str] = field(default_factory=list)
    trail: list[str] = field(default_factory=list)

    def record(self, action: str, result: StepResult) -> None:
        self.actions.append(action)
        self.trail.append(step_digest(result))
        self.observation = result.observation


@dataclass
class Record:
    """A live snapshot: the handle, what the agent saw there, and the backend's payload."""

    snapshot: Snapshot
    observation: Observation
    payload: Any
    nbytes: int


_OWNERS = itertools.count(1)


class Ledger:
    """Live snapshots of one sandbox, in least-recently-used order, and their counters."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        # random high bits: tokens stay distinct across processes (Ray actors) and sandboxes
        self.owner = (secrets.randbits(31) << 32) | next(_OWNERS)
        self.episode: Episode | None = None
        self._ids = itertools.count(1)
        self._live: OrderedDict[int, Record] = OrderedDict()
        self._released: set[int] = set()
        self.taken = self.restored = self.evicted = self.replayed = 0
        self.snapshot_seconds = self.restore_seconds = 0.0

    # -- the episode ---------------------------------------------------------------------
    def current(self) -> Episode:
        if self.episode is None:
            raise SandboxError("no episode yet: call reset(task, seed) first")
        return self.episode

    # -- snapshots -----------------------------------------------------------------------
    def add(self, fingerprint: str, payload: Any, nbytes: int) -> Snapshot:
        """Register a snapshot of the current state, holding ``payload``."""
        ep = self.current()
        snap = Snapshot(
            id=next(self._ids),
            owner=self.owner,
            backend=self.backend,
            step=len(ep.actions),
            task=ep.task,
            seed=ep.seed,
            actions=tuple(ep.actions),
            fingerprint=fingerprint,
            nbytes=nbytes,
            trail=tuple(ep.trail),
        )
        self._live[snap.id] = Record(snap, ep.observation, payload, nbytes)
        self.taken += 1
        return snap

    def get(self, snapshot: Snapshot) -> Record:
        """The live record of ``snapshot``; SnapshotError if it is foreign or released."""
        if not isinstance(snapshot, Snapshot):
            raise SnapshotError(f"expected a Snapshot, got {type(snapshot).__name__}")
        if snapshot.owner != self.owner:
            raise SnapshotError(
                f"snapshot {snapshot.id} belongs to another sandbox (owner {snapshot.owner}, "
                f"this one is {self.owner}); restore it in the sandbox that took it, or "
                "rebuild it here by replay: bpo.sandbox.snapshots.replay.rebuild(sandbox, snap)"
            )
        if snapshot.id in self._released:
            raise SnapshotError(f"snapshot {snapshot.id} was released; it cannot be restored")
        record = self._live.get(snapshot.id)
        if record is None or record.snapshot != snapshot:
            raise SnapshotError(f"snapshot {snapshot.id} is unknown to this sandbox")
        self._live.move_to_end(snapshot.id)  # most recently used
        return record

    def restored_to(self, record: Record) -> Observation:
        """Make ``record``'s state the current episode; returns its observation."""
        snap = record.snapshot
        self.episode = Episode(
            snap.task, snap.seed, record.observation, list(snap.actions), list(snap.trail)
        )
        self.restored += 1
        return record.observation

    def pop(self, snapshot: Snapshot) -> Record:
        """Forget ``snapshot`` (explicit release); returns its record for the backend."""
        if (
            isinstance(snapshot, Snapshot)
            and snapshot.owner == self.owner
            and (snapshot.id in self._released)
        ):
            raise SnapshotError(f"snapshot {snapshot.id} was already released")
        record = self.get(snapshot)
        del self._live[snapshot.id]
        self._released.add(snapshot.id)
        return record

    def records(self) -> list[Record]:
        """Live records, least recently used first."""
        return list(self._live.values())

    def stats(self, live_bytes: int | None = None) -> SnapshotStats:
        return SnapshotStats(
            live=len(self._live),
            live_bytes=sum(r.nbytes for r in self._live.values())
            if live_bytes is None
            else live_bytes,
            taken=self.taken,
            restored=self.restored,
            snapshot_seconds=self.snapshot_seconds,
            restore_seconds=self.restore_seconds,
            evicted=self.evicted,
            replayed=self.replayed,
        )
