"""Fault handling in the rollout engine, with faults injected into a real sandbox (the toy
game, native snapshots) under a real tiny transformers policy: a step that raises, a malformed
result, a restore that fails, a sandbox that dies for good, a policy backend that fails
mid-batch. Every returned tree is whole (no partial path), no snapshot leaks, faults are
counted, and a batch whose faults pass the bound stops with a clear error."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import random
from typing import ClassVar

import pytest
import torch

from bpo.branching import make_rule
from bpo.policy.hf import HFPolicy
from bpo.policy.models import init_model
from bpo.policy.parsing import parse_action
from bpo.policy.prompts import PromptBuilder
from bpo.policy.protocol import SamplingParams
from bpo.rollout import Budget, RolloutConfig, RolloutEngine, RolloutError
from bpo.sandbox import make_env
from bpo.sandbox.protocol import SandboxError

TASKS = [(f"keydoor-{i}", i) for i in range(1, 7)]


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = init_model(tmp_path_factory.mktemp("m"), hidden=64, layers=2, tokenizer="byte", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    return HFPolicy(model, tok, seed=0), PromptBuilder(tok, max_admissible=8)


class Faulty:
    """A real sandbox with faults injected at random (seeded): ``step`` raises or returns a
    malformed result, ``restore`` fails; after ``die_after`` steps every call fails."""

    made: ClassVar[list[Faulty]] = []

    def __init__(self, rng: random.Random, p_step=0.0, p_bad=0.0, p_restore=0.0, die_after=None):
        self.inner = make_env("toy")
        self.rng, self.p_step, self.p_bad, self.p_restore = rng, p_step, p_bad, p_restore
        self.die_after, self.steps, self.dead = die_after, 0, False
        Faulty.made.append(self)

    def _alive(self) -> None:
        if self.dead:
            raise SandboxError("injected: the sandbox is dead")

    def reset(self, task, seed):
        self._alive()
        return self.inner.reset(task, seed)

    def step(self, action):
        self._alive()
        self.steps += 1
        if self.die_after is not None and self.steps >= self.die_after:
            self.dead = True
            raise SandboxError("injected: the sandbox died")
        if self.rng.random() < self.p_step:
            raise SandboxError("injected: step failed")
        res = self.inner.step(action)
        return None if self.rng.random() < self.p_bad else res

    def snapshot(self):
        self._alive()
        return self.inner.snapshot()

    def restore(self, snap):
        self._alive()
        if self.rng.random() < self.p_restore:
            raise SandboxError("injected: restore failed")
        return self.inner.restore(snap)

    def release(self, snap):
        self.inner.release(snap)

    def fingerprint(self):
        return self.inner.fingerprint()

    def stats(self):
        return self.inner.stats()

    def close(self):
        self.inner.close()


class FlakyPolicy:
    """Fails every ``every``-th call (a backend dying mid-batch), else delegates."""

    def __init__(self, inner, every):
        self.inner, self.every, self.calls = inner, every, 0

    def sample(self, contexts, n=1, params=None):
        self.calls += 1
        if self.calls % self.every == 0:
            raise RuntimeError("injected: the policy backend failed")
        return self.inner.sample(contexts, n, params)


def _engine(agent, factory, policy=None, rule=None, retries=2, frac=0.5):
    base, prompter = agent
    cfg = RolloutConfig(root_width=2, max_steps=6, budget=Budget("tokens", 300), concurrency=3,
                        max_retries=retries, max_fault_frac=frac)  # fmt: skip
    return RolloutEngine(
        policy or base, prompter, lambda raw, adm: parse_action(raw, adm).text,
        rule or make_rule("every", k=2, max_branches=2), factory, cfg,
        SamplingParams(max_new_tokens=12, temperature=1.0),
    )  # fmt: skip


def _whole(trees) -> None:
    for t in trees:
        assert t.meta["live_snapshots_after"] == 0
        assert all(t.nodes[leaf].terminal for leaf in t.leaves()), "a partial path survived"
        c = t.meta["compute"]
        assert c.leaves == len(t.leaves())
        for node in t.nodes:
            assert len(node.children) <= max(node.branch_k, 1)


def test_random_step_faults_are_retried_and_trees_stay_whole(agent):
    rng = random.Random(0)
    Faulty.made.clear()
    eng = _engine(agent, lambda: Faulty(rng, p_step=0.08, p_bad=0.04, p_restore=0.1))
    try:
        trees = eng.run(TASKS)
    finally:
        eng.close()
    assert eng.faults["retries"] > 0
    assert len(trees) + eng.faults["failed_trees"] == len(TASKS)
    _whole(trees)
    assert sum(t.meta["compute"].retries for t in trees) <= eng.faults["retries"]
    assert all(f.inner.stats().live == 0 for f in Faulty.made)


def test_a_sandbox_that_dies_is_replaced_and_its_tree_keeps_its_complete_rollouts(agent):
    rng = random.Random(1)
    Faulty.made.clear()
    first = {"done": False}

    def factory():
        die = None if first["done"] else 9  # the first sandbox dies at its 9th step
        first["done"] = True
        return Faulty(rng, die_after=die)

    eng = _engine(agent, factory)
    try:
        trees = eng.run(TASKS[:3])
    finally:
        eng.close()
    assert eng.faults["replaced_sandboxes"] >= 1
    assert Faulty.made[0].dead
    _whole(trees)
    # kept with its complete rollouts, or (none complete) started over in a fresh sandbox
    assert len(trees) == 3 and eng.faults["failed_trees"] == 0


def test_policy_failures_are_retried_then_stop_the_batch(agent):
    base, _ = agent
    eng = _engine(agent, lambda: make_env("toy"), policy=FlakyPolicy(base, every=3))
    try:
        trees = eng.run(TASKS[:2])
        assert len(trees) == 2 and eng.faults["policy_retries"] > 0
        _whole(trees)
        eng.policy = FlakyPolicy(base, every=1)  # never answers
        with pytest.raises(RolloutError, match="the policy failed 3 times in a row"):
            eng.run(TASKS[:2])
        assert all(sb.stats().live == 0 for sb in eng._sandboxes), "the aborted trees leaked"
    finally:
        eng.close()


def test_too_many_faults_stop_the_batch_with_the_cause(agent):
    rng = random.Random(2)
    eng = _engine(agent, lambda: Faulty(rng, p_step=0.9), retries=1, frac=0.25)
    try:
        with pytest.raises(RolloutError, match=r"lost to sandbox faults.*max_fault_frac=0\.25"):
            eng.run(TASKS)
        assert all(sb.stats().live == 0 for sb in eng._sandboxes)
    finally:
        eng.close()


def test_every_injected_fault_kind_over_many_batches_leaks_nothing(agent):
    """bpo.sandbox.faults at 8% per call (raise, malformed, hang, failed restore, death) over
    several batches of nested entropy-quantile trees with a budget-filled root: no tree ever
    ends with a live snapshot, every tree is whole, the sandboxes in use hold nothing after."""
    from bpo.sandbox.faults import FaultConfig, FaultInjector

    fc = FaultConfig(rate=0.08, kinds=("raise", "malformed", "hang", "restore", "die"),
                     hang_seconds=0.0)  # fmt: skip
    base, prompter = agent
    cfg = RolloutConfig(root_width=2, max_steps=8, budget=Budget("tokens", 300), concurrency=4,
                        max_fault_frac=0.9, fill_budget=True)  # fmt: skip
    eng = RolloutEngine(
        base, prompter, lambda raw, adm: parse_action(raw, adm).text,
        make_rule("entropy_quantile", k=3), lambda: FaultInjector(make_env("toy"), fc), cfg,
        SamplingParams(max_new_tokens=8, temperature=1.0),
    )  # fmt: skip
    kept = 0
    try:
        for it in range(5):
            trees = eng.run([(f"keydoor-{i % 5}", it * 10 + i) for i in range(8)])
            kept += len(trees)
            _whole(trees)
        assert all(sb.stats().live == 0 for sb in eng._sandboxes)
    finally:
        eng.close()
    assert sum(fc.counts.values()) > 20 and set(fc.counts) == set(fc.kinds)
    assert kept >= 30  # of 40: a few trees may lose every rollout at this rate
