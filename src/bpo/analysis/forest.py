"""Many sampled trees as one forest: vectorised estimators and per-batch policy gradients.

``bpo.estimators.compute`` works on one tree with Python loops (about a millisecond per tree);
the Monte-Carlo study needs millions of edges. :func:`forest_advantages` computes the same
advantages and weights for thousands of trees at once, level by level with numpy, for the
estimators whose definition it mirrors (:data:`FAST`); :func:`check_against_compute` compares it
with ``compute`` on sampled trees (the study does so on every row and fails loudly on any
difference), and any other registered estimator goes through ``compute`` tree by tree.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from bpo import estimators
from bpo.analysis.mdp import TabularMDP
from bpo.analysis.sampling import SampledTree
from bpo.estimators import EdgeAdvantages, TreeError

__all__ = [
    "FAST",
    "PER_TREE",
    "Forest",
    "accepts",
    "batch_gradients",
    "check_against_compute",
    "forest_advantages",
    "make_forest",
    "root_values",
]


class Forest(NamedTuple):
    """Trees concatenated node-wise; roots keep parent -1."""

    parents: np.ndarray  # [n] int64, global node index of the parent (-1 at roots)
    rewards: np.ndarray  # [n] float64
    states: np.ndarray  # [n] int64
    actions: np.ndarray  # [n] int64
    tree: np.ndarray  # [n] int64, tree index of each node
    roots: np.ndarray  # [T] int64, global index of each root
    levels: list[np.ndarray]  # levels[d] = global indices of nodes at depth d
    num_children: np.ndarray  # [n] int64

    @property
    def num_trees(self) -> int:
        return len(self.roots)


def make_forest(trees: Sequence[SampledTree], mdp: TabularMDP) -> Forest:
    sizes = np.array([len(t.parents) for t in trees], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    parents = np.concatenate([t.parents for t in trees])
    tree = np.repeat(np.arange(len(trees)), sizes)
    parents = np.where(parents >= 0, parents + offsets[tree], -1)
    states = np.concatenate([t.states for t in trees])
    depth = mdp.step[states]
    order = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(int(depth.max()) + 2))
    levels = [order[bounds[d] : bounds[d + 1]] for d in range(len(bounds) - 1)]
    n = len(parents)
    nch = np.bincount(parents[parents >= 0], minlength=n)
    return Forest(
        parents=parents,
        rewards=np.concatenate([t.rewards for t in trees]),
        states=states,
        actions=np.concatenate([t.actions for t in trees]),
        tree=tree,
        roots=offsets,
        levels=levels,
        num_children=nch,
    )


def _values(f: Forest) -> tuple[np.ndarray, np.ndarray]:
    """Q of every node's in-edge and the sum of its children's Q (bottom-up by level)."""
    n = len(f.parents)
    q = np.zeros(n)
    sumq = np.zeros(n)
    for idx in reversed(f.levels[1:]):
        nch = f.num_children[idx]
        v = np.divide(sumq[idx], nch, out=np.zeros(len(idx)), where=nch > 0)
        q[idx] = f.rewards[idx] + v
        np.add.at(sumq, f.parents[idx], q[idx])
    return q, sumq


def root_values(f: Forest) -> np.ndarray:
    """The tree estimate V(root) of every tree ([T]): mean Q over the root's children."""
    _, sumq = _values(f)
    return sumq[f.roots] / np.maximum(f.num_children[f.roots], 1)


def _bpo(
    f: Forest, root_baseline: np.ndarray | None, prior_weight: np.ndarray | None = None
) -> EdgeAdvantages:
    """bpo (``prior_weight`` None) or bpo_prior over the forest, level by level."""
    n = len(f.parents)
    q, sumq = _values(f)
    adv = np.zeros(n)
    weight = np.zeros(n)
    base = np.full(n, np.nan)
    win = np.ones(n)
    prior = np.zeros(n)  # prior_weight * root_baseline at roots (bpo_prior only)
    prior_w = np.zeros(n)
    if root_baseline is not None:
        base[f.roots] = root_baseline
        if prior_weight is not None:
            prior[f.roots] = prior_weight * root_baseline
            prior_w[f.roots] = prior_weight
    for idx in f.levels[1:]:
        u = f.parents[idx]
        k = f.num_children[u]
        br = k >= 2
        mix = br & (prior_w[u] > 0)
        loo = np.where(
            mix,
            (sumq[u] - q[idx] + prior[u]) / np.maximum(k - 1 + prior_w[u], 1e-300),
            (sumq[u] - q[idx]) / np.maximum(k - 1, 1),
        )
        chain = np.where(np.isnan(base[u]), 0.0, q[idx] - base[u])
        adv[idx] = np.where(br, q[idx] - loo, chain)
        base[idx] = np.where(br, loo, base[u]) - f.rewards[idx]
        w = win[u] / np.where(br, k, 1)
        weight[idx] = w
        win[idx] = w
    return EdgeAdvantages(adv, weight)


