"""Advantage estimators over rollout trees (DESIGN section 4), one registry, one signature.

Public contract (other code and outside checks rely on it)::

    compute(name, parents, rewards, *, fingerprints=None, **options) -> EdgeAdvantages

* node 0 is the root (``parents[0] == -1``); ``parents[i]`` is the parent of node ``i``;
* ``rewards[i]`` is the reward on the edge into node ``i`` (``rewards[0]`` is ignored);
* leaves are the nodes without children; every node is a sandbox state, every edge a turn;
* the result holds two float64 arrays indexed by node (entry 0 unused, set to 0): the
  advantage of the edge into each node and its weight in the policy-gradient sum
  ``sum_e w(e) * A(e) * grad log pi(a_e | s_parent(e))``.

``bpo`` accepts any tree. ``rloo``, ``grpo`` and ``gigpo`` take the root's children as the group
of independent episodes and refuse trees that branch anywhere else. Every estimator is a pure
function of the tree: no trainer state, no torch.

The estimators are in :mod:`bpo.tree_estimators` (``bpo``, ``bpo_prior``; PPO's :func:`gae`)
and :mod:`bpo.group_estimators` (``rloo``, ``grpo``, ``gigpo``), the tree they read and the
record they return in :mod:`bpo.tree_index`; this module is the registry and the entry point,
and re-exports those names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bpo.group_estimators import gigpo, grpo, rloo
from bpo.registry import Registry
from bpo.tree_estimators import bpo, bpo_prior, gae
from bpo.tree_index import EdgeAdvantages, TreeError, TreeIndex, index_tree, node_values

__all__ = [
    "ESTIMATORS",
    "EdgeAdvantages",
    "TreeError",
    "TreeIndex",
    "compute",
    "gae",
    "index_tree",
    "names",
    "node_values",
]


Estimator = Callable[..., EdgeAdvantages]
ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")
ESTIMATORS.register("bpo")(bpo)
ESTIMATORS.register("rloo")(rloo)
ESTIMATORS.register("grpo")(grpo)
ESTIMATORS.register("gigpo")(gigpo)
ESTIMATORS.register("bpo_prior")(bpo_prior)  # appended by the estimator-verification study


def compute(
    name: str,
    parents: Sequence[int],
    rewards: Sequence[float],
    *,
    fingerprints: Sequence[Any] | None = None,
    **options: Any,
) -> EdgeAdvantages:
    """Advantages and weights of every edge of one tree under estimator ``name``."""
    fn = ESTIMATORS.get(name)
    tree = index_tree(parents, rewards)
    if fingerprints is not None and len(fingerprints) != len(tree.parents):
        raise TreeError(
            f"fingerprints has {len(fingerprints)} entries but the tree has "
            f"{len(tree.parents)} nodes; give one per node (the state each node stands for)"
        )
    out = fn(tree, fingerprints=fingerprints, **options)
    if not (np.all(np.isfinite(out.advantage)) and np.all(np.isfinite(out.weight))):
        raise TreeError(
            f"estimator {name!r} gave non-finite advantages: the returns overflow float64 "
            f"(largest |reward| {float(np.abs(tree.rewards).max()):g}); rescale the rewards"
        )
    return out


def names() -> list[str]:
    return ESTIMATORS.names()
