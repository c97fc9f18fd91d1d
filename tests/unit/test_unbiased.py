"""Statistical checks of unbiasedness against exact gradients (fixed seeds).

Each row is a Monte-Carlo mean over thousands of batches of sampled trees; the tolerance is
derived from the standard error: a row passes when the largest |mean - exact| / stderr over
the gradient coordinates has a Bonferroni p-value above ``ALPHA`` (for 14 coordinates,
|z| < 4.1), and its projection on the exact gradient (``scale``) is within 4 stderr of 1.
The same harness detects the biased constructions (p < 1e-6), so the tests can fail. The last
tests drive the real rollout engine on the ``mdp`` sandbox with a tabular policy.
"""

from __future__ import annotations

import numpy as np
import pytest

from bpo.analysis.families import make_mdp
from bpo.analysis.mdp import exact
from bpo.analysis.sampling import TreeShape
from bpo.analysis.study import Row, Setting, StudyConfig, run_setting
from bpo.branching import BRANCH_RULES

ALPHA = 1e-3
CFG = StudyConfig(
    n_batches=2500, batch_episodes=8.0, pilot_trees=32, check_trees=2, root_baseline="pilot"
)
"""Batches are independent: the root baseline comes from the pilot trees only."""


def _rows(mdp, shape: TreeShape, names: tuple[str, ...], seed: int = 0) -> dict[str, Row]:
    rows = run_setting(
        mdp, exact(mdp), Setting(shape.rule, shape, names), CFG, np.random.default_rng(seed)
    )
    return {r.estimator: r for r in rows}


def _assert_unbiased(row: Row) -> None:
    assert row.bias_coords >= 10, "too few coordinates had enough events to be tested"
    assert row.bias_p_bonferroni > ALPHA, (
        f"{row.estimator} / {row.shape}: max |z| {row.bias_max_abs_z:.2f} over "
        f"{row.bias_coords} coordinates (Bonferroni p {row.bias_p_bonferroni:.2g})"
    )
    assert abs(row.scale_z) < 4.0, f"scale {row.scale:.3f} (z {row.scale_z:.1f})"


@pytest.fixture(scope="module")
def mdp():
    # moderate probabilities (no rare actions) so that batch means are near-normal
    return make_mdp("random", seed=3, horizon=3, actions=2, logit_scale=0.5)


CAUSAL_OPTIONS = {
    "entropy_quantile": {"k": 3, "quantile": 0.5, "window": 256},
    "entropy_threshold": {"k": 3, "threshold": 0.6},
    "every": {"k": 2, "max_depth": 2},
    "fixed_depths": {"k": 4, "steps": [1, 2]},
    "random": {"k": 3, "p": 0.5, "seed": 1, "max_depth": 2},
    "tail": {"k": 3, "seed": 2},
}


@pytest.mark.parametrize("rule", sorted(CAUSAL_OPTIONS))
@pytest.mark.parametrize("width", [1, 2])
def test_bpo_is_unbiased_under_causal_rules(mdp, rule, width):
    # budget 4H binds for nested rules: the reservation caps K before any child is sampled
    shape = TreeShape(width, rule, CAUSAL_OPTIONS[rule], budget=4 * mdp.horizon)
    rows = _rows(mdp, shape, ("bpo", "bpo_prior"), seed=width)
    # the rule really branched (the root group counts as one branch node when width >= 2)
    assert rows["bpo"].branch_nodes_per_tree > (width >= 2) + 0.5
    assert rows["bpo"].cost_edges / rows["bpo"].trees_per_batch <= shape.budget
    for row in rows.values():
        _assert_unbiased(row)


def test_every_shipped_causal_rule_is_covered():
    causal = {n for n in BRANCH_RULES.names() if getattr(BRANCH_RULES.get(n), "causal", True)}
    assert causal - {"none"} <= set(CAUSAL_OPTIONS)


def test_rloo_is_unbiased_and_grpo_std_normalisation_is_not(mdp):
    rows = _rows(mdp, TreeShape(4, "none"), ("rloo", "grpo", "bpo", "bpo_prior"))
    for name in ("rloo", "bpo", "bpo_prior"):
        _assert_unbiased(rows[name])
    assert rows["grpo"].bias_p_bonferroni < 1e-6  # divides by the group's std: rescaled


