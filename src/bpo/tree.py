"""Rollout trees: nodes are sandbox states, edges are turns (DESIGN section 2).

A :class:`Tree` is the one record that rollout engines produce and the learner consumes. Token
ids are stored exactly as sampled (never re-tokenised), and contexts are stored *incrementally*:
the context a policy saw at node ``i`` is

    context(i) = context(parent(i)) + action(edge into i) + node[i].obs_ids

unless ``node[i].context_reset`` (the prompt builder truncated history), in which case
``obs_ids`` is the whole context. Siblings therefore share their prefix by construction, which is
what lets the policy and the learner compute it once.

:func:`flatten` turns a batch of trees into per-edge training records (context, action, sampling
log-probs, advantage, weight) using an estimator from :mod:`bpo.estimators`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bpo import estimators

__all__ = ["EdgeRecord", "Node", "Tree", "TreeStats", "Turn", "flatten", "tree_stats"]


@dataclass(frozen=True)
class Turn:
    """One policy decision: the edge from a state to the next."""

    action_ids: tuple[int, ...]
    """Tokens exactly as sampled (eos/end-of-turn included when it was sampled)."""
    logprobs: tuple[float, ...]
    """Log-probability of each action token under the sampling policy."""
    entropies: tuple[float, ...]
    """Entropy of the sampling distribution at each action token."""
    action_text: str
    """The decoded text, as sent (after parsing) to the sandbox."""
    reward: float
    terminated: bool = False
    truncated: bool = False
    policy_version: int = 0
    """Which weights sampled it (asynchronous rollouts must not mix versions in one tree)."""
    penalty: float = 0.0
    """Reward shaping already subtracted from ``reward`` (an invalid action's penalty): the
    sandbox's own reward is ``reward + penalty``."""

    def __post_init__(self) -> None:
        if not (len(self.action_ids) == len(self.logprobs) == len(self.entropies)):
            raise ValueError(
                f"turn has {len(self.action_ids)} action tokens, {len(self.logprobs)} log-probs "
                f"and {len(self.entropies)} entropies; they must be equal"
            )


@dataclass
class Node:
    """A sandbox state."""

    parent: int
    """Index of the parent node; -1 for the root."""
    turn: Turn | None
    """The edge into this node (None for the root)."""
    obs_ids: tuple[int, ...]
    """Context tokens appended after the parent's action (see the module docstring)."""
    observation: str = ""
    fingerprint: str | None = None
    context_reset: bool = False
    children: list[int] = field(default_factory=list)
    entropy: float | None = None
    """Turn entropy of the policy at this state, when it acted here (for branch statistics)."""
    branch_k: int = 1
    """Children the branch rule asked for here (1 = not a branch point)."""
    step: int = 0
    """Actions taken on the path from the root to this state."""

    @property
    def terminal(self) -> bool:
        return self.turn is not None and (self.turn.terminated or self.turn.truncated)


@dataclass
class Tree:
    """A rollout tree for one task (N independent episodes = root with N children)."""

    task: str
    seed: int = 0
    nodes: list[Node] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form per-tree counters (compute used, wall time, ...), filled by rollout engines."""

    # -- building -------------------------------------------------------------------------
    def add_root(
        self, obs_ids: Sequence[int], observation: str = "", fingerprint: str | None = None
    ) -> int:
        if self.nodes:
            raise ValueError("tree already has a root")
        self.nodes.append(Node(-1, None, tuple(obs_ids), observation, fingerprint))
        return 0

    def add_child(
        self,
        parent: int,
        turn: Turn,
        obs_ids: Sequence[int] = (),
        observation: str = "",
        fingerprint: str | None = None,
        context_reset: bool = False,
    ) -> int:
        if not 0 <= parent < len(self.nodes):
            raise IndexError(
                f"parent {parent} is not a node of this tree ({len(self.nodes)} nodes)"
            )
        if self.nodes[parent].terminal:
            raise ValueError(f"node {parent} is terminal; it cannot have children")
        idx = len(self.nodes)
        node = Node(parent, turn, tuple(obs_ids), observation, fingerprint, context_reset)
        node.step = self.nodes[parent].step + 1
        self.nodes.append(node)
        self.nodes[parent].children.append(idx)
        return idx

    def truncate(self, n: int) -> None:
        """Remove nodes ``n`` and later (a rollout abandoned after a fault): nodes are added in
        order, so they are exactly the nodes that rollout created."""
        if not 1 <= n <= len(self.nodes):
            raise IndexError(f"cannot keep {n} of {len(self.nodes)} nodes (the root stays)")
        for i in range(len(self.nodes) - 1, n - 1, -1):
            parent = self.nodes[i].parent
            if parent < n:
                self.nodes[parent].children.remove(i)
        del self.nodes[n:]

    # -- views ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def parents(self) -> np.ndarray:  # [n]
        return np.array([n.parent for n in self.nodes], dtype=np.int64)

    def rewards(self) -> np.ndarray:  # [n]
        return np.array([0.0 if n.turn is None else n.turn.reward for n in self.nodes])

    def fingerprints(self) -> list[str | None]:
        return [n.fingerprint for n in self.nodes]

    def leaves(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if not n.children]

    def episode_leaves(self) -> list[int]:
        """The leaf of each root child's first-child path: one on-policy episode per root child.

        A tree's leaves over-represent the states where it branched (forks are placed at
        uncertain decisions, which are more often on failing paths), so their mean return is
        not the policy's. Each node's first child is a sample of the policy at that state taken
        before any outcome below it is known, whether or not siblings were forked later, so the
        first-child path from a root child is an ordinary episode; for an independent group it
        is every episode."""
        out = []
        for j in self.nodes[0].children if self.nodes else []:
            while self.nodes[j].children:
                j = self.nodes[j].children[0]
            out.append(j)
        return out

    def context(self, i: int) -> list[int]:
        """The full context (token ids) the policy saw when acting at node ``i``."""
        chain = []
        j = i
        while j != -1:
            chain.append(j)
            if self.nodes[j].context_reset:
                break
            j = self.nodes[j].parent
        ids: list[int] = []
        for k, j in enumerate(reversed(chain)):
            node = self.nodes[j]
            if k > 0 and node.turn is not None:
                ids.extend(node.turn.action_ids)
            ids.extend(node.obs_ids)
        return ids

    def to_dict(self, advantages: Sequence[float] | None = None) -> dict[str, Any]:
        """JSON-safe form (for ``trees.jsonl`` and the viewer); token ids included."""
        nodes = []
        for i, n in enumerate(self.nodes):
            d: dict[str, Any] = {
                "parent": n.parent, "observation": n.observation, "fingerprint": n.fingerprint,
                "obs_ids": list(n.obs_ids), "context_reset": n.context_reset,
                "entropy": n.entropy, "branch_k": n.branch_k, "step": n.step,
            }  # fmt: skip
            if n.turn is not None:
                t = n.turn
                d["turn"] = {
                    "action_ids": list(t.action_ids), "logprobs": list(t.logprobs),
                    "entropies": list(t.entropies), "action_text": t.action_text,
                    "reward": t.reward, "terminated": t.terminated, "truncated": t.truncated,
                    "policy_version": t.policy_version, "penalty": t.penalty,
                }  # fmt: skip
            if advantages is not None:
                d["advantage"] = float(advantages[i])
            nodes.append(d)
        return {"task": self.task, "seed": self.seed, "nodes": nodes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Tree:
        tree = cls(data["task"], int(data.get("seed", 0)))
        for d in data["nodes"]:
            turn = Turn(**{**d["turn"], "action_ids": tuple(d["turn"]["action_ids"]),
                           "logprobs": tuple(d["turn"]["logprobs"]),
                           "entropies": tuple(d["turn"]["entropies"])}) if "turn" in d else None  # fmt: skip
            node = Node(d["parent"], turn, tuple(d["obs_ids"]), d.get("observation", ""),
                        d.get("fingerprint"), bool(d.get("context_reset", False)))  # fmt: skip
            node.entropy = d.get("entropy")
            node.branch_k = int(d.get("branch_k", 1))
            node.step = int(d.get("step", 0))
            if node.parent >= 0:
                tree.nodes[node.parent].children.append(len(tree.nodes))
            tree.nodes.append(node)
        return tree

    def returns(self, shaped: bool = True) -> np.ndarray:
        """Return of each leaf's path from the root, indexed like :meth:`leaves`: what the
        estimators see (``shaped``), or the sandbox's own rewards (penalties added back)."""
        r = self.rewards()
        if not shaped:
            r = r + np.array([0.0 if n.turn is None else n.turn.penalty for n in self.nodes])
        p = self.parents()
        out = []
        for leaf in self.leaves():
            total, j = 0.0, leaf
            while j > 0:
                total += r[j]
                j = p[j]
            out.append(total)
        return np.array(out)


