"""Tree records: incremental contexts, flattening, statistics."""

import pytest

from bpo.tree import Tree, Turn, flatten, tree_stats


def turn(ids, reward=0.0, done=False):
    return Turn(
        tuple(ids),
        tuple(-0.1 * (i + 1) for i in range(len(ids))),
        (0.5,) * len(ids),
        "a",
        reward,
        terminated=done,
    )


def build():
    # root context [1, 2]; K=2 at the root; the first child branches again (K=2)
    t = Tree("task")
    t.add_root([1, 2])
    a = t.add_child(0, turn([10]), obs_ids=[3])
    b = t.add_child(0, turn([11], reward=1.0, done=True), obs_ids=[4])
    c = t.add_child(a, turn([12], reward=1.0, done=True), obs_ids=[5])
    d = t.add_child(a, turn([13], done=True), obs_ids=[6])
    t.nodes[0].branch_k, t.nodes[a].branch_k = 2, 2
    t.nodes[0].entropy, t.nodes[a].entropy = 1.2, 0.8
    return t, (a, b, c, d)


def test_context_is_incremental_and_shared():
    t, (a, _b, c, d) = build()
    assert t.context(0) == [1, 2]
    assert t.context(a) == [1, 2, 10, 3]
    assert t.context(c) == [1, 2, 10, 3, 12, 5]
    assert t.context(d)[:4] == t.context(c)[:4]


def test_context_reset_starts_over():
    t = Tree("x")
    t.add_root([1, 2])
    a = t.add_child(0, turn([9]), obs_ids=[7, 8], context_reset=True)
    assert t.context(a) == [7, 8]


def test_flatten_gives_advantages_and_weights_per_edge():
    t, (a, b, c, _d) = build()
    recs = flatten([t, t], "bpo")
    assert len(recs) == 8
    by_node = {r.node: r for r in recs if r.tree == 0}
    # Q(c)=1, Q(d)=0 -> V(a)=0.5; Q(b)=1 -> A(a)=-0.5, A(b)=0.5, A(c)=1, A(d)=-1
    assert by_node[a].advantage == pytest.approx(-0.5)
    assert by_node[b].advantage == pytest.approx(0.5)
    assert by_node[c].advantage == pytest.approx(1.0)
    assert by_node[c].weight == pytest.approx(0.25)
    assert by_node[c].context_ids == (1, 2, 10, 3)
    assert by_node[c].action_ids == (12,)
    assert by_node[c].old_logprobs == (pytest.approx(-0.1),)
    assert len(flatten([t], "bpo", drop_zero=True)) == 4


def test_stats_and_returns():
    t, _ = build()
    s = tree_stats(t)
    assert (s.nodes, s.leaves, s.branch_nodes, s.sibling_groups_all_equal) == (5, 3, 2, 0)
    assert s.branch_depths == (0, 1)
    assert s.branch_entropies == (1.2, 0.8)
    assert s.success == pytest.approx(2 / 3)
    assert sorted(t.returns().tolist()) == [0.0, 1.0, 1.0]


def test_episode_leaves_follow_first_children():
    t, (_a, b, c, _d) = build()
    assert t.episode_leaves() == [c, b]  # root child a continues to c (its first child), b ends
    # the metric is the mean over those episodes, not over all leaves (1 and 2/3 here)
    from bpo.metrics import tree_metrics

    m = tree_metrics([t])
    assert m["rollout/episode_success"] == pytest.approx(1.0)
    assert m["rollout/success"] == pytest.approx(2 / 3)


def test_terminal_nodes_cannot_grow_and_turn_lengths_checked():
    t, (_, b, _, _) = build()
    with pytest.raises(ValueError, match="terminal"):
        t.add_child(b, turn([1]))
    with pytest.raises(ValueError, match="must be equal"):
        Turn((1, 2), (0.0,), (0.0, 0.0), "x", 0.0)


def test_dict_round_trip():
    t, _ = build()
    d = t.to_dict(advantages=[0.0] * len(t))
    back = Tree.from_dict(d)
    assert back.to_dict(advantages=[0.0] * len(t)) == d
    assert back.context(3) == t.context(3)
    assert [n.children for n in back.nodes] == [n.children for n in t.nodes]
