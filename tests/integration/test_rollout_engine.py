"""The rollout engine with real parts: a tiny transformers model behind HFPolicy, the built-in
toy text game with native snapshots, the real prompt builder and parser."""

import os
import random

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
import torch

from bpo.branching import make_rule
from bpo.learner import Learner, LearnerConfig, token_logprobs
from bpo.packing import pack_forest, pack_paths
from bpo.policy.hf import HFPolicy
from bpo.policy.models import init_model
from bpo.policy.parsing import parse_action
from bpo.policy.prompts import PromptBuilder
from bpo.policy.protocol import SamplingParams
from bpo.rollout import Budget, RolloutConfig, RolloutEngine
from bpo.rollout.engine import _round
from bpo.sandbox import make_env
from bpo.tree import tree_stats


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = init_model(tmp_path_factory.mktemp("m"), hidden=64, layers=2, tokenizer="byte", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    policy = HFPolicy(model, tok, seed=0)
    prompter = PromptBuilder(tok, max_admissible=8)
    return model, tok, policy, prompter


def engine(
    agent, rule, root_width=1, budget=None, max_steps=6, concurrency=3, fill=False, penalty=0.0,
    entropy="first",
):
    _, _, policy, prompter = agent
    cfg = RolloutConfig(
        root_width=root_width,
        max_steps=max_steps,
        budget=budget or Budget("tokens", 400),
        concurrency=concurrency,
        fill_budget=fill,
        invalid_penalty=penalty,
        entropy=entropy,
    )
    return RolloutEngine(
        policy,
        prompter,
        lambda raw, adm: parse_action(raw, adm).text,
        rule,
        lambda: make_env("toy"),
        cfg,
        SamplingParams(max_new_tokens=12, temperature=1.0),
    )


TASKS = [("keydoor-1", 0), ("keydoor-2", 1), ("keydoor-3", 2), ("keydoor-4", 3)]


def test_tree_rollout_structure_and_no_leaks(agent):
    eng = engine(agent, make_rule("every", k=2, max_branches=2), root_width=2)
    try:
        trees = eng.run(TASKS)
    finally:
        eng.close()
    assert [t.task for t in trees] == [t for t, _ in TASKS]
    for t in trees:
        s = tree_stats(t)
        assert t.nodes[0].branch_k == 2 and len(t.nodes[0].children) == 2
        assert s.branch_nodes >= 1
        assert t.meta["live_snapshots_after"] == 0
        c = t.meta["compute"]
        assert c.generated_tokens == sum(len(n.turn.action_ids) for n in t.nodes[1:])
        assert c.sandbox_steps == len(t) - 1
        assert c.leaves == len(t.leaves())
        for leaf in t.leaves():
            assert t.nodes[leaf].terminal
        for node in t.nodes:  # a branch node has as many children as it asked for, at most
            assert len(node.children) <= max(node.branch_k, 1)


def test_sampled_logprobs_equal_learner_logprobs(agent):
    """Token-in/token-out end to end: the learner's packed teacher-forced log-probs of every
    action token equal the log-probs the policy reported when sampling it."""
    model = agent[0]
    eng = engine(agent, make_rule("every", k=2, max_branches=1), root_width=2)
    try:
        trees = eng.run(TASKS[:2])
    finally:
        eng.close()
    for pack in (pack_forest, pack_paths):
        packed = pack(trees)
        with torch.no_grad():
            logp, _, sel = token_logprobs(model, packed)
        a = packed.actions
        offsets: dict[int, int] = {}
        for lp, s in zip(logp.tolist(), sel, strict=True):
            e = a.edge[s]
            t, node = packed.edges[e]
            j = offsets.get(e, 0)
            offsets[e] = j + 1
            assert lp == pytest.approx(trees[t].nodes[node].turn.logprobs[j], abs=2e-5)


def test_expected_budget_fixes_every_width_before_sampling(agent):
    """Expected mode: the group size and each branch node's K are decided before any child is
    sampled (queued rollouts always run), from the budget and earlier iterations' costs."""
    budget = Budget("tokens", 150)
    group = engine(agent, make_rule("none"), root_width=64, budget=budget, max_steps=4)
    tree = engine(agent, make_rule("every", k=2), root_width=2, budget=budget, max_steps=4)
    try:
        # no history yet: an episode is expected to cost (4 / 2 turns) * (12 / 2 tokens) = 12
        assert group._root_width(None) == 150 // 12  # 12.5 rounded down without a draw
        g = group.run(TASKS)
        t = tree.run(TASKS)
        # the cost model now holds the finished trees' measured costs
        expected = group.costs.rollout_cost("tokens", 0)
        assert group._root_width(None) == max(2, min(64, int(150 // expected)))
    finally:
        group.close()
        tree.close()
    for tr in g[:3]:  # the first `concurrency` trees start before any tree has finished
        assert len(tr.nodes[0].children) in (12, 13)  # 12.5, rounded at random
    for tr in g[3:]:  # later ones use the costs of the trees finished before they started
        assert 2 <= len(tr.nodes[0].children) <= 64
    for tr in t:
        for node in tr.nodes:
            if node.branch_k >= 2:
                assert len(node.children) == node.branch_k  # never cut after the decision
    used_g = np.mean([tr.meta["compute"].generated_tokens for tr in g])
    used_t = np.mean([tr.meta["compute"].generated_tokens for tr in t])
    assert used_t > 0 and used_g > 0


def test_random_rounding_matches_the_budget_in_expectation():
    """A budget that buys 2.3 rollouts buys 2 or 3, 3 in 30% of trees; the draw comes from the
    tree's own seeded stream, so a rerun rounds the same way."""
    draws = [_round(2.3, random.Random(f"budget-{s}")) for s in range(4000)]
    assert set(draws) == {2, 3}
    assert np.mean(draws) == pytest.approx(2.3, abs=0.03)
    assert draws == [_round(2.3, random.Random(f"budget-{s}")) for s in range(4000)]
    assert _round(2.3, None) == 2 and _round(4.0, random.Random(0)) == 4


def test_fill_budget_spends_what_a_group_spends(agent):
    """A stingy branch rule leaves most of the budget unspent; with fill_budget the root gets
    as many backbones as the budget buys (decided from earlier trees' costs, before sampling),
    so the tree's mean cost matches the group's, and both come near the budget."""
    budget = Budget("tokens", 240)
    rule = lambda: make_rule("random", k=2, p=0.2)  # noqa: E731
    group = engine(agent, make_rule("none"), root_width=64, budget=budget, max_steps=4)
    lean = engine(agent, rule(), root_width=2, budget=budget, max_steps=4)
    full = engine(agent, rule(), root_width=2, budget=budget, max_steps=4, fill=True)
    spent = {}
    try:
        for name, eng in (("group", group), ("lean", lean), ("full", full)):
            eng.run(TASKS)  # calibrates the cost model
            trees = eng.run(TASKS * 2)
            spent[name] = np.mean([t.meta["compute"].generated_tokens for t in trees])
            if name == "full":
                widths = [len(t.nodes[0].children) for t in trees]
                assert min(widths) > 2 and max(widths) <= 64
    finally:
        for eng in (group, lean, full):
            eng.close()
    assert spent["lean"] < 0.5 * spent["group"]
    assert 0.7 * spent["group"] < spent["full"] < 1.3 * spent["group"]
    assert 0.6 * 240 < spent["full"] < 1.4 * 240


def test_invalid_actions_are_penalised_and_counted(agent):
    """An untrained model often runs out of tokens or says something inadmissible: each such
    turn's reward is the sandbox's minus the penalty, and the sandbox's own return is kept."""
    eng = engine(agent, make_rule("none"), root_width=3, max_steps=4, penalty=0.25)
    try:
        trees = eng.run(TASKS)
    finally:
        eng.close()
    invalid = sum(t.meta["compute"].invalid_actions for t in trees)
    assert invalid > 0
    turns = [n.turn for t in trees for n in t.nodes[1:]]
    assert sum(t.penalty == 0.25 for t in turns) == invalid
    assert all(t.penalty in (0.0, 0.25) for t in turns)
    for t in trees:
        shaped, own = t.returns(), t.returns(shaped=False)
        assert np.all(own >= shaped) and np.any(own > shaped)


def test_hard_truncating_budget_matches_within_one_turn(agent):
    budget = Budget("tokens", 100, mode="hard", truncate=True)
    eng = engine(agent, make_rule("none"), root_width=64, budget=budget, max_steps=6)
    try:
        trees = eng.run(TASKS)
    finally:
        eng.close()
    for tr in trees:
        used = tr.meta["compute"].generated_tokens
        assert 100 <= used < 100 + 12  # within one turn (max_new_tokens)


def test_learner_update_on_engine_trees(agent):
    model = agent[0]
    eng = engine(agent, make_rule("entropy_quantile", k=2, min_history=2), root_width=2)
    try:
        trees = eng.run(TASKS)
    finally:
        eng.close()
    # a random model never finds the treasure: advantages are all 0, so an entropy bonus gives
    # the update something to do
    learner = Learner(model, LearnerConfig(lr=1e-3, entropy_coef=0.01))
    before = [p.detach().clone() for p in model.parameters()]
    m = learner.update(trees, "bpo")
    agent[2].clear_cache()
    assert np.isfinite(m["loss/total"])
    assert m["learner/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_greedy_entropy_is_the_mean_along_the_states_greedy_continuation(agent):
    """Entropy mode "greedy": each decision's entropy is the mean token entropy of the greedy
    continuation from that state (a function of the state: the same context always gives the
    same value), and the probe's tokens are counted as generated."""
    _, _, policy, _ = agent
    eng = engine(agent, make_rule("entropy_threshold", k=2, threshold=0.0, max_branches=1),
                 root_width=1, entropy="greedy")  # fmt: skip
    try:
        trees = eng.run(TASKS[:2])
    finally:
        eng.close()
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    for t in trees:
        c = t.meta["compute"]
        assert 0 < c.probe_tokens < c.generated_tokens
        assert c.generated_tokens == c.probe_tokens + sum(
            len(n.turn.action_ids) for n in t.nodes[1:]
        )
        node = t.nodes[0]
        (probe,) = policy.sample([t.context(0)], 1, greedy)[0]
        assert node.entropy == pytest.approx(float(np.mean(probe.entropies)), abs=1e-5)
        assert node.branch_k == 2  # threshold 0: the root branches
