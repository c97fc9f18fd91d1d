"""Training rollouts, synchronous or ahead of the learner with bounded staleness.

Versions count updates: the weights after update ``u`` are version ``u``, and iteration ``b``
(1-based) trains on batch ``b``, making version ``b``. Synchronously (``max_staleness = 0``)
batch ``b`` is sampled with version ``b - 1``, right before its update: every comparison and the
bitwise resume use this mode. With ``max_staleness = N >= 1`` a producer thread samples the
batches in order, ahead of the learner: batch ``b`` starts once version ``b - 1 - N`` exists
and is sampled with the newest version then published, so the learner that trains on it is at
most ``N`` updates newer than the policy that sampled it. With ``N = 1`` rollouts for the next
iteration run while the learner updates on the last one (on a GPU cluster: the inference
engines sample while the learner trains).

The sampler's weights change only between batches, so a tree never mixes versions; each turn
records its version (``Turn.policy_version``). The learner's PPO ratio is taken against the
log-probs recorded at sampling time, which is the importance weight that corrects the lag.

How the sampler gets the weights is a :class:`WeightSync`: the learner's own model
(synchronous, in process), a copy of it in this process (asynchronous, in process) or the
inference engines of :class:`bpo.cluster.roles.EngineGroup`.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from bpo.cluster.routing import prefix_hit_rate
from bpo.tree import Tree

__all__ = ["Batch", "LocalCopy", "Rollouts", "SharedModel", "WeightSync", "check_versions"]


class WeightSync(Protocol):
    """The policy the training rollouts sample from, and how it receives new weights."""

    policy: Any
    needs_state: bool
    """False when the sampler is the learner's model itself (nothing to copy)."""

    def load(self, version: int, state: dict[str, torch.Tensor]) -> None: ...

    def close(self) -> None: ...


class SharedModel:
    """Synchronous, in process: the sampler is the learner's own model; after an update only
    its cached prefixes are stale, and the trainer drops them after every update (the agent's
    ``sync_policy``, which evaluation needs too), so loading is a no-op."""

    needs_state = False

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def load(self, version: int, state: dict[str, torch.Tensor]) -> None:
        pass

    def close(self) -> None:
        pass


