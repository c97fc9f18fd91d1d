"""Estimators: hand-computed literals, special-case equivalences and error messages."""

import numpy as np
import pytest

from bpo import estimators
from bpo.estimators import TreeError, compute

# A hand-drawn nested tree (rewards on the edge into each node):
#
#          0 (root, K=2)
#        /            \
#   1 (r=0, K=3)       2 (r=0.5)
#   /    |    \          |
#  3     4     5         6 (r=0)
# r=1   r=0   r=0        |
#              |         7 (r=1)
#              8 (r=2)
NESTED_PARENTS = [-1, 0, 0, 1, 1, 1, 2, 6, 5]
NESTED_REWARDS = [0.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0, 1.0, 2.0]
# Q: Q3=1, Q4=0, Q8=2, Q5=2, V1=1, Q1=1; Q7=1, Q6=1, Q2=1.5
# A1 = 1 - 1.5, A2 = 1.5 - 1; A3 = 1 - (0+2)/2, A4 = 0 - (1+2)/2, A5 = 2 - (1+0)/2;
# chain edges inherit their branch edge's advantage: A6 = A7 = A2, A8 = A5.
NESTED_ADV = [0.0, -0.5, 0.5, 0.0, -1.5, 1.5, 0.5, 0.5, 1.5]
# w = product of 1/K over branch ancestors (parent included): root K=2, node 1 K=3.
NESTED_W = [0.0, 1 / 2, 1 / 2, 1 / 6, 1 / 6, 1 / 6, 1 / 2, 1 / 2, 1 / 6]


def test_bpo_nested_tree_literals():
    res = compute("bpo", NESTED_PARENTS, NESTED_REWARDS)
    np.testing.assert_allclose(res.advantage, NESTED_ADV, atol=1e-12)
    np.testing.assert_allclose(res.weight, NESTED_W, atol=1e-12)


def test_bpo_chain_baseline_formula():
    # Baseline of a chain edge e below branch node b = LOO mean at b - rewards from b to e's
    # parent, so with intermediate rewards A(e) still equals A(f) of the branch edge f.
    parents = [-1, 0, 0, 1, 3, 2]
    rewards = [0.0, 0.3, 0.1, 0.4, 0.2, 0.0]
    res = compute("bpo", parents, rewards)
    q1 = 0.3 + 0.4 + 0.2
    q2 = 0.1 + 0.0
    np.testing.assert_allclose(res.advantage[[1, 3, 4]], [q1 - q2] * 3, atol=1e-12)
    np.testing.assert_allclose(res.advantage[[2, 5]], [q2 - q1] * 2, atol=1e-12)


def test_bpo_reward_to_go_chain_baseline():
    # reward_to_go: a chain edge e below branch node b gets Q(e) - LOO mean at b (the rewards
    # collected between b and e are not subtracted), so a turn's own reward counts for it and
    # the turns above it in the chain, never for the turns below it.
    parents = [-1, 0, 0, 1, 3, 2]
    rewards = [0.0, 0.3, 0.1, 0.4, 0.2, 0.0]
    res = compute("bpo", parents, rewards, reward_to_go=True)
    q2 = 0.1 + 0.0
    q1, q3, q4 = 0.3 + 0.4 + 0.2, 0.4 + 0.2, 0.2
    q5 = 0.0
    np.testing.assert_allclose(
        res.advantage, [0, q1 - q2, q2 - q1, q3 - q2, q4 - q2, q5 - q1], atol=1e-12
    )
    np.testing.assert_allclose(res.weight, compute("bpo", parents, rewards).weight)
    # with rewards on the last edges only (no intermediate rewards) it is plain BPO
    np.testing.assert_allclose(
        compute("bpo", NESTED_PARENTS, [0, 0, 0, 1, 0, 0, 0, 1, 2], reward_to_go=True).advantage,
        compute("bpo", NESTED_PARENTS, [0, 0, 0, 1, 0, 0, 0, 1, 2]).advantage,
        atol=1e-12,
    )


