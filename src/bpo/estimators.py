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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from bpo.registry import Registry

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


def _inv_std(x: np.ndarray, eps: float) -> float:
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


def _loo_mean(x: np.ndarray) -> np.ndarray:
    """Leave-one-out mean of each entry among the others ([k] -> [k]).

    With fewer than 2 entries there is no other sample: the entry itself is returned, so that
    the advantage ``x - loo`` is 0 (a group reduced to one sample carries no signal).
    """
    k = len(x)
    if k < 2:
        return x.astype(np.float64, copy=True)
    return (x.sum() - x) / (k - 1)


Estimator = Callable[..., EdgeAdvantages]
ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")


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


def _reject(name: str, options: dict[str, Any]) -> None:
    if options:
        raise TypeError(f"estimator {name!r} got unknown options {sorted(options)}")


# --------------------------------------------------------------------------------------------
# BPO


@ESTIMATORS.register("bpo")
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
    _reject("bpo", options)
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
            loo = _loo_mean(qs)
            a = qs - loo
            s = 1.0
            if std_normalize:
                s = _inv_std(qs, eps)
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


@ESTIMATORS.register("rloo")
def rloo(
    tree: TreeIndex, *, fingerprints: Sequence[Any] | None = None, **options: Any
) -> EdgeAdvantages:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): every turn of episode
    i gets ``R_i - mean_{j != i} R_j``; weight 1/N. A group of one gets advantage 0."""
    _reject("rloo", options)
    eps_ = _episodes(tree, "rloo")
    ret = _episode_returns(tree, eps_)
    return _broadcast(len(tree.parents), eps_, ret - _loo_mean(ret))


@ESTIMATORS.register("grpo")
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
    _reject("grpo", options)
    eps_ = _episodes(tree, "grpo")
    ret = _episode_returns(tree, eps_)
    adv = ret - ret.mean() if len(ret) else ret
    if std_normalize and len(ret) >= 2:
        adv = adv * _inv_std(ret, eps)
    return _broadcast(len(tree.parents), eps_, adv)


@ESTIMATORS.register("gigpo")
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
    _reject("gigpo", options)
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
            centred = centred * _inv_std(x, eps)
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


@ESTIMATORS.register("bpo_prior")
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