@dataclass(frozen=True)
class EdgeRecord:
    """One turn ready for the learner."""

    tree: int
    node: int
    """The edge into this node."""
    context_ids: tuple[int, ...]
    action_ids: tuple[int, ...]
    old_logprobs: tuple[float, ...]
    advantage: float
    weight: float
    policy_version: int


def flatten(
    trees: Sequence[Tree], estimator: str = "bpo", *, drop_zero: bool = False, **options: Any
) -> list[EdgeRecord]:
    """Advantages and weights for every edge of every tree, as learner-ready records.

    ``drop_zero`` leaves out edges whose advantage is exactly 0 (e.g. all-equal sibling groups,
    which carry no gradient signal in the surrogate anyway; with a KL or entropy term they would).
    """
    out: list[EdgeRecord] = []
    for t, tree in enumerate(trees):
        fps = tree.fingerprints() if estimator == "gigpo" else None
        res = estimators.compute(
            estimator, tree.parents(), tree.rewards(), fingerprints=fps, **options
        )
        for i in range(1, len(tree)):
            turn = tree.nodes[i].turn
            assert turn is not None
            a = float(res.advantage[i])
            if drop_zero and a == 0.0:
                continue
            out.append(
                EdgeRecord(
                    t,
                    i,
                    tuple(tree.context(tree.nodes[i].parent)),
                    turn.action_ids,
                    turn.logprobs,
                    a,
                    float(res.weight[i]),
                    turn.policy_version,
                )
            )
    return out


