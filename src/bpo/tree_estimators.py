"""Advantage estimators over any tree: BPO (sibling leave-one-out baselines) and its
variant with a prior root baseline (``bpo_prior``), registered in :mod:`bpo.estimators`; and
PPO's GAE over the turns of a tree, which needs a critic's values and is not in the registry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bpo.group_estimators import inv_std, loo_mean
from bpo.tree_index import (
    EdgeAdvantages,
    TreeError,
    TreeIndex,
    index_tree,
    node_values,
    reject_options,
)

__all__ = ["bpo", "bpo_prior", "gae"]


# --------------------------------------------------------------------------------------------
# BPO


def bpo(
    tree: TreeIndex,
    *,
    fingerprints: Sequence[Any] | None = None,
    root_baseline: float | None = None,
    std_normalize: bool = False,
    eps: float = 1e-6,
    reward_to_go: bool = False,
    **options: Any,
) -> EdgeAdvantages:
    """Sibling leave-one-out advantages over any tree (DESIGN section 4).

    * an edge out of a branch node (K >= 2 children) gets Q(e) minus the mean Q of its siblings;
    * an edge out of a single-child node inherits the baseline of its nearest branch ancestor b:
      ``LOO-mean at b (without the edge f towards it) - rewards collected from b down to it``,
      which equals A(f) for the chain below f;
    * edges with no branch ancestor get ``Q(e) - root_baseline`` when a baseline from earlier
      iterations is given, otherwise advantage 0 (no sibling baseline exists for them);
    * weight = product of 1/K over the branch ancestors of the edge (its parent included).

    ``std_normalize`` divides each sibling group's advantages by the group's standard
    deviation (biased; off by default, as in Dr. GRPO, Liu et al. 2025).

    ``reward_to_go`` (unbiased, off by default): an edge out of a single-child node gets
    ``Q(e) - LOO mean at b`` instead, i.e. the rewards collected between b and the edge are not
    subtracted from the baseline. Both baselines use only the siblings and the prefix; this one
    leaves a turn's advantage free of the per-turn rewards (e.g. invalid-action penalties) of
    the turns before it in the chain, so that an immediate penalty is credited to its own turn
    and the turns before it, not to the turns after it.
    """
    reject_options("bpo", options)
    keep = 0.0 if reward_to_go else 1.0
    _, q = node_values(tree)
    n = len(tree.parents)
    k = tree.num_children
    adv = np.zeros(n)
    weight = np.zeros(n)
    # base[u] = the baseline that an edge out of single-child node u would get, expressed as
    # (LOO mean at the nearest branch ancestor) - (rewards from that ancestor down to u);
    # weight_in[u] = product of 1/K over branch nodes strictly above u.
    base = np.full(n, np.nan)
    scale = np.ones(n)
    weight_in = np.ones(n)
    if root_baseline is not None:
        base[0] = float(root_baseline)
    for u in tree.order:
        ch = tree.children[u]
        if not ch:
            continue
        w_u = weight_in[u] / (k[u] if k[u] >= 2 else 1)
        if k[u] >= 2:
            qs = q[ch]
            loo = loo_mean(qs)
            a = qs - loo
            s = 1.0
            if std_normalize:
                s = inv_std(qs, eps)
            for c, b, ai in zip(ch, loo, a, strict=True):
                adv[c] = ai * s
                base[c] = b - keep * tree.rewards[c]
                scale[c] = s
        else:
            (c,) = ch
            if np.isnan(base[u]):
                adv[c] = 0.0
            else:
                adv[c] = (q[c] - base[u]) * scale[u]
            base[c] = base[u] - keep * tree.rewards[c]
            scale[c] = scale[u]
        for c in ch:
            weight[c] = w_u
            weight_in[c] = w_u
    return EdgeAdvantages(adv, weight)


# --------------------------------------------------------------------------------------------
# PPO's GAE: not in the registry (it needs a critic's values, not only the tree)


def gae(
    parents: Sequence[int],
    rewards: Sequence[float],
    values: Sequence[float],
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over the turns of a tree (Schulman et al. 2016).

    ``values[i]`` is the critic's value of state i; terminal leaves bootstrap with 0. For a
    node with several children the lambda-return is averaged over the children (each child
    equally), which for chains is ordinary GAE. Returns ``(advantages, returns)`` indexed by
    node, entry 0 unused; returns = advantages + values[parent] (the critic's target).
    """
    t = index_tree(parents, rewards)
    v = np.asarray(values, dtype=np.float64)
    if len(v) != len(t.parents):
        raise TreeError(f"values has {len(v)} entries but the tree has {len(t.parents)} nodes")
    n = len(v)
    adv = np.zeros(n)
    for u in reversed(t.order):
        if u == 0:
            continue
        ch = t.children[u]
        nxt_v = v[u] if ch else 0.0
        delta = t.rewards[u] + gamma * nxt_v - v[t.parents[u]]
        nxt_adv = float(np.mean(adv[ch])) if ch else 0.0
        adv[u] = delta + gamma * lam * nxt_adv
    ret = np.zeros(n)
    ret[1:] = adv[1:] + v[t.parents[1:]]
    return adv, ret


# --------------------------------------------------------------------------------------------
# Variants (appended by the estimator-verification study; see BENCHMARKS.md)


def bpo_prior(
    tree: TreeIndex,
    *,
    fingerprints: Sequence[Any] | None = None,
    root_baseline: float | None = None,
    prior_weight: float = 1.0,
    **options: Any,
) -> EdgeAdvantages:
    """BPO whose root-level baseline also uses a per-task baseline from earlier iterations.

    The root's children (and the chain segments below them, which inherit their advantage)
    get the baseline ``(sum_{j != i} Q_j + prior_weight * root_baseline) / (W - 1 +
    prior_weight)`` instead of the leave-one-out mean over the other W - 1 root children.
    ``root_baseline`` must come from samples independent of this tree (e.g. the mean return
    of the task's trees in an earlier iteration), so the estimator stays unbiased for any
    ``prior_weight``; the inverse-variance choice is the number of root-level samples that
    ``root_baseline`` averages. Without ``root_baseline`` this is exactly ``bpo``; with
    ``root_width = 1`` it is ``bpo`` with that ``root_baseline``; on an independent group
    (``root_width = N``, no other branching) it is RLOO with the same prior.
    """
    if options.get("std_normalize"):
        raise TypeError("estimator 'bpo_prior' does not support std_normalize; use 'bpo'")
    options.pop("std_normalize", None)
    res = bpo(tree, fingerprints=fingerprints, root_baseline=root_baseline, **options)
    ch = tree.children[0]
    if root_baseline is None or len(ch) < 2:
        return res
    if prior_weight <= 0:
        raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
    _, q = node_values(tree)
    qs = q[ch]  # [W]
    mixed = (qs.sum() - qs + prior_weight * float(root_baseline)) / (len(ch) - 1 + prior_weight)
    adv = res.advantage.copy()
    for c, b in zip(ch, mixed, strict=True):
        delta = (q[c] - b) - adv[c]
        node = c
        while True:  # the chain segment below c inherits A(c)
            adv[node] += delta
            if len(tree.children[node]) != 1:
                break
            node = tree.children[node][0]
    return EdgeAdvantages(adv, res.weight)
