"""Property tests of the advantage estimators (bpo.estimators.compute).

* valid trees (any shape, any node numbering) give finite arrays of one entry per node; the
  weights of each sibling group sum to the weight of the edge into their parent (1 at the
  root), so the leaves' weights sum to 1; BPO's sibling advantages sum to 0 at every branch
  node; on an independent group (root-only branching) ``bpo`` equals ``rloo`` and GRPO without
  std normalisation is RLOO scaled by (N - 1) / N;
* malformed input (dangling or self parents, cycles, several roots, lengths that differ,
  non-numbers, huge integers, non-finite rewards, returns that overflow float64) raises
  TreeError, unknown options TypeError; never IndexError, RecursionError or a hang.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bpo.estimators import TreeError, compute, index_tree

# malformed and extreme inputs make numpy warn (overflow, invalid casts) on their way to a
# TreeError; the warnings are expected here
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
SETTINGS = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
REWARD = st.one_of(
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 1.0, -1.0]),
)


@st.composite
def trees(draw, max_nodes: int = 40) -> tuple[list[int], list[float]]:
    """A random valid tree: node 0 the root, other nodes numbered in any order."""
    n = draw(st.integers(1, max_nodes))
    topo = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]  # parent before child
    perm = [0, *draw(st.permutations(range(1, n)))]  # relabel: new id of topological node i
    parents = [0] * n
    for i in range(n):
        parents[perm[i]] = -1 if i == 0 else perm[topo[i]]
    rewards = draw(st.lists(REWARD, min_size=n, max_size=n))
    return parents, rewards


@st.composite
def groups(draw) -> tuple[list[int], list[float]]:
    """An independent group: the root with N >= 1 children, each a chain (no other branching)."""
    lengths = draw(st.lists(st.integers(1, 5), min_size=1, max_size=8))
    parents, rewards = [-1], [0.0]
    for length in lengths:
        prev = 0
        for _ in range(length):
            parents.append(prev)
            rewards.append(draw(REWARD))
            prev = len(parents) - 1
    return parents, rewards


def _children(parents: list[int]) -> list[list[int]]:
    ch: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            ch[p].append(i)
    return ch


def _check_shape_and_weights(parents, result) -> None:
    n = len(parents)
    for arr in result:
        assert isinstance(arr, np.ndarray) and arr.shape == (n,) and arr.dtype == np.float64
        assert np.all(np.isfinite(arr)), arr
    adv, w = result
    assert adv[0] == 0.0 and w[0] == 0.0  # entry 0 unused
    ch = _children(parents)
    for u, kids in enumerate(ch):
        if kids:
            parent_w = 1.0 if u == 0 else w[u]
            assert w[kids].sum() == pytest.approx(parent_w, rel=1e-9, abs=1e-12)
    leaves = [u for u in range(1, n) if not ch[u]]
    if leaves:
        assert w[leaves].sum() == pytest.approx(1.0, rel=1e-9)


@SETTINGS
@given(
    tree=trees(),
    std_normalize=st.booleans(),
    root_baseline=st.one_of(st.none(), st.floats(-1e6, 1e6)),
    reward_to_go=st.booleans(),
)
def test_bpo_on_any_valid_tree(tree, std_normalize, root_baseline, reward_to_go):
    parents, rewards = tree
    res = compute(
        "bpo", parents, rewards, std_normalize=std_normalize, root_baseline=root_baseline,
        reward_to_go=reward_to_go,
    )  # fmt: skip
    _check_shape_and_weights(parents, res)
    # rounding bound: returns are at most sum |r|; std normalisation scales by up to 1 / eps
    tol = 1e-9 * max(1.0, float(np.abs(rewards).sum())) * (1e6 if std_normalize else 1.0)
    for kids in _children(parents):
        if len(kids) >= 2:  # leave-one-out advantages of a sibling group sum to zero
            assert res.advantage[kids].sum() == pytest.approx(0.0, abs=tol)


@SETTINGS
@given(tree=trees())
def test_bpo_prior_without_a_baseline_is_bpo(tree):
    parents, rewards = tree
    a, b = compute("bpo", parents, rewards), compute("bpo_prior", parents, rewards)
    np.testing.assert_array_equal(a.advantage, b.advantage)
    np.testing.assert_array_equal(a.weight, b.weight)


@SETTINGS
@given(group=groups(), fingerprints=st.data())
def test_group_estimators_on_independent_groups(group, fingerprints):
    parents, rewards = group
    n_eps = len(_children(parents)[0])
    bpo, rloo = compute("bpo", parents, rewards), compute("rloo", parents, rewards)
    _check_shape_and_weights(parents, rloo)
    np.testing.assert_allclose(bpo.advantage, rloo.advantage, rtol=1e-9, atol=1e-6)
    np.testing.assert_allclose(bpo.weight, rloo.weight, rtol=1e-12)
    grpo = compute("grpo", parents, rewards, std_normalize=False)
    _check_shape_and_weights(parents, grpo)
    np.testing.assert_allclose(
        grpo.advantage, rloo.advantage * (n_eps - 1) / n_eps, rtol=1e-9, atol=1e-6
    )
    _check_shape_and_weights(parents, compute("grpo", parents, rewards))
    fp = fingerprints.draw(
        st.lists(st.integers(0, 3), min_size=len(parents), max_size=len(parents))
    )
    _check_shape_and_weights(parents, compute("gigpo", parents, rewards, fingerprints=fp))


@SETTINGS
@given(tree=trees())
def test_group_estimators_refuse_trees_that_branch_below_the_root(tree):
    parents, rewards = tree
    branching = any(len(k) >= 2 for k in _children(parents)[1:])
    for name in ("rloo", "grpo"):
        if branching:
            with pytest.raises(TreeError, match="independent episodes"):
                compute(name, parents, rewards)
        else:
            _check_shape_and_weights(parents, compute(name, parents, rewards))


NAMES = ("bpo", "rloo", "grpo", "gigpo", "bpo_prior")
JUNK_ITEM = st.one_of(
    st.integers(-3, 50),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.just(2**70),
    st.complex_numbers(max_magnitude=2),
)


def _tree_error_or_valid(name, parents, rewards, **kw) -> None:
    try:
        res = compute(name, parents, rewards, **kw)
    except TreeError as e:
        assert str(e).strip()
        return
    _check_shape_and_weights(list(np.asarray(parents, dtype=np.int64)), res)


@settings(SETTINGS, max_examples=300)
@given(
    name=st.sampled_from(NAMES),
    parents=st.lists(st.integers(-3, 12), max_size=14),
    rewards=st.lists(st.floats(), max_size=14),
)
def test_malformed_integer_arrays_raise_tree_error(name, parents, rewards):
    fp = list(range(len(parents))) if name == "gigpo" else None
    _tree_error_or_valid(name, parents, rewards, fingerprints=fp)


@settings(SETTINGS, max_examples=300)
@given(
    name=st.sampled_from(NAMES),
    parents=st.lists(JUNK_ITEM, max_size=8),
    rewards=st.lists(JUNK_ITEM, max_size=8),
)
@example(name="bpo", parents=[-1, "a"], rewards=[0, 1])  # numpy TypeError on strings
@example(name="bpo", parents=[-1, 2**70], rewards=[0, 1])  # OverflowError
@example(name="rloo", parents=[-1, 0], rewards=[0, "x"])  # ValueError from float("x")
@example(name="grpo", parents=[-1, 0], rewards=[0, 1j])  # TypeError on complex
def test_malformed_values_raise_tree_error(name, parents, rewards):
    fp = list(range(len(parents))) if name == "gigpo" else None
    _tree_error_or_valid(name, parents, rewards, fingerprints=fp)


@pytest.mark.parametrize("name", ["bpo", "rloo", "grpo", "gigpo"])
def test_returns_that_overflow_float64_are_a_tree_error(name):
    """Finite rewards whose sums overflow float64 must not turn into NaN advantages silently."""
    parents = [-1, 0, 0, 1, 2]
    rewards = [0.0, 1e308, -1e308, 1e308, -1e308]
    fp = [0, 1, 1, 2, 2]
    _tree_error_or_valid(name, parents, rewards, fingerprints=fp)


@pytest.mark.parametrize(
    ("parents", "rewards", "match"),
    [
        ([], [], "empty tree"),
        ([0, 0], [0, 1], "root"),
        ([-1, -1], [0, 1], "several roots"),
        ([-1, 5], [0, 1], "outside"),
        ([-1, 1], [0, 1], "own parent"),
        ([-1, 2, 1], [0, 1, 1], "not connected"),
        ([-1, 0], [0], "rewards has 1"),
        ([-1, 0.5], [0, 1], "integers"),
        ([-1, 0], [0, float("nan")], "not finite"),
        ([[-1, 0]], [[0, 1]], "1-D"),
    ],
)
def test_named_malformations(parents, rewards, match):
    for name in NAMES:
        with pytest.raises(TreeError, match=match):
            compute(name, parents, rewards, fingerprints=None if name != "gigpo" else [0] * 9)


def test_unknown_options_are_type_errors():
    for name in ("bpo", "rloo", "grpo", "gigpo"):
        with pytest.raises(TypeError, match="unknown options"):
            compute(name, [-1, 0, 0], [0, 1, 0], fingerprints=[0, 1, 1], no_such_option=1)


def test_deep_and_cyclic_trees_neither_recurse_nor_hang():
    """A 50,000-step chain and a 50,000-node cycle: linear time, no RecursionError."""
    n = 50_000
    chain = [-1, *range(n - 1)]
    rewards = [0.0] * (n - 1) + [1.0]
    t0 = time.perf_counter()
    for name in ("bpo", "rloo", "grpo"):
        res = compute(name, chain, rewards)
        assert np.all(np.isfinite(res.advantage)) and res.weight[-1] == 1.0
    cycle = [-1, *range(2, n), 1]  # 1 -> 2 -> ... -> n-1 -> 1, never reaching the root
    with pytest.raises(TreeError, match="not connected"):
        index_tree(cycle, [0.0] * n)
    assert time.perf_counter() - t0 < 30.0
