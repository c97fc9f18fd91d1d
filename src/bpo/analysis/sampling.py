"""Sample rollout trees on a tabular MDP the way :mod:`bpo.rollout.engine` grows them.

Growth of one tree (DESIGN section 3, and the engine's order of work):

1. The first backbone starts at the root. With ``root_width = W >= 2`` the root is a branch
   node: the rule is not asked there and W - 1 further depth-0 rollouts are queued first.
   With ``W == 1`` the rule is asked at the root like at any other state.
2. At every state of a rollout (except the first state of a fork, which is already a branch
   node) the rule answers ``decide(BranchPoint(step, entropy, depth, branches_so_far,
   budget_left, horizon))``; K >= 2 makes the state a branch node whose K - 1 forks are
   queued (FIFO) at depth + 1, and the rollout continues with its own action (the K-th child).
3. Queued rollouts run to termination one after another; every leaf is terminal.
4. ``entropy``: ``"state"`` gives the rule the entropy of pi(.|s) (a state function, like the
   engine's first-token entropy); ``"action"`` gives it the entropy of the *sampled* action
   (``mdp.action_entropy[s, a]``, like the engine's default mean-token entropy), which the
   engine computes after sampling the backbone's action -- not causal for that action.

Budget (edges per tree, the engine's "steps" unit), two modes:

* ``"reserve"`` (default, causal): every unfinished rollout reserves ``H - t`` edges, the most it
  can still take; ``budget_left = 1 - (taken + reserved) / B``; a branch gets at most
  ``1 + floor(available / (H - t))`` children (none if no fork fits), so a tree never exceeds B
  and the number of children of a node is fixed before any of them is sampled.
* ``"engine"`` (what ``bpo.rollout.engine`` does today): ``budget_left = 1 - taken / B``, and
  once ``taken >= B`` (and ``min_rollouts`` have started) every queued fork is dropped. Forks
  queued at a node can then be dropped because of what the node's own backbone child did
  afterwards, so the number of children depends on a child's outcome.

The non-causal ablation ``topk_backbone`` is asked ``select()`` on each finished depth-0
rollout (its states from step 1 on when the root branches); its forks (depth 1) do not nest.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from bpo.analysis.mdp import TabularMDP, state_entropy
from bpo.branching import BranchPoint, BranchRule, make_rule

__all__ = ["BUDGET_MODES", "ENTROPY_SOURCES", "SampledTree", "TreeSampler", "TreeShape"]

BUDGET_MODES = ("reserve", "engine")
ENTROPY_SOURCES = ("state", "action")


class PolicyTables(NamedTuple):
    """Python-list views of an MDP under a policy, for fast per-step sampling loops."""

    cum: list[list[float]]  # cumulative pi(.|s)
    next_state: list[list[int]]
    step_reward: list[list[float]]
    terminal: list[bool]
    terminal_reward: list[float]
    entropy: list[float]  # entropy of pi(.|s) in nats
    step: list[int]


def policy_tables(mdp: TabularMDP, logits: np.ndarray | None = None) -> PolicyTables:
    pi = mdp.probs(logits)
    cum = np.cumsum(pi, axis=1)
    cum[:, -1] = 1.0
    ent = state_entropy(mdp, logits)
    return PolicyTables(
        cum=cum.tolist(),
        next_state=mdp.next_state.tolist(),
        step_reward=mdp.step_reward.tolist(),
        terminal=mdp.terminal.tolist(),
        terminal_reward=mdp.terminal_reward.tolist(),
        entropy=ent.tolist(),
        step=mdp.step.tolist(),
    )


@dataclass(frozen=True)
class TreeShape:
    """How trees are grown: root width, branch rule, per-tree edge budget and its mode."""

    root_width: int = 1
    """Children of the root: 1 = a single backbone, N = the independent-episode group."""
    rule: str = "none"
    """Branch rule name in :data:`bpo.branching.BRANCH_RULES`."""
    rule_options: dict[str, Any] = field(default_factory=dict)
    """Options for :func:`bpo.branching.make_rule` (k, threshold, quantile, ...)."""
    budget: int | None = None
    """Edges per tree; ``None`` = unbounded (then the rule alone bounds the tree)."""
    budget_mode: str = "reserve"
    """``"reserve"`` (causal) or ``"engine"`` (drop queued forks once spent); module doc."""
    min_rollouts: int = 2
    """``"engine"`` mode: rollouts started regardless of the budget (the engine's default)."""
    entropy: str = "state"
    """What the rule sees: ``"state"`` entropy of pi(.|s) or the sampled ``"action"``'s."""

    def __post_init__(self) -> None:
        if self.root_width < 1:
            raise ValueError(f"root_width must be >= 1, got {self.root_width}")
        if self.budget is not None and self.budget < 1:
            raise ValueError(
                f"budget must be a positive number of edges or None, got {self.budget}"
            )
        if self.budget_mode not in BUDGET_MODES:
            raise ValueError(f"budget_mode must be one of {BUDGET_MODES}, got {self.budget_mode!r}")
        if self.entropy not in ENTROPY_SOURCES:
            raise ValueError(f"entropy must be one of {ENTROPY_SOURCES}, got {self.entropy!r}")

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.rule_options.items()))
        b = "inf" if self.budget is None else str(self.budget)
        extra = "" if self.budget_mode == "reserve" else f" {self.budget_mode}-budget"
        extra += "" if self.entropy == "state" else f" {self.entropy}-entropy"
        return f"W={self.root_width} {self.rule}({opts}) B={b}{extra}"