def _episodes(f: Forest, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Episode id (its first node) of every node, episode returns, group size per tree."""
    below_root = np.ones(len(f.parents), dtype=bool)
    below_root[f.roots] = False
    if np.any(f.num_children[below_root] > 1):
        raise TreeError(f"estimator {name!r} needs independent episodes; a tree branches")
    ep = np.arange(len(f.parents))
    for idx in f.levels[2:]:
        ep[idx] = ep[f.parents[idx]]
    ret = np.bincount(ep, weights=f.rewards, minlength=len(f.parents))
    return ep, ret, f.num_children[f.roots]


def _group_stats(f: Forest, ep_start: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per-tree sum and count of x over the episodes starting at ``ep_start``."""
    t = f.tree[ep_start]
    s = np.bincount(t, weights=x, minlength=f.num_trees)
    c = np.bincount(t, minlength=f.num_trees)
    return s, c


def _group(
    f: Forest, name: str, fingerprints: np.ndarray, options: dict[str, Any]
) -> EdgeAdvantages:
    """rloo / grpo / gigpo over independent groups (mirrors bpo.estimators)."""
    kind = name
    ep, ret, width = _episodes(f, name)
    starts = f.levels[1]
    r = ret[starts]
    s, c = _group_stats(f, starts, r)
    tid = f.tree[starts]
    if kind == "rloo":
        per_ep = np.where(c[tid] >= 2, r - (s[tid] - r) / np.maximum(c[tid] - 1, 1), 0.0)
    else:
        per_ep = r - s[tid] / c[tid]
    if kind == "grpo" and options.get("std_normalize", True):
        ss, _ = _group_stats(f, starts, per_ep**2)
        std = np.sqrt(ss / np.maximum(c - 1, 1))
        eps = options.get("eps", 1e-6)
        per_ep = np.where(c[tid] >= 2, per_ep / (std[tid] + eps), per_ep)
    n = len(f.parents)
    adv_ep = np.zeros(n)
    adv_ep[starts] = per_ep
    adv = adv_ep[ep]
    weight = 1.0 / np.maximum(width[f.tree], 1)
    if kind == "gigpo":
        gamma = options.get("gamma", 0.95)
        rtg = np.zeros(n)
        below = np.zeros(n)
        for idx in reversed(f.levels[1:]):
            rtg[idx] = f.rewards[idx] + gamma * below[idx]
            np.add.at(below, f.parents[idx], rtg[idx])
        nodes = np.flatnonzero(f.parents >= 0)
        anchor = fingerprints[f.parents[nodes]]  # the state each step acts from
        key = f.tree[nodes] * (int(fingerprints.max()) + 1) + anchor
        _, inv = np.unique(key, return_inverse=True)
        gs = np.bincount(inv, weights=rtg[nodes])
        gc = np.bincount(inv)
        step = np.where(gc[inv] >= 2, rtg[nodes] - gs[inv] / gc[inv], 0.0)
        adv[nodes] += options.get("step_weight", 1.0) * step
    adv[f.roots] = 0.0
    weight[f.roots] = 0.0
    return EdgeAdvantages(adv, weight)


FAST = ("bpo", "bpo_prior", "rloo", "grpo", "gigpo")
"""Estimators with a vectorised implementation here (for the options in ``_FAST_OPTIONS``)."""

_FAST_OPTIONS = {
    "bpo": set(),
    "bpo_prior": set(),
    "rloo": set(),
    "grpo": {"std_normalize", "eps"},
    "gigpo": {"gamma", "step_weight"},
}
PER_TREE = ("root_baseline", "prior_weight")
"""Options that may vary per tree (arrays [T]); passed only to estimators that take them."""


def accepts(name: str, option: str) -> bool:
    """Whether registered estimator ``name`` takes keyword ``option``."""
    return option in inspect.signature(estimators.ESTIMATORS.get(name)).parameters


def forest_advantages(
    name: str,
    forest: Forest,
    mdp: TabularMDP,
    *,
    per_tree: dict[str, np.ndarray] | None = None,
    **options: Any,
) -> EdgeAdvantages:
    """Advantages and weights of every node's in-edge over a forest.

    Vectorised for names in :data:`FAST` (with the options it mirrors), otherwise
    ``bpo.estimators.compute`` tree by tree. ``per_tree`` holds options of :data:`PER_TREE`
    as [T] arrays (``root_baseline``: a baseline from earlier iterations per tree;
    ``prior_weight``); each goes only to estimators whose signature has it.
    """
    per_tree = {k: v for k, v in (per_tree or {}).items() if accepts(name, k)}
    fast = name in FAST and set(options) <= _FAST_OPTIONS[name]
    if fast and name in ("bpo", "bpo_prior"):
        rb = per_tree.get("root_baseline")
        pw = per_tree.get("prior_weight")
        if name == "bpo_prior" and rb is not None and pw is None:
            pw = np.ones(forest.num_trees)
        return _bpo(forest, rb, pw if name == "bpo_prior" else None)
    if fast:
        return _group(forest, name, mdp.fingerprint[forest.states], options)
    n = len(forest.parents)
    adv = np.zeros(n)
    weight = np.zeros(n)
    for i, sl in enumerate(_tree_slices(forest)):
        res = compute_one(name, forest, sl, mdp, {**options, **_pick(per_tree, i)})
        adv[sl] = res.advantage
        weight[sl] = res.weight
    return EdgeAdvantages(adv, weight)


def _pick(per_tree: dict[str, np.ndarray], i: int) -> dict[str, float]:
    return {k: float(v[i]) for k, v in per_tree.items()}


def _tree_slices(f: Forest) -> list[slice]:
    ends = np.append(f.roots[1:], len(f.parents))
    return [slice(int(a), int(b)) for a, b in zip(f.roots, ends, strict=True)]


def compute_one(
    name: str, f: Forest, sl: slice, mdp: TabularMDP, options: dict[str, Any]
) -> EdgeAdvantages:
    """``bpo.estimators.compute`` on one tree of the forest (fingerprints = MDP fingerprints)."""
    parents = f.parents[sl] - sl.start
    parents[0] = -1
    return estimators.compute(
        name,
        parents,
        f.rewards[sl],
        fingerprints=[int(x) for x in mdp.fingerprint[f.states[sl]]],
        **options,
    )


def check_against_compute(
    name: str,
    forest: Forest,
    mdp: TabularMDP,
    result: EdgeAdvantages,
    trees: Sequence[int],
    *,
    per_tree: dict[str, np.ndarray] | None = None,
    atol: float = 1e-9,
    **options: Any,
) -> int:
    """Compare ``result`` with ``compute`` on the given trees; raise on any difference.

    Returns the number of edges compared.
    """
    per_tree = {k: v for k, v in (per_tree or {}).items() if accepts(name, k)}
    slices = _tree_slices(forest)
    compared = 0
    for i in trees:
        sl = slices[i]
        ref = compute_one(name, forest, sl, mdp, {**options, **_pick(per_tree, i)})
        for what, got, want in (
            ("advantage", result.advantage[sl], ref.advantage),
            ("weight", result.weight[sl], ref.weight),
        ):
            if not np.allclose(got[1:], want[1:], atol=atol, rtol=0):
                j = int(np.argmax(np.abs(got[1:] - want[1:]))) + 1
                raise AssertionError(
                    f"vectorised {name!r} {what} differs from bpo.estimators.compute on tree {i} "
                    f"node {j}: {got[j]!r} != {want[j]!r}"
                )
        compared += sl.stop - sl.start - 1
    return compared


def batch_gradients(
    forest: Forest,
    result: EdgeAdvantages,
    mdp: TabularMDP,
    batch_of_tree: np.ndarray,
    num_batches: int,
    probs: np.ndarray,
) -> np.ndarray:
    """Per-batch gradient estimates ``mean over the batch's trees of sum_e w A grad log pi``.

    ``batch_of_tree[i]`` is the batch of tree i; returns [num_batches, P * A].
    """
    nodes = np.flatnonzero(forest.parents >= 0)
    s = forest.states[forest.parents[nodes]]  # [E] state each edge acts from
    a = forest.actions[nodes]  # [E]
    trees_per_batch = np.bincount(batch_of_tree, minlength=num_batches)
    b = batch_of_tree[forest.tree[nodes]]  # [E]
    coef = result.weight[nodes] * result.advantage[nodes] / trees_per_batch[b]  # [E]
    n_a = mdp.num_actions
    dim = mdp.num_params * n_a
    row = b * dim + mdp.param_of[s] * n_a  # [E]
    size = num_batches * dim
    g = np.bincount(row + a, weights=coef, minlength=size)
    for col in range(n_a):  # grad log softmax = onehot(a) - pi(.|s)
        g -= np.bincount(row + col, weights=coef * probs[s, col], minlength=size)
    return g.reshape(num_batches, dim)
