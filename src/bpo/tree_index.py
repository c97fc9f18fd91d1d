"""The tree as the advantage estimators read it, and the record they return.

:func:`index_tree` validates a parent array with its edge rewards (node 0 the root, ``parents[i]``
the parent of node ``i``, ``rewards[i]`` the reward on the edge into it) and derives children, a
topological order and depths (:class:`TreeIndex`); :func:`node_values` gives V and Q. Every
estimator (:mod:`bpo.estimators`) takes a :class:`TreeIndex` and keyword options, refuses
options it does not know (:func:`reject_options`), and returns :class:`EdgeAdvantages`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "EdgeAdvantages",
    "TreeError",
    "TreeIndex",
    "index_tree",
    "node_values",
    "reject_options",
]


class TreeError(ValueError):
    """A malformed tree (several roots, a cycle, a dangling parent, lengths that differ)."""


class EdgeAdvantages(NamedTuple):
    advantage: np.ndarray  # [n] float64, advantage of the edge into node i; entry 0 unused
    weight: np.ndarray  # [n] float64, weight of that edge; entry 0 unused


class TreeIndex(NamedTuple):
    """A validated tree with derived structure, shared by the estimators."""

    parents: np.ndarray  # [n] int64, parents[0] == -1
    rewards: np.ndarray  # [n] float64, rewards[0] == 0
    children: list[list[int]]  # children[i], in increasing node order
    order: list[int]  # a topological order (every parent before its children)
    depth: np.ndarray  # [n] int64, root = 0

    @property
    def num_children(self) -> np.ndarray:  # [n] int64
        return np.array([len(c) for c in self.children], dtype=np.int64)


def index_tree(parents: Sequence[int], rewards: Sequence[float]) -> TreeIndex:
    """Validate a parent-array tree and derive children, a topological order and depths.

    Raises :class:`TreeError` naming the problem.
    """
    try:
        p = np.asarray(parents)
        r = np.asarray(rewards, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as e:  # strings, complex, ints over 64 bits
        raise TreeError(
            f"parents must be node indices and rewards real numbers ({type(e).__name__}: {e})"
        ) from None
    if p.dtype.kind not in "iuf":
        raise TreeError(f"parents must be integers (node indices), got dtype {p.dtype}")
    if p.ndim != 1 or r.ndim != 1:
        raise TreeError(f"parents and rewards must be 1-D, got shapes {p.shape} and {r.shape}")
    n = len(p)
    if n == 0:
        raise TreeError("empty tree: parents must hold at least the root (parents[0] == -1)")
    if len(r) != n:
        raise TreeError(f"parents has {n} entries but rewards has {len(r)}; give one per node")
    if not np.issubdtype(p.dtype, np.integer):
        if not np.all(np.equal(np.mod(p, 1), 0)):
            raise TreeError("parents must be integers (node indices)")
        p = p.astype(np.int64)
    p = p.astype(np.int64)
    if p[0] != -1:
        raise TreeError(f"node 0 must be the root (parents[0] == -1), got parents[0] = {p[0]}")
    roots = np.flatnonzero(p == -1)
    if len(roots) > 1:
        raise TreeError(f"several roots: nodes {roots.tolist()} have parent -1; only node 0 may")
    bad = np.flatnonzero((p < -1) | (p >= n))
    if len(bad):
        i = int(bad[0])
        raise TreeError(f"node {i} has parent {p[i]}, outside 0..{n - 1}")
    if n > 1 and np.any(p[1:] == np.arange(1, n)):
        i = int(np.flatnonzero(p[1:] == np.arange(1, n))[0]) + 1
        raise TreeError(f"node {i} is its own parent (a cycle)")
    if not np.all(np.isfinite(r[1:])):
        i = int(np.flatnonzero(~np.isfinite(r[1:]))[0]) + 1
        raise TreeError(f"reward on the edge into node {i} is not finite ({r[i]})")
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[int(p[i])].append(i)
    order = [0]
    depth = np.zeros(n, dtype=np.int64)
    for u in order:  # BFS; the list grows while iterating
        for c in children[u]:
            depth[c] = depth[u] + 1
            order.append(c)
    if len(order) != n:
        unreached = sorted(set(range(n)) - set(order))
        raise TreeError(
            f"nodes {unreached[:10]} are not connected to the root (a cycle in parents)"
        )
    r = r.copy()
    r[0] = 0.0
    return TreeIndex(p, r, children, order, depth)


def node_values(t: TreeIndex) -> tuple[np.ndarray, np.ndarray]:
    """V(x) = mean over children of r_e + V(y) (0 at leaves); Q(e) = r_e + V(y). Both [n]."""
    n = len(t.parents)
    v = np.zeros(n)
    q = np.zeros(n)
    for u in reversed(t.order):
        if t.children[u]:
            v[u] = float(np.mean([q[c] for c in t.children[u]]))
        q[u] = t.rewards[u] + v[u]
    return v, q


def reject_options(name: str, options: dict[str, Any]) -> None:
    """Refuse the options that estimator ``name`` did not take (its ``**options``)."""
    if options:
        raise TypeError(f"estimator {name!r} got unknown options {sorted(options)}")