class SampledTree(NamedTuple):
    """One sampled tree; node 0 is the root, ``parents[i] < i``."""

    parents: np.ndarray  # [n] int64, parents[0] == -1
    rewards: np.ndarray  # [n] float64, reward on the edge into node i
    states: np.ndarray  # [n] int64, MDP state of node i
    actions: np.ndarray  # [n] int64, action on the edge into node i (-1 at the root)
    branch_nodes: int
    """Branch nodes in the tree (the root included when it has two or more children)."""

    @property
    def edges(self) -> int:
        return len(self.parents) - 1

    @property
    def leaves(self) -> int:
        has_child = np.zeros(len(self.parents), dtype=bool)
        has_child[self.parents[1:]] = True
        return int((~has_child).sum())


class _Run:
    """Book-keeping of one tree in progress."""

    def __init__(self) -> None:
        self.parents = [-1]
        self.rewards = [0.0]
        self.states = [0]
        self.actions = [-1]
        self.pending: deque[tuple[int, int, int, int]] = deque()  # node, state, forks, depth
        self.taken = 0
        self.reserved = 0
        self.branches = 0
        self.episodes = 1


class TreeSampler:
    """Grow trees of one :class:`TreeShape` on one MDP at its study policy.

    The rule object lives as long as the sampler (its statistics carry over between trees);
    call :meth:`end_iteration` between batches, as the engine does after each ``run``.
    """

    def __init__(
        self,
        mdp: TabularMDP,
        shape: TreeShape,
        rng: np.random.Generator,
        logits: np.ndarray | None = None,
    ) -> None:
        if shape.entropy == "action" and mdp.action_entropy is None:
            raise ValueError(
                f"entropy='action' needs an MDP with action_entropy; {mdp.name} has none "
                "(build one with bpo.analysis.mdp.with_action_entropy)"
            )
        self.mdp = mdp
        self.shape = shape
        self.rng = rng
        self.rule: BranchRule = make_rule(shape.rule, **shape.rule_options)
        self.causal = bool(getattr(self.rule, "causal", True))
        self.t = policy_tables(mdp, logits)
        self.action_entropy = (
            mdp.action_entropy.tolist() if mdp.action_entropy is not None else None
        )
        self.horizon = mdp.horizon
        self._uniform = np.empty(0)
        self._next_u = 0

    def end_iteration(self) -> None:
        self.rule.end_iteration()

    def _u(self) -> float:
        if self._next_u >= len(self._uniform):
            self._uniform = self.rng.random(4096)
            self._next_u = 0
        self._next_u += 1
        return float(self._uniform[self._next_u - 1])

    # -- one edge ----------------------------------------------------------------------------
    def _action(self, s: int) -> int:
        cum = self.t.cum[s]
        return min(bisect_right(cum, self._u()), len(cum) - 1)

    def _take(self, run: _Run, node: int, s: int, a: int) -> tuple[int, int]:
        t = self.t
        s2 = t.next_state[s][a]
        r = t.step_reward[s][a]
        if t.terminal[s2]:
            m = t.terminal_reward[s2]
            noise = self.mdp.noise
            if noise == "bernoulli":
                r += 1.0 if self._u() < m else 0.0
            elif noise == "gaussian":
                r += m + self.mdp.noise_scale * float(self.rng.standard_normal())
            else:
                r += m
            run.reserved -= self.horizon - t.step[s2]  # release what the rollout did not use
        run.parents.append(node)
        run.rewards.append(r)
        run.states.append(s2)
        run.actions.append(a)
        run.taken += 1
        run.reserved -= 1
        return len(run.parents) - 1, s2

    # -- the rule ----------------------------------------------------------------------------
    def _point(self, run: _Run, s: int, a: int, depth: int) -> BranchPoint:
        budget = self.shape.budget
        left = 1.0
        if budget is not None:
            used = run.taken + (run.reserved if self.shape.budget_mode == "reserve" else 0)
            left = max(0.0, 1.0 - used / budget)
        ent = (
            self.t.entropy[s]
            if self.action_entropy is None or self.shape.entropy == "state"
            else self.action_entropy[s][a]
        )
        return BranchPoint(
            step=self.t.step[s],
            entropy=ent,
            depth=depth,
            branches_so_far=run.branches,
            budget_left=left,
            horizon=self.horizon,
        )

    def _grant(self, run: _Run, k: int, s: int) -> int:
        budget = self.shape.budget
        if k < 2 or budget is None or self.shape.budget_mode != "reserve":
            return k if k >= 2 else 1
        cost = self.horizon - self.t.step[s]
        k = min(k, 1 + int((budget - run.taken - run.reserved) // cost))
        return k if k >= 2 else 1

    def _branch(self, run: _Run, node: int, s: int, k: int, depth: int) -> None:
        run.pending.append((node, s, k - 1, depth))
        run.reserved += (k - 1) * (self.horizon - self.t.step[s])
        run.branches += 1

    def _rollout(self, run: _Run, node: int, s: int, depth: int, fork: bool) -> list[tuple]:
        """Roll out from ``node`` (state ``s``) to termination; returns the (node, state,
        action) visited. ``fork``: the first action is a fork's, at an existing branch node."""
        path = []
        ask = not fork
        while not self.t.terminal[s]:
            a = self._action(s)  # sampled first, as in the engine; "state" entropy ignores it
            if ask and self.causal:
                k = self._grant(run, int(self.rule.decide(self._point(run, s, a, depth))), s)
                if k >= 2:
                    self._branch(run, node, s, k, depth + 1)
            path.append((node, s, a, ask))
            node, s = self._take(run, node, s, a)
            ask = True
        return path

    def _select(self, run: _Run, path: list[tuple]) -> None:
        """Non-causal ablation: choose branch points on a finished depth-0 rollout."""
        asked = [(node, s, a) for node, s, a, ask in path if ask]
        chosen = self.rule.select([self._point(run, s, a, 0) for _, s, a in asked])
        by_step = {self.t.step[s]: (node, s) for node, s, _ in asked}
        for step, k in chosen.items():
            node, s = by_step[step]
            k = self._grant(run, int(k), s)
            if k >= 2:
                self._branch(run, node, s, k, 1)

    # -- one tree ------------------------------------------------------------------------------
    def sample(self) -> SampledTree:
        """Grow one tree (see the module docstring for the exact procedure)."""
        shape = self.shape
        run = _Run()
        width = shape.root_width
        run.reserved = self.horizon  # the first backbone
        if width >= 2:
            self._branch(run, 0, 0, width, 0)  # the root group: W - 1 more depth-0 rollouts
        path = self._rollout(run, 0, 0, 0, fork=width >= 2)
        if not self.causal:
            self._select(run, path)
        while run.pending:
            if self._spent(run):
                run.pending.clear()
                break
            node, s, forks, depth = run.pending[0]
            if forks == 1:
                run.pending.popleft()
            else:
                run.pending[0] = (node, s, forks - 1, depth)
            run.episodes += 1
            path = self._rollout(run, node, s, depth, fork=True)
            if not self.causal and depth == 0:
                self._select(run, path)
        return SampledTree(
            parents=np.array(run.parents, dtype=np.int64),
            rewards=np.array(run.rewards, dtype=np.float64),
            states=np.array(run.states, dtype=np.int64),
            actions=np.array(run.actions, dtype=np.int64),
            branch_nodes=run.branches,
        )

    def _spent(self, run: _Run) -> bool:
        shape = self.shape
        if shape.budget_mode != "engine" or shape.budget is None:
            return False
        return run.taken >= shape.budget and run.episodes >= shape.min_rollouts
