"""Fault handling in the rollout engine, with faults injected into a real sandbox (the toy
game, native snapshots) under a real tiny transformers policy: a step that raises, a malformed
result, a restore that fails, a sandbox that dies for good, a policy backend that fails
mid-batch. Every returned tree is whole (no partial path), no snapshot leaks, faults are
counted, and a batch whose faults pass the bound stops with a clear error."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
from bpo.sandbox.faults import FaultConfig, FaultInjector

TASKS = [(f"keydoor-{i}", i) for i in range(1, 7)]


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = init_model(tmp_path_factory.mktemp("m"), hidden=64, layers=2, tokenizer="byte", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    return HFPolicy(model, tok, seed=0), PromptBuilder(tok, max_admissible=8)


def injector(made: list, rate: float, kinds: tuple[str, ...], seed: int = 0):
    """A factory of toy sandboxes wrapped in the production fault injector; keeps them."""
    fc = FaultConfig(rate=rate, kinds=kinds, hang_seconds=0.0, seed=seed)

    def factory():
        made.append(FaultInjector(make_env("toy"), fc))
        return made[-1]

    return factory


class DiesAtStep(FaultInjector):
    """Dies for good at its ``at``-th step, then fails every call (no random faults)."""

    def __init__(self, at: int) -> None:
        super().__init__(make_env("toy"), FaultConfig())
        self.at, self.steps = at, 0

    def step(self, action):
        self.steps += 1
        self._dead = self._dead or self.steps >= self.at
        return super().step(action)


class FlakyPolicy:
    """Fails every ``every``-th call (a backend dying mid-batch), else delegates."""

    def __init__(self, inner, every):
        self.inner, self.every, self.calls = inner, every, 0

    def sample(self, contexts, n=1, params=None):
        self.calls += 1
        if self.calls % self.every == 0:
            raise RuntimeError("injected: the policy backend failed")
        return self.inner.sample(contexts, n, params)


def _engine(agent, factory, policy=None, rule=None, retries=2, frac=0.5, tokens=12, **config):
    base, prompter = agent
    cfg = RolloutConfig(**{"root_width": 2, "max_steps": 6, "budget": Budget("tokens", 300),
                           "concurrency": 3, "max_retries": retries, "max_fault_frac": frac,
                           **config})  # fmt: skip
    return RolloutEngine(
        policy or base, prompter, lambda raw, adm: parse_action(raw, adm).text,
        rule or make_rule("every", k=2, max_branches=2), factory, cfg,
        SamplingParams(max_new_tokens=tokens, temperature=1.0),
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
    made: list[FaultInjector] = []
    eng = _engine(agent, injector(made, 0.1, ("raise", "malformed", "restore")))
    try:
        trees = eng.run(TASKS)
    finally:
        eng.close()
    assert eng.faults["retries"] > 0
    assert len(trees) + eng.faults["failed_trees"] == len(TASKS)
    _whole(trees)
    assert sum(t.meta["compute"].retries for t in trees) <= eng.faults["retries"]
    assert all(f.inner.stats().live == 0 for f in made)


def test_a_sandbox_that_dies_is_replaced_and_its_tree_keeps_its_complete_rollouts(agent):
    made: list[FaultInjector] = []

    def factory():  # the first sandbox dies at its 9th step, the others have no faults
        made.append(DiesAtStep(9) if not made else FaultInjector(make_env("toy"), FaultConfig()))
        return made[-1]

    eng = _engine(agent, factory)
    try:
        trees = eng.run(TASKS[:3])
    finally:
        eng.close()
    assert eng.faults["replaced_sandboxes"] >= 1
    assert made[0]._dead
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
    eng = _engine(agent, injector([], 0.9, ("raise",), seed=2), retries=1, frac=0.25)
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
    made: list[FaultInjector] = []
    kinds = ("raise", "malformed", "hang", "restore", "die")
    eng = _engine(agent, injector(made, 0.08, kinds), rule=make_rule("entropy_quantile", k=3),
                  frac=0.9, tokens=8, max_steps=8, concurrency=4, fill_budget=True)  # fmt: skip
    kept = 0
    try:
        for it in range(5):
            trees = eng.run([(f"keydoor-{i % 5}", it * 10 + i) for i in range(8)])
            kept += len(trees)
            _whole(trees)
        assert all(sb.stats().live == 0 for sb in eng._sandboxes)
    finally:
        eng.close()
    counts = made[0].config.counts
    assert sum(counts.values()) > 20 and set(counts) == set(kinds)
    assert kept >= 30  # of 40: a few trees may lose every rollout at this rate