class LocalCopy:
    """Asynchronous, in process: a frozen copy of the model samples while the learner trains
    the original; ``load`` copies the learner's weights in between batches."""

    needs_state = True

    def __init__(self, model: torch.nn.Module, make_policy: Callable[[torch.nn.Module], Any]):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.policy = make_policy(self.model)

    def load(self, version: int, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                if name in params:
                    params[name].copy_(value)
        self.policy.clear_cache()

    def close(self) -> None:
        pass


@dataclass
class Batch:
    """One iteration's trees and where they came from."""

    index: int
    """The iteration that trains on it (1-based)."""
    trees: list[Tree]
    version: int
    """The weights that sampled every turn of it."""
    seconds: float
    """Wall time of its rollouts."""
    faults: dict[str, int]
    draw_state: Any
    """The task sampler's state before this batch drew its tasks (for checkpoints)."""
    prefix_hit_rate: float
    """Share of the context tokens the sampler's prefix caches served."""


class Rollouts:
    """Produces the batches of iterations ``start + 1 .. last`` (see the module docstring).

    ``draw()`` returns the ``(task, seed)`` jobs of the next batch (it advances the task
    sampler, whose state ``draw_state()`` returns); ``engine`` is the rollout engine whose
    policy is ``sync.policy``. ``publish(version, state)`` hands the learner's new weights over
    (copied); ``next()`` returns the next batch in order."""

    def __init__(self, engine: Any, sync: WeightSync, draw: Callable[[], Sequence[tuple[str, int]]],
                 draw_state: Callable[[], Any], max_staleness: int, start: int, last: int,
                 state: dict[str, torch.Tensor]) -> None:  # fmt: skip
        self.engine, self.sync, self._draw, self._draw_state = engine, sync, draw, draw_state
        self.max_staleness, self.last = max_staleness, last
        self._next = start + 1  # the next batch to produce
        self._published = (start, _copy(state) if sync.needs_state else {})
        self._loaded = -1
        self._cond = threading.Condition()
        self._ready: dict[int, Batch] = {}
        self._error: BaseException | None = None
        self._stop = False
        self._busy = False
        self._holds = 0
        self._inflight: Any = None
        self._thread: threading.Thread | None = None
        if max_staleness > 0 and self._next <= last:
            self._thread = threading.Thread(target=self._produce, name="bpo-rollouts", daemon=True)
            self._thread.start()

    # -- learner side -------------------------------------------------------------------------
    def publish(self, version: int, state: Callable[[], dict[str, torch.Tensor]]) -> None:
        """The learner reached ``version``; ``state()`` gives its trainable weights (called,
        and copied, only when the sampler holds weights of its own)."""
        copied = _copy(state()) if self.sync.needs_state else {}
        with self._cond:
            self._published = (version, copied)
            self._cond.notify_all()

    def next(self, index: int) -> Batch:
        """Batch ``index`` (the learner is at version ``index - 1``)."""
        if self._thread is None:
            batch = self._make()
            assert batch.index == index, f"batch {batch.index} made for iteration {index}"
            return batch
        with self._cond:
            while index not in self._ready and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            return self._ready.pop(index)

    def next_draw_state(self) -> Any:
        """The task sampler's state for the first batch not yet trained on: what a checkpoint
        saves so that a resumed run draws the same tasks."""
        with self._cond:
            if self._ready:
                return self._ready[min(self._ready)].draw_state
            if self._busy:  # the batch in flight has drawn already: it is the next one
                return self._inflight
            return self._draw_state()

    def paused(self) -> _Paused:
        """``with rollouts.paused():`` no batch is being sampled inside (for evaluation, which
        uses sandboxes and a policy of its own, but a sandbox engine may not be thread-safe)."""
        return _Paused(self)

    def close(self) -> None:
        """Stop producing (the batch in flight finishes first) and wait for the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- producer side ------------------------------------------------------------------------
    def _produce(self) -> None:
        try:
            while True:
                with self._cond:
                    b = self._next
                    # batch b waits for version b - 1 - N, and for pause() holders
                    while not self._stop and (
                        self._published[0] < b - 1 - self.max_staleness or self._holds
                    ):
                        self._cond.wait()
                    if self._stop or b > self.last:
                        return
                    self._busy = True
                    draw = self._take_draw()
                batch = self._make(draw)  # an error: the except below clears _busy
                with self._cond:  # ready and no longer busy at once (next_draw_state)
                    self._ready[b] = batch
                    self._busy = False
                    self._cond.notify_all()
        except BaseException as e:  # handed to the learner's next()
            with self._cond:
                self._error = e
                self._busy = False
                self._cond.notify_all()

    def _take_draw(self) -> tuple[int, Any, Sequence[tuple[str, int]], int, dict]:
        """Batch ``self._next``'s tasks (drawn now, in order) and the weights it samples with:
        (batch, draw state, jobs, version, weights)."""
        b = self._next
        self._next += 1
        self._inflight = self._draw_state()
        version, state = self._published
        return b, self._inflight, self._draw(), version, state

    def _make(
        self, draw: tuple[int, Any, Sequence[tuple[str, int]], int, dict] | None = None
    ) -> Batch:
        """Sample a batch (the next one when ``draw`` is None) with the newest weights."""
        b, draw_state, jobs, version, state = draw or self._take_draw()
        if version != self._loaded:
            self.sync.load(version, state)
            self._loaded = version
        self.engine.config = dataclasses.replace(self.engine.config, policy_version=version)
        before = self.sync.policy.stats()
        t0 = time.perf_counter()
        trees = self.engine.run(jobs)
        seconds = time.perf_counter() - t0
        hit = prefix_hit_rate(before, self.sync.policy.stats())
        return Batch(b, trees, version, seconds, dict(self.engine.faults), draw_state, hit)


class _Paused:
    def __init__(self, rollouts: Rollouts) -> None:
        self.r = rollouts

    def __enter__(self) -> None:
        with self.r._cond:
            self.r._holds += 1
            while self.r._busy:
                self.r._cond.wait()

    def __exit__(self, *exc: object) -> None:
        with self.r._cond:
            self.r._holds -= 1
            self.r._cond.notify_all()


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def check_versions(trees: Sequence[Tree], version: int) -> None:
    """Every turn of every tree was sampled by ``version`` (a tree never mixes versions)."""
    for tree in trees:
        found = {n.turn.policy_version for n in tree.nodes if n.turn is not None}
        if found - {version}:
            raise AssertionError(
                f"tree of task {tree.task!r} holds turns of policy versions {sorted(found)}, "
                f"expected only {version}"
            )
