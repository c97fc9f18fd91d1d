"""Exact MDPs, the tree sampler, the vectorised estimators and the verify CLI (bpo.analysis)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bpo import estimators
from bpo.analysis.families import FAMILIES, make_mdp
from bpo.analysis.forest import (
    FAST,
    batch_gradients,
    check_against_compute,
    forest_advantages,
    make_forest,
)
from bpo.analysis.mdp import MDPBuilder, enumerate_gradient, exact, prefix_share
from bpo.analysis.metrics import event_counts, gradient_stats
from bpo.analysis.sampling import TreeSampler, TreeShape


def tiny_mdp():
    """root: a0 -> s1 (pi = 3/4, 1/4 over leaves with reward 1, 0); a1 -> leaf with reward 0.5.

    V(s1) = 3/4, Q(root) = (3/4, 1/2), J = 5/8;
    dJ/dlogits[root] = 1/2 * (3/4 - 5/8), 1/2 * (1/2 - 5/8) = (1/16, -1/16);
    dJ/dlogits[s1] = rho 1/2 * (3/4 * (1 - 3/4), 1/4 * (0 - 3/4)) = (3/32, -3/32).
    """
    b = MDPBuilder(2)
    root = b.add(0)
    s1 = b.add(1)
    b.link(root, 0, s1)
    b.link(root, 1, b.add(1, terminal=True, terminal_reward=0.5))
    b.link(s1, 0, b.add(2, terminal=True, terminal_reward=1.0))
    b.link(s1, 1, b.add(2, terminal=True, terminal_reward=0.0))
    return b.build("tiny", np.array([[0.0, 0.0], [np.log(3.0), 0.0]]))


def test_tiny_mdp_gradient_literal():
    ex = exact(tiny_mdp())
    assert ex.j == pytest.approx(5 / 8)
    np.testing.assert_allclose(ex.grad, [[1 / 16, -1 / 16], [3 / 32, -3 / 32]], atol=1e-15)
    np.testing.assert_allclose(ex.q[0], [3 / 4, 1 / 2])
    assert ex.mean_length == pytest.approx(1.5)
    # R in {1, 0, 0.5} w.p. 3/8, 1/8, 1/2: Var = 1/2 - 25/64 = 7/64; the first action
    # explains Var(E[R | a0]) = 1/64 of it, i.e. 1/7.
    assert ex.return_var == pytest.approx(7 / 64)
    np.testing.assert_allclose(prefix_share(tiny_mdp()), [0.0, 1 / 7, 1.0], atol=1e-12)


@pytest.mark.parametrize(
    "family,options",
    [
        ("random", {}),
        ("random", {"noise": "gaussian", "step_rewards": True, "actions": 2, "horizon": 4}),
        ("agent", {"horizon": 8, "decisions": (1, 5), "options": 3, "step_cost": 0.01}),
        ("chain", {}),
        ("trap", {}),
        ("budget_trap", {}),
    ],
)
def test_exact_gradient_matches_enumeration_and_finite_differences(family, options):
    mdp = make_mdp(family, **options)
    ex = exact(mdp)
    j, g = enumerate_gradient(mdp)
    assert ex.j == pytest.approx(j, abs=1e-12)
    np.testing.assert_allclose(ex.grad, g, atol=1e-12)
    eps = 1e-6
    fd = np.zeros_like(mdp.logits)
    for idx in np.ndindex(*mdp.logits.shape):
        up, down = mdp.logits.copy(), mdp.logits.copy()
        up[idx] += eps
        down[idx] -= eps
        fd[idx] = (exact(mdp, up).j - exact(mdp, down).j) / (2 * eps)
    np.testing.assert_allclose(ex.grad, fd, atol=1e-8)


def test_family_registry_lists_names_on_typo():
    assert {"random", "agent", "chain", "trap", "budget_trap"} <= set(FAMILIES.names())
    with pytest.raises(KeyError, match="valid names: agent, budget_trap"):
        make_mdp("agnet")


def _trees(mdp, shape, n, seed=0):
    sampler = TreeSampler(mdp, shape, np.random.default_rng(seed))
    return [sampler.sample() for _ in range(n)]


@pytest.mark.parametrize(
    "width,rule,opts",
    [
        (4, "none", {}),
        (1, "every", {"k": 2, "max_depth": 2}),
        (2, "entropy_threshold", {"k": 3, "threshold": 0.3}),
        (2, "topk_backbone", {"k": 4, "b": 2}),
    ],
)
def test_sampled_trees_are_consistent_with_the_mdp_and_the_budget(width, rule, opts):
    mdp = make_mdp("agent", horizon=8, decisions=(1, 5), blunder=0.2)
    h = mdp.horizon
    budget = 5 * h
    for tree in _trees(mdp, TreeShape(width, rule, opts, budget), 200):
        p = tree.parents
        assert p[0] == -1 and np.all(p[1:] < np.arange(1, len(p)))
        assert tree.edges <= max(budget, width * h)  # reservation: never over budget
        # every edge follows the MDP's transition table; every leaf is terminal
        np.testing.assert_array_equal(
            mdp.next_state[tree.states[p[1:]], tree.actions[1:]], tree.states[1:]
        )
        has_child = np.zeros(len(p), dtype=bool)
        has_child[p[1:]] = True
        assert np.all(mdp.terminal[tree.states[~has_child]])
        root_children = int((p == 0).sum())
        assert root_children == width if width >= 2 else root_children in (1, opts.get("k", 1))
        if rule == "none":
            assert tree.leaves == width and tree.branch_nodes == 1


def test_engine_budget_mode_stops_forks_but_reserve_never_exceeds():
    mdp = make_mdp("budget_trap")
    shape = {"k": 4, "steps": [0]}
    reserve = _trees(mdp, TreeShape(1, "fixed_depths", shape, 12), 100)
    engine = _trees(mdp, TreeShape(1, "fixed_depths", shape, 12, budget_mode="engine"), 100)
    assert all(t.edges <= 12 for t in reserve)
    assert all(t.branch_nodes == 0 for t in reserve)  # a fork (8 edges) never fits twice
    assert any(t.edges > 12 for t in engine)  # the engine overshoots by the rollouts in flight
    assert {len(np.flatnonzero(t.parents == 0)) for t in engine} >= {2, 4}  # K depends on luck


def test_bpo_on_independent_groups_equals_rloo_on_sampled_trees():
    mdp = make_mdp("agent", horizon=10, decisions=(2, 7), blunder=0.1)
    for tree in _trees(mdp, TreeShape(5, "none"), 50):
        a = estimators.compute("bpo", tree.parents, tree.rewards)
        b = estimators.compute("rloo", tree.parents, tree.rewards)
        np.testing.assert_array_equal(a.weight, b.weight)
        np.testing.assert_allclose(a.advantage, b.advantage, atol=1e-12)


@pytest.mark.parametrize(
    "family,shape",
    [
        ("agent", TreeShape(4, "none")),
        ("chain", TreeShape(6, "none")),
        ("random", TreeShape(2, "every", {"k": 2, "max_depth": 2}, 40)),
        ("agent", TreeShape(1, "entropy_threshold", {"k": 3, "threshold": 0.3}, 60)),
    ],
)
def test_vectorised_estimators_equal_compute(family, shape):
    mdp = make_mdp(family)
    trees = _trees(mdp, shape, 60, seed=3)
    forest = make_forest(trees, mdp)
    rng = np.random.default_rng(0)
    per_tree = {"root_baseline": rng.normal(size=60), "prior_weight": rng.uniform(0.5, 5, 60)}
    trees_ok = [n for n in FAST if n.startswith("bpo")]  # the group estimators refuse trees
    names = list(FAST) if shape.rule == "none" else trees_ok
    assert names
    for name in names:
        res = forest_advantages(name, forest, mdp, per_tree=per_tree)
        assert check_against_compute(name, forest, mdp, res, range(60), per_tree=per_tree) > 0


def test_vectorised_check_fails_loudly_on_a_difference():
    mdp = make_mdp("random")
    trees = _trees(mdp, TreeShape(3, "none"), 5)
    forest = make_forest(trees, mdp)
    res = forest_advantages("rloo", forest, mdp)
    res.advantage[2] += 1e-3
    with pytest.raises(AssertionError, match=r"differs from bpo\.estimators\.compute on tree 0"):
        check_against_compute("rloo", forest, mdp, res, [0])


def test_bpo_prior_literals_and_special_cases():
    # root with W=2 children, Q = 1 and 0; prior b = 0.25 with weight 2:
    # baselines (0 + 2 * .25) / 3 = 1/6 and (1 + .5) / 3 = 1/2.
    parents, rewards = [-1, 0, 0, 1], [0.0, 0.0, 0.0, 1.0]
    res = estimators.compute("bpo_prior", parents, rewards, root_baseline=0.25, prior_weight=2.0)
    np.testing.assert_allclose(res.advantage, [0, 1 - 1 / 6, -1 / 2, 1 - 1 / 6])
    plain = estimators.compute("bpo", parents, rewards)
    same = estimators.compute("bpo_prior", parents, rewards)
    np.testing.assert_array_equal(plain.advantage, same.advantage)
    one = [-1, 0, 1, 1]  # W = 1: exactly bpo with the root baseline
    a = estimators.compute("bpo_prior", one, [0, 0.5, 1, 0], root_baseline=0.3, prior_weight=7)
    b = estimators.compute("bpo", one, [0, 0.5, 1, 0], root_baseline=0.3)
    np.testing.assert_allclose(a.advantage, b.advantage)
    with pytest.raises(TypeError, match="std_normalize"):
        estimators.compute("bpo_prior", parents, rewards, std_normalize=True)


def test_batch_gradient_of_one_edge_is_the_score_times_the_coefficient():
    mdp = tiny_mdp()
    pi = mdp.probs()
    # one tree: root -(a0)-> s1 -(a1)-> leaf; two root children so the edge has weight 1/2
    from bpo.analysis.sampling import SampledTree

    tree = SampledTree(
        np.array([-1, 0, 1, 0]),
        np.array([0.0, 0.0, 0.0, 0.5]),
        np.array([0, 1, 4, 2]),
        np.array([-1, 0, 1, 1]),
        1,
    )
    forest = make_forest([tree], mdp)
    res = forest_advantages("bpo", forest, mdp)
    g = batch_gradients(forest, res, mdp, np.array([0]), 1, pi)[0].reshape(2, 2)
    a_root = np.array([0.0 - 0.5, 0.5 - 0.0])  # Q = 0 and 0.5 at the root: LOO advantages
    want_root = 0.5 * (a_root[0] * (np.eye(2)[0] - pi[0]) + a_root[1] * (np.eye(2)[1] - pi[0]))
    want_s1 = 0.5 * a_root[0] * (np.eye(2)[1] - pi[1])
    np.testing.assert_allclose(g, [want_root, want_s1], atol=1e-15)


def test_gradient_stats_detect_a_shift_and_pass_an_unbiased_sample():
    rng = np.random.default_rng(0)
    g = np.array([1.0, -2.0, 0.5])
    ok = gradient_stats(g + rng.normal(size=(4000, 3)), g)
    assert ok.bias_p_bonferroni > 0.01 and abs(ok.scale - 1) < 0.05
    assert ok.trace_cov == pytest.approx(3.0, rel=0.1)
    bad = gradient_stats(g + 0.2 + rng.normal(size=(4000, 3)), g)
    assert bad.bias_max_abs_z > 8 and bad.bias_p_bonferroni < 1e-10
    # zero variance and a difference: infinitely significant
    assert gradient_stats(np.tile(g + np.array([0, 0, 1]), (5, 1)), g).bias_max_abs_z == np.inf


def test_event_counts_count_batches_per_coordinate():
    seen, other = event_counts(
        np.array([0, 0, 1]), np.array([0, 0, 0]), np.array([0, 1, 0]), 2, (1, 2)
    )
    np.testing.assert_array_equal(seen, [2, 1])
    np.testing.assert_array_equal(other, [1, 2])  # action 1 was not taken in batch 1


def test_verify_cli_writes_rows_for_every_estimator(tmp_path):
    from bpo.analysis.verify import main

    out = tmp_path / "v.json"
    rc = main(
        [
            "--quick",
            "--batches",
            "40",
            "--check-batches",
            "200",
            "--no-sweep",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "v.png"),
        ]
    )
    data = json.loads(out.read_text())
    assert set(estimators.names()) == {r["estimator"] for r in data["rows"]}
    keys = {
        "mdp",
        "estimator",
        "rule",
        "bias_max_abs_z",
        "trace_cov",
        "cost_edges",
        "trace_cov_x_cost",
        "grad_norm_var",
        "cos_to_true",
    }
    assert all(keys <= set(r) for r in data["rows"])
    triples = [(r["mdp"], r["estimator"], r["rule"]) for r in data["rows"]]
    assert len(triples) == len(set(triples))
    assert {c["check"] for c in data["checks"]} == {
        "topk_backbone",
        "budget_stop",
        "entropy_source",
    }
    assert (tmp_path / "v.png").stat().st_size > 10_000
    assert rc in (0, 1)
    assert data["meta"]["estimators_without_rows"] == []