@dataclass(frozen=True)
class TreeStats:
    nodes: int
    leaves: int
    branch_nodes: int
    sibling_groups_all_equal: int
    """Branch nodes whose children's Q values are all equal (zero advantage for all)."""
    branch_depths: tuple[int, ...]
    branch_entropies: tuple[float, ...]
    max_depth: int
    success: float
    """Fraction of leaves whose path return is > 0 (a success for 0/1-reward tasks)."""
    mean_return: float


def tree_stats(tree: Tree) -> TreeStats:
    idx = estimators.index_tree(tree.parents(), tree.rewards())
    _, q = estimators.node_values(idx)
    branch = [u for u, ch in enumerate(idx.children) if len(ch) >= 2]
    all_equal = sum(1 for u in branch if np.ptp(q[idx.children[u]]) == 0.0)
    rets = tree.returns()
    return TreeStats(
        nodes=len(tree),
        leaves=len(rets),
        branch_nodes=len(branch),
        sibling_groups_all_equal=all_equal,
        branch_depths=tuple(int(idx.depth[u]) for u in branch),
        branch_entropies=tuple(
            float(tree.nodes[u].entropy) for u in branch if tree.nodes[u].entropy is not None
        ),
        max_depth=int(idx.depth.max()),
        success=float(np.mean(rets > 0)) if len(rets) else 0.0,
        mean_return=float(np.mean(rets)) if len(rets) else 0.0,
    )