def test_nested_branch_inside_chain():
    # root(K=2) -> 1 -> 3 (branch K=2: 4, 5); root -> 2
    parents = [-1, 0, 0, 1, 3, 3]
    rewards = [0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    res = compute("bpo", parents, rewards)
    # Q4=1, Q5=0, V3=0.5, Q3=0.5, Q1=0.5, Q2=1
    np.testing.assert_allclose(res.advantage, [0, -0.5, 0.5, -0.5, 1.0, -1.0], atol=1e-12)
    np.testing.assert_allclose(res.weight, [0, 0.5, 0.5, 0.5, 0.25, 0.25], atol=1e-12)


def _random_group(rng, n_episodes, max_len=5):
    parents, rewards = [-1], [0.0]
    for _ in range(n_episodes):
        prev = 0
        for _ in range(rng.integers(1, max_len + 1)):
            parents.append(prev)
            rewards.append(float(rng.normal()))
            prev = len(parents) - 1
    return parents, rewards


@pytest.mark.parametrize("seed", range(5))
def test_bpo_root_only_equals_rloo(seed):
    rng = np.random.default_rng(seed)
    parents, rewards = _random_group(rng, n_episodes=int(rng.integers(2, 7)))
    a = compute("bpo", parents, rewards)
    b = compute("rloo", parents, rewards)
    np.testing.assert_array_equal(a.weight, b.weight)
    np.testing.assert_allclose(a.advantage, b.advantage, atol=1e-12)


def test_rloo_and_grpo_literals():
    # three episodes with returns 1, 0, 2 (the second has two steps)
    parents = [-1, 0, 0, 2, 0]
    rewards = [0.0, 1.0, 0.0, 0.0, 2.0]
    r = compute("rloo", parents, rewards)
    np.testing.assert_allclose(r.advantage, [0, 0.0, -1.5, -1.5, 1.5])
    np.testing.assert_allclose(r.weight, [0, 1 / 3, 1 / 3, 1 / 3, 1 / 3])
    g = compute("grpo", parents, rewards)  # mean 1, sample std 1
    np.testing.assert_allclose(g.advantage, np.array([0, 0, -1, -1, 1]) / (1 + 1e-6))
    g0 = compute("grpo", parents, rewards, std_normalize=False)
    np.testing.assert_allclose(g0.advantage, [0, 0, -1, -1, 1])


def test_group_estimators_refuse_trees():
    with pytest.raises(TreeError, match=r"node 1 has 3 children.*use 'bpo'"):
        compute("rloo", NESTED_PARENTS, NESTED_REWARDS)
    for name in ("grpo", "gigpo"):
        with pytest.raises(TreeError, match="independent episodes"):
            compute(name, NESTED_PARENTS, NESTED_REWARDS, fingerprints=list(range(9)))


def test_gigpo_no_shared_states_is_episode_term_except_the_shared_root():
    # Episodes 0-1-3 (R=1) and 0-2-4 (R=0); no state below the root is shared. The root state
    # is shared by construction (all first steps act from it), so first steps get the step
    # term of the root group too; every other step gets only the episode-level term.
    parents = [-1, 0, 0, 1, 2]
    rewards = [0.0, 0.0, 0.0, 1.0, 0.0]
    fps = ["s0", "a", "b", "c", "d"]
    res = compute("gigpo", parents, rewards, fingerprints=fps, gamma=0.5)
    episode = np.array([0, 0.5, -0.5, 0.5, -0.5])
    # root group: discounted returns 0.5 and 0 -> centred +-0.25
    step = np.array([0, 0.25, -0.25, 0, 0])
    np.testing.assert_allclose(res.advantage, episode + step)
    np.testing.assert_allclose(res.weight, [0, 0.5, 0.5, 0.5, 0.5])


def test_gigpo_shared_anchor_state():
    # Both episodes pass through state "x" after one step; the steps taken from "x" form a
    # group: returns-to-go 1 and 0 -> +-0.5 step advantage.
    parents = [-1, 0, 0, 1, 2]
    rewards = [0.0, 0.0, 0.0, 1.0, 0.0]
    fps = ["s0", "x", "x", "c", "d"]
    res = compute("gigpo", parents, rewards, fingerprints=fps, gamma=1.0)
    episode = np.array([0, 0.5, -0.5, 0.5, -0.5])
    step = np.array([0, 0.5, -0.5, 0.5, -0.5])
    np.testing.assert_allclose(res.advantage, episode + step)
    with pytest.raises(TreeError, match="needs fingerprints"):
        compute("gigpo", parents, rewards)


def test_root_baseline_for_unbranched_prefix():
    parents = [-1, 0, 1, 2, 2]  # single backbone edge 0->1->2, then a K=2 branch
    rewards = [0.0, 0.0, 0.0, 1.0, 0.0]
    res = compute("bpo", parents, rewards)
    np.testing.assert_allclose(res.advantage, [0, 0, 0, 1, -1])
    res = compute("bpo", parents, rewards, root_baseline=0.2)
    np.testing.assert_allclose(res.advantage, [0, 0.3, 0.3, 1, -1])
    np.testing.assert_allclose(res.weight, [0, 1, 1, 0.5, 0.5])


def test_group_of_one_has_zero_advantage():
    res = compute("rloo", [-1, 0, 1], [0.0, 0.0, 1.0])
    np.testing.assert_array_equal(res.advantage, [0, 0, 0])


@pytest.mark.parametrize(
    ("parents", "rewards", "match"),
    [
        ([0, 0], [0, 0], r"parents\[0\] == -1"),
        ([-1, -1, 0], [0, 0, 0], "several roots"),
        ([-1, 2, 1], [0, 0, 0], "not connected to the root"),
        ([-1, 1], [0, 0], "its own parent"),
        ([-1, 0, 0], [0, 0], "rewards has 2"),
        ([-1, 5], [0, 0], "outside 0..1"),
        ([], [], "empty tree"),
        ([-1, 0], [0, float("nan")], "not finite"),
    ],
)
def test_malformed_trees(parents, rewards, match):
    with pytest.raises(TreeError, match=match):
        compute("bpo", parents, rewards)


def test_fingerprint_length_checked():
    with pytest.raises(TreeError, match="fingerprints has 2 entries"):
        compute("gigpo", [-1, 0, 0], [0, 1, 0], fingerprints=["a", "b"])


def test_unknown_estimator_lists_names():
    with pytest.raises(KeyError) as err:
        compute("ppo2", [-1, 0], [0, 1])
    msg = str(err.value)
    for name in ("bpo", "rloo", "grpo", "gigpo"):
        assert name in msg
    assert isinstance(err.value, ValueError)


def test_unknown_option_rejected():
    with pytest.raises(TypeError, match="unknown options"):
        compute("rloo", [-1, 0, 0], [0, 1, 0], gamma=0.9)


def test_registry_rejects_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        estimators.ESTIMATORS.register("bpo")(lambda tree, **kw: None)


def test_gae_on_a_chain_matches_hand_computation():
    # chain 0 -> 1 -> 2, rewards 0 then 1, values V0=0.5, V1=0.6, V2 (terminal leaf) unused
    adv, ret = estimators.gae([-1, 0, 1], [0.0, 0.0, 1.0], [0.5, 0.6, 9.9], gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.6  # terminal: no bootstrap
    d1 = 0.0 + 0.9 * 0.6 - 0.5
    np.testing.assert_allclose(adv, [0, d1 + 0.9 * 0.8 * d2, d2])
    np.testing.assert_allclose(ret[1:], adv[1:] + np.array([0.5, 0.6]))


@pytest.mark.parametrize("name", ["bpo", "grpo", "gigpo"])
def test_std_normalisation_with_eps_zero_on_equal_returns_gives_zero_advantages(name):
    fps = {"fingerprints": ["r", "a", "a"]} if name == "gigpo" else {}
    res = compute(name, [-1, 0, 0], [0.0, 1.0, 1.0], std_normalize=True, eps=0.0, **fps)
    assert np.all(res.advantage == 0.0)
