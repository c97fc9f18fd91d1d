"""Advantage estimators over a group of independent episodes: RLOO, GRPO and GiGPO.

The root's children are the group, each a chain (one episode); trees that branch below the root
are refused. Also the group statistics that BPO's sibling groups use too: the leave-one-out
mean and the standard-deviation normalisation. Pure functions of the tree, registered in
:mod:`bpo.estimators`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from bpo.tree_index import EdgeAdvantages, TreeError, TreeIndex, reject_options

__all__ = ["gigpo", "grpo", "inv_std", "loo_mean", "rloo"]


# --------------------------------------------------------------------------------------------
# Group statistics (BPO's sibling groups use them too)


def inv_std(x: np.ndarray, eps: float) -> float:
    """``1 / (sample std + eps)`` for std normalisation; 1 when that is not finite or not
    positive (a group of equal values, whose centred advantages are all 0 anyway, with
    ``eps = 0``)."""
    d = float(np.std(x, ddof=1)) + eps
    if not d > 0:
        return 1.0
    try:
        inv = 1.0 / d
    except OverflowError:  # a subnormal d
        return 1.0
    return inv if math.isfinite(inv) else 1.0


def loo_mean(x: np.ndarray) -> np.ndarray:
    """Leave-one-out mean of each entry among the others ([k] -> [k]).

    With fewer than 2 entries there is no other sample: the entry itself is returned, so that
    the advantage ``x - loo`` is 0 (a group reduced to one sample carries no signal).
    """
    k = len(x)
    if k < 2:
        return x.astype(np.float64, copy=True)
    return (x.sum() - x) / (k - 1)


# --------------------------------------------------------------------------------------------
# Independent-episode group estimators


def _episodes(tree: TreeIndex, name: str) -> list[list[int]]:
    """The root's children as a group of independent episodes: one node path per episode.

    Refuses trees that branch below the root.
    """
    k = tree.num_children
    branching = [u for u in range(1, len(k)) if k[u] > 1]
    if branching:
        raise TreeError(
            f"estimator {name!r} needs independent episodes (the root's children, each a chain), "
            f"but node {branching[0]} has {k[branching[0]]} children; use 'bpo' for trees"
        )
    episodes = []
    for c in tree.children[0]:
        path = [c]
        while tree.children[path[-1]]:
            path.append(tree.children[path[-1]][0])
        episodes.append(path)
    return episodes


def _episode_returns(tree: TreeIndex, episodes: list[list[int]]) -> np.ndarray:
    return np.array([tree.rewards[path].sum() for path in episodes])  # [N]


def _broadcast(n: int, episodes: list[list[int]], per_episode: np.ndarray) -> EdgeAdvantages:
    adv = np.zeros(n)
    weight = np.zeros(n)
    for path, a in zip(episodes, per_episode, strict=True):
        adv[path] = a
        weight[path] = 1.0 / len(episodes)
    return EdgeAdvantages(adv, weight)


def rloo(
    tree: TreeIndex, *, fingerprints: Sequence[Any] | None = None, **options: Any
) -> EdgeAdvantages:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): every turn of episode
    i gets ``R_i - mean_{j != i} R_j``; weight 1/N. A group of one gets advantage 0."""
    reject_options("rloo", options)
    eps_ = _episodes(tree, "rloo")
    ret = _episode_returns(tree, eps_)
    return _broadcast(len(tree.parents), eps_, ret - loo_mean(ret))


def grpo(
    tree: TreeIndex,
    *,
    fingerprints: Sequence[Any] | None = None,
    std_normalize: bool = True,
    eps: float = 1e-6,
    **options: Any,
) -> EdgeAdvantages:
    """GRPO (Shao et al. 2024): ``(R_i - mean_j R_j) / (std_j R_j + eps)`` with the mean over
    the whole group, the sample included (biased by a factor (N-1)/N against RLOO), and the
    sample standard deviation as in the reference implementations. ``std_normalize=False``
    gives Dr. GRPO's unnormalised variant (Liu et al. 2025)."""
    reject_options("grpo", options)
    eps_ = _episodes(tree, "grpo")
    ret = _episode_returns(tree, eps_)
    adv = ret - ret.mean() if len(ret) else ret
    if std_normalize and len(ret) >= 2:
        adv = adv * inv_std(ret, eps)
    return _broadcast(len(tree.parents), eps_, adv)


def gigpo(
    tree: TreeIndex,
    *,
    fingerprints: Sequence[Any] | None = None,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    std_normalize: bool = False,
    eps: float = 1e-6,
    **options: Any,
) -> EdgeAdvantages:
    """GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training").

    ``A = A_episode + step_weight * A_step``, where A_episode is the episode's return minus the
    group mean and A_step groups the *steps* of all episodes that act from the same sandbox
    state (same fingerprint of the edge's parent node: an "anchor state"), comparing each
    step's discounted return-to-go with the mean of its anchor group. Singleton anchor groups
    get A_step = 0. ``std_normalize`` divides each term by its group's standard deviation
    (the paper's default normalisation; off here so that all methods share one scale).
    """
    reject_options("gigpo", options)
    if fingerprints is None:
        raise TreeError(
            "estimator 'gigpo' needs fingerprints (one per node: the sandbox state it stands "
            "for) to find identical anchor states across episodes"
        )
    eps_ = _episodes(tree, "gigpo")
    n = len(tree.parents)
    ret = _episode_returns(tree, eps_)

    def norm(x: np.ndarray) -> np.ndarray:
        centred = x - x.mean()
        if std_normalize and len(x) >= 2:
            centred = centred * inv_std(x, eps)
        return centred

    ep_adv = norm(ret) if len(ret) else ret
    # Discounted return-to-go of every step (edge), per episode.
    rtg = np.zeros(n)
    for path in eps_:
        acc = 0.0
        for node in reversed(path):
            acc = tree.rewards[node] + gamma * acc
            rtg[node] = acc
    groups: dict[Any, list[int]] = {}
    for path in eps_:
        for node in path:
            parent = int(tree.parents[node])
            groups.setdefault(_hashable(fingerprints[parent]), []).append(node)
    step_adv = np.zeros(n)
    for members in groups.values():
        if len(members) >= 2:
            step_adv[members] = norm(rtg[members])
    result = _broadcast(n, eps_, ep_adv)
    adv = result.advantage + step_weight * step_adv
    adv[0] = 0.0
    return EdgeAdvantages(adv, result.weight)


def _hashable(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tobytes()
    if isinstance(x, list):
        return tuple(x)
    return x
