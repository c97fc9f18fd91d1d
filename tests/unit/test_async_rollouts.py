"""The asynchronous rollout producer's contract (bpo.rollout.asynchronous): batches arrive in
order, each sampled by one policy version at most ``max_staleness`` updates behind the learner
that trains on it, weights change only between batches, errors reach the learner, and pause()
holds the producer. The engine here is a stand-in that records what it was asked (timings and
threads are the subject, not sampling); `bpo train run.max_staleness=1` with real parts is in
tests/integration/test_cluster.py."""

import threading
import time

import numpy as np
import pytest
import torch

from bpo.policy.protocol import PolicyStats
from bpo.rollout.asynchronous import LocalCopy, Rollouts, check_versions
from bpo.tree import Tree, Turn

ZERO = PolicyStats(*([0] * 11))


class _Policy:
    def stats(self) -> PolicyStats:
        return ZERO


class _Sync:
    """Records the version loaded before each batch."""

    needs_state = True

    def __init__(self) -> None:
        self.policy = _Policy()
        self.loaded: list[int] = []
        self.weights = None

    def load(self, version: int, state: dict) -> None:
        self.loaded.append(version)
        self.weights = state["w"].clone()

    def close(self) -> None:
        pass


class _Engine:
    def __init__(self, sync: _Sync, seconds: float = 0.01, fail_at: int = 0) -> None:
        self.sync, self.seconds, self.fail_at = sync, seconds, fail_at
        self.config = type("C", (), {})()
        self.faults: dict[str, int] = {}
        self.batches: list[tuple[int, int, float]] = []  # (policy_version, jobs, weight)
        self.active = threading.Event()

    def run(self, jobs):
        self.active.set()
        w = float(self.sync.weights[0])
        time.sleep(self.seconds)
        assert float(self.sync.weights[0]) == w  # weights never change mid-batch
        self.active.clear()
        if self.fail_at and len(self.batches) + 1 == self.fail_at:
            raise RuntimeError("sandbox host lost")
        self.batches.append((self.config.policy_version, len(jobs), w))
        return [_tree(self.config.policy_version)]


def _tree(version: int) -> Tree:
    t = Tree("t", 0)
    t.add_root((1, 2), "obs", "fp")
    turn = Turn((3,), (-0.1,), (0.5,), "a", 1.0, True, False, version, 0.0)
    t.add_child(0, turn, (), "end", "fp2")
    return t


def _learn(n: int, staleness: int, update_s: float, **kw) -> tuple[list, _Engine, _Sync]:
    import dataclasses

    sync = _Sync()
    engine = _Engine(sync, **kw)
    engine.config = dataclasses.make_dataclass("C", [("policy_version", int, 0)])()
    rng = np.random.default_rng(0)
    weights = {"w": torch.zeros(1)}
    r = Rollouts(engine, sync, lambda: [("t", int(rng.integers(9)))] * 2,
                 lambda: rng.bit_generator.state, staleness, 0, n, weights)  # fmt: skip
    seen = []
    try:
        for b in range(1, n + 1):
            # what a checkpoint taken now saves: the tasks of the next batch to train on,
            # whether it is done, in flight or not started
            expected = r.next_draw_state()
            batch = r.next(b)
            assert batch.draw_state == expected
            check_versions(batch.trees, batch.version)
            seen.append((b, batch.version, b - 1 - batch.version))
            time.sleep(update_s)  # the update
            weights = {"w": torch.full((1,), float(b))}
            r.publish(b, lambda w=weights: w)
    finally:
        r.close()
    return seen, engine, sync


def test_synchronous_batches_use_the_newest_weights() -> None:
    seen, engine, _ = _learn(4, 0, 0.0)
    assert [s for _, _, s in seen] == [0, 0, 0, 0]
    assert [v for _, v, _ in seen] == [0, 1, 2, 3]
    assert [w for _, _, w in engine.batches] == [0.0, 1.0, 2.0, 3.0]  # version v = weights v


@pytest.mark.parametrize("bound", [1, 2])
def test_staleness_never_exceeds_the_bound(bound: int) -> None:
    # rollouts faster than updates: the producer runs as far ahead as the bound lets it
    seen, engine, _ = _learn(6, bound, 0.05, seconds=0.005)
    stale = [s for _, _, s in seen]
    assert max(stale) == bound and min(stale) >= 0
    assert [b for b, _, _ in seen] == list(range(1, 7))
    # each batch's trees carry the version whose weights sampled them
    assert [w for _, _, w in engine.batches] == [float(v) for _, v, _ in seen]


def test_slow_rollouts_overlap_the_update() -> None:
    # rollouts slower than updates: with bound 1 the learner waits less than synchronously
    t0 = time.perf_counter()
    _learn(4, 0, 0.05, seconds=0.05)
    sync_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    seen, _, _ = _learn(4, 1, 0.05, seconds=0.05)
    async_s = time.perf_counter() - t0
    assert async_s < 0.85 * sync_s, (async_s, sync_s)
    assert [s for _, _, s in seen][1:] == [1, 1, 1]


def test_a_producer_error_reaches_the_learner() -> None:
    with pytest.raises(RuntimeError, match="sandbox host lost"):
        _learn(4, 1, 0.0, fail_at=3)


def test_check_versions_rejects_a_tree_of_two_versions() -> None:
    t = _tree(1)
    t.add_child(0, Turn((4,), (-0.2,), (0.5,), "b", 0.0, True, False, 2, 0.0), (), "x", "f")
    with pytest.raises(AssertionError, match=r"versions \[1, 2\]"):
        check_versions([t], 1)


def test_pause_holds_the_producer() -> None:
    import dataclasses

    sync = _Sync()
    engine = _Engine(sync, seconds=0.02)
    engine.config = dataclasses.make_dataclass("C", [("policy_version", int, 0)])()
    r = Rollouts(engine, sync, lambda: [("t", 0)], lambda: None, 3, 0, 10, {"w": torch.zeros(1)})
    try:
        with r.paused():
            assert not engine.active.is_set()
            n = len(engine.batches)
            time.sleep(0.1)
            assert len(engine.batches) == n  # nothing sampled while paused
    finally:
        r.close()


def test_local_copy_samples_with_its_own_weights() -> None:
    model = torch.nn.Linear(2, 2)
    copy = LocalCopy(model, lambda m: type("P", (), {"clear_cache": lambda self: None})())
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(copy.model.weight, model.weight)  # the learner trains the original
    copy.load(1, {k: v.detach() for k, v in model.named_parameters()})
    assert torch.equal(copy.model.weight, model.weight)