def test_bpo_is_unbiased_on_a_long_agent_mdp_with_nested_branches():
    mdp = make_mdp("agent", horizon=10, decisions=(2, 7), blunder=0.15, decision_scale=0.3)
    shape = TreeShape(
        2, "entropy_threshold", {"k": 3, "threshold": 0.5, "max_depth": 2}, budget=6 * mdp.horizon
    )
    _assert_unbiased(_rows(mdp, shape, ("bpo",), seed=5)["bpo"])


def test_topk_backbone_is_detected_as_biased():
    mdp = make_mdp("trap")
    ok = _rows(mdp, TreeShape(2, "fixed_depths", {"k": 4, "steps": [1, 2]}, 24), ("bpo",))
    _assert_unbiased(ok["bpo"])
    bad = _rows(mdp, TreeShape(2, "topk_backbone", {"k": 4, "b": 1}, 24), ("bpo",))["bpo"]
    assert bad.bias_p_bonferroni < 1e-6 and bad.scale_z > 6


def test_a_budget_that_drops_queued_forks_is_detected_as_biased():
    mdp = make_mdp("budget_trap")
    rule = {"k": 4, "steps": [0]}
    ok = _rows(mdp, TreeShape(1, "fixed_depths", rule, 40), ("bpo",))["bpo"]
    assert ok.bias_p_bonferroni > ALPHA and abs(ok.scale_z) < 4
    bad = _rows(mdp, TreeShape(1, "fixed_depths", rule, 12, budget_mode="engine"), ("bpo",))
    assert bad["bpo"].bias_p_bonferroni < 1e-6 and bad["bpo"].scale < 0.9


@pytest.fixture(scope="module")
def engine_run():
    """The real rollout engine on the ``mdp`` sandbox, driven by the tabular policy."""
    from bpo.analysis.bridge import engine_trees
    from bpo.branching import make_rule
    from bpo.rollout.budget import Budget
    from bpo.rollout.engine import RolloutConfig

    rule = make_rule("entropy_threshold", k=3, threshold=0.9)
    cfg = RolloutConfig(
        root_width=2,
        max_steps=20,
        budget=Budget(unit="steps", amount=1e6),
        entropy="first",
        concurrency=8,
    )
    return engine_trees("random-3", range(2000), rule, cfg, np.random.default_rng(0))


def test_real_engine_trees_follow_the_mdp(engine_run):
    mdp, trees, raw = engine_run
    for tree, rec in zip(trees[:200], raw[:200], strict=True):
        for i, node in enumerate(rec.nodes[1:], 1):
            assert bool(mdp.terminal[tree.states[i]]) == node.turn.terminated
    assert np.mean([t.branch_nodes for t in trees]) > 1.5  # the root group + rule branches


def test_real_engine_gradients_are_unbiased_with_a_causal_rule(engine_run):
    from bpo.analysis.forest import batch_gradients, forest_advantages, make_forest
    from bpo.analysis.metrics import event_counts, gradient_stats

    mdp, trees, _ = engine_run
    forest = make_forest(trees, mdp)
    res = forest_advantages("bpo", forest, mdp)
    batch = np.arange(len(trees)) // 2
    nb = len(trees) // 2
    g_hat = batch_gradients(forest, res, mdp, batch, nb, mdp.probs())
    e = np.flatnonzero(forest.parents >= 0)
    seen, other = event_counts(
        batch[forest.tree[e]],
        mdp.param_of[forest.states[forest.parents[e]]],
        forest.actions[e],
        nb,
        mdp.logits.shape,
    )
    st = gradient_stats(g_hat, exact(mdp).grad.ravel(), (seen >= 30) & (other >= 30))
    assert st.bias_coords >= 20 and st.bias_p_bonferroni > ALPHA and abs(st.scale_z) < 4


def test_the_study_sampler_grows_trees_like_the_engine(engine_run):
    from bpo.analysis.sampling import TreeSampler

    mdp, trees, _ = engine_run
    shape = TreeShape(2, "entropy_threshold", {"k": 3, "threshold": 0.9})
    sampler = TreeSampler(mdp, shape, np.random.default_rng(1))
    ours = [sampler.sample() for _ in range(2000)]
    for stat in (lambda t: t.edges, lambda t: t.branch_nodes, lambda t: t.leaves):
        a = np.array([stat(t) for t in trees], dtype=float)
        b = np.array([stat(t) for t in ours], dtype=float)
        se = np.sqrt(a.var() / len(a) + b.var() / len(b))
        assert abs(a.mean() - b.mean()) < 4 * se + 1e-12
