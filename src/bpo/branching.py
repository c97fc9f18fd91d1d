"""Branch rules: where a tree forks (DESIGN section 3), one registry.

A rule is asked at every decision of a rollout (backbone or fork) and answers how many
children the current state gets: 1 means "no branch", K >= 2 means "snapshot here and fork
K - 1 siblings of the action about to be taken". Rules must be **causal**: the answer may use
the prefix up to the decision (step index, the policy's entropy there, budget spent so far,
statistics of earlier iterations) but nothing after it. Then the backbone's own action is an
i.i.d. sibling of the forks and the BPO estimator stays unbiased.

The one non-causal rule, ``topk_backbone`` (fork at the B highest-entropy steps of the finished
backbone), is an ablation: it is labelled ``causal = False`` and is driven through
:meth:`BranchRule.select` on the finished backbone instead of :meth:`BranchRule.decide`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from bpo.registry import Registry

__all__ = ["BRANCH_RULES", "BranchPoint", "BranchRule", "make_rule"]


@dataclass(frozen=True)
class BranchPoint:
    """What a causal rule may look at when deciding whether state s_t becomes a branch node."""

    step: int
    """Number of actions taken on the path from the root to this state (root = 0)."""
    entropy: float
    """Entropy of the policy at this state (the turn's mean or first-token entropy)."""
    depth: int = 0
    """Nesting level: 0 on the backbone, 1 inside a fork of the backbone, ..."""
    branches_so_far: int = 0
    """Branch nodes already created in this tree."""
    budget_left: float = 1.0
    """Fraction of this tree's budget not yet spent (forks still pending count as spent)."""
    horizon: int | None = None
    """The environment's step limit, when known (for depth-relative rules)."""


class BranchRule(Protocol):
    causal: bool

    def decide(self, point: BranchPoint) -> int:
        """Number of children for this state (1 = no branch). Causal rules only."""
        ...

    def select(self, backbone: Sequence[BranchPoint]) -> dict[int, int]:
        """Non-causal rules only: {step: K} chosen after seeing the whole backbone."""
        ...

    def end_iteration(self) -> None:
        """Called once per training iteration, after all trees: roll statistics forward."""
        ...


RuleFactory = Callable[..., BranchRule]
BRANCH_RULES: Registry[RuleFactory] = Registry("branch rule")


def make_rule(name: str, **options: Any) -> BranchRule:
    """Build a branch rule by name: ``make_rule("entropy_quantile", k=4, quantile=0.8)``."""
    return BRANCH_RULES.get(name)(**options)


def _check_k(k: int) -> int:
    if int(k) != k or k < 2:
        raise ValueError(f"k (children per branch node) must be an integer >= 2, got {k!r}")
    return int(k)


class _Causal:
    causal = True
    k: int
    max_branches: int | None
    min_budget: float

    def _allowed(self, p: BranchPoint) -> bool:
        if self.max_branches is not None and p.branches_so_far >= self.max_branches:
            return False
        return p.budget_left > self.min_budget

    def select(self, backbone: Sequence[BranchPoint]) -> dict[int, int]:
        raise TypeError(f"{type(self).__name__} is causal: call decide() at each step")

    def end_iteration(self) -> None:
        pass


@BRANCH_RULES.register("entropy_quantile")
class EntropyQuantile(_Causal):
    """Branch where the policy is least certain: entropy above a running quantile (default).

    The threshold is the ``quantile`` of the turn entropies seen in the last ``window`` turns
    of *earlier* iterations (so that, on average, a ``1 - quantile`` share of states qualifies),
    computed once per iteration. In the first iteration, with no history yet, the entropies
    seen so far in the current iteration are used (still causal); before ``min_history``
    entropies exist, no branching.
    """

    def __init__(
        self,
        k: int = 4,
        quantile: float = 0.8,
        window: int = 4096,
        min_history: int = 8,
        max_branches: int | None = None,
        max_depth: int = 1,
        min_budget: float = 0.0,
    ) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        self.k = _check_k(k)
        self.quantile = quantile
        self.history: deque[float] = deque(maxlen=window)
        self.current: list[float] = []
        self.min_history = min_history
        self.max_branches = max_branches
        self.max_depth = max_depth
        self.min_budget = min_budget
        self.threshold: float | None = None

    def decide(self, point: BranchPoint) -> int:
        threshold = self.threshold  # from earlier iterations (set in end_iteration)
        if threshold is None and len(self.current) >= self.min_history:
            threshold = float(np.quantile(self.current, self.quantile))  # first iteration
        self.current.append(point.entropy)
        if threshold is None or point.depth >= self.max_depth:
            return 1
        # >=: with few distinct entropies the quantile can equal the maximum
        if point.entropy >= threshold and self._allowed(point):
            return self.k
        return 1

    def end_iteration(self) -> None:
        self.history.extend(self.current)
        self.current = []
        if len(self.history) >= self.min_history:
            self.threshold = float(np.quantile(self.history, self.quantile))


@BRANCH_RULES.register("entropy_threshold")
class EntropyThreshold(_Causal):
    """Branch wherever the policy's entropy exceeds a fixed ``threshold`` (nats)."""

    def __init__(
        self,
        k: int = 4,
        threshold: float = 1.0,
        max_branches: int | None = None,
        max_depth: int = 1,
        min_budget: float = 0.0,
    ) -> None:
        self.k = _check_k(k)
        self.threshold = float(threshold)
        self.max_branches = max_branches
        self.max_depth = max_depth
        self.min_budget = min_budget

    def decide(self, point: BranchPoint) -> int:
        ok = point.depth < self.max_depth and point.entropy > self.threshold
        return self.k if ok and self._allowed(point) else 1


@BRANCH_RULES.register("every")
class Every(_Causal):
    """Branch at every step (a full K-ary tree up to ``max_depth`` nesting; budget-bounded)."""

    def __init__(
        self,
        k: int = 2,
        max_branches: int | None = None,
        max_depth: int = 1,
        min_budget: float = 0.0,
    ) -> None:
        self.k = _check_k(k)
        self.max_branches = max_branches
        self.max_depth = max_depth
        self.min_budget = min_budget

    def decide(self, point: BranchPoint) -> int:
        return self.k if point.depth < self.max_depth and self._allowed(point) else 1


@BRANCH_RULES.register("fixed_depths")
class FixedDepths(_Causal):
    """Branch at the given step indices of the backbone (e.g. ``steps=[0, 3]``)."""

    def __init__(
        self,
        k: int = 4,
        steps: Sequence[int] = (0,),
        max_branches: int | None = None,
        max_depth: int = 1,
        min_budget: float = 0.0,
    ) -> None:
        self.k = _check_k(k)
        self.steps = frozenset(int(s) for s in steps)
        self.max_branches = max_branches
        self.max_depth = max_depth
        self.min_budget = min_budget

    def decide(self, point: BranchPoint) -> int:
        ok = point.depth < self.max_depth and point.step in self.steps
        return self.k if ok and self._allowed(point) else 1


@BRANCH_RULES.register("random")
class RandomSteps(_Causal):
    """Branch at each step with probability ``p`` (Tree-GRPO-like random expansion points;
    Ji et al. 2025)."""

    def __init__(
        self,
        k: int = 4,
        p: float = 0.2,
        seed: int = 0,
        max_branches: int | None = None,
        max_depth: int = 1,
        min_budget: float = 0.0,
    ) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.k = _check_k(k)
        self.p = p
        self.rng = np.random.default_rng(seed)
        self.max_branches = max_branches
        self.max_depth = max_depth
        self.min_budget = min_budget

    def decide(self, point: BranchPoint) -> int:
        draw = self.rng.random() < self.p  # always drawn: the stream does not depend on depth
        ok = point.depth < self.max_depth and draw
        return self.k if ok and self._allowed(point) else 1


@BRANCH_RULES.register("tail")
class TailBiased(_Causal):
    """Branch more often late in the episode (BranPO-like): probability ``p_max * (t/H)**power``
    at step t of a horizon H (the environment's step limit)."""

    def __init__(
        self,
        k: int = 4,
        p_max: float = 0.5,
        power: float = 2.0,
        horizon: int | None = None,
        seed: int = 0,
        max_branches: int | None = None,
        max_depth: int = 1,
        min_budget: float = 0.0,
    ) -> None:
        self.k = _check_k(k)
        self.p_max = p_max
        self.power = power
        self.horizon = horizon
        self.rng = np.random.default_rng(seed)
        self.max_branches = max_branches
        self.max_depth = max_depth
        self.min_budget = min_budget

    def decide(self, point: BranchPoint) -> int:
        horizon = point.horizon or self.horizon
        if horizon is None:
            raise ValueError("the 'tail' rule needs a horizon (rule option or the env's limit)")
        prob = self.p_max * min(1.0, point.step / max(1, horizon - 1)) ** self.power
        draw = self.rng.random() < prob
        ok = point.depth < self.max_depth and draw
        return self.k if ok and self._allowed(point) else 1


@BRANCH_RULES.register("none")
class NoBranch(_Causal):
    """Never branch: with ``root_width = N`` this is the independent-episode group."""

    k = 1
    max_branches = None
    min_budget = 0.0

    def decide(self, point: BranchPoint) -> int:
        return 1


@BRANCH_RULES.register("topk_backbone")
class TopKBackbone:
    """ABLATION, NOT CAUSAL (biased): fork at the ``b`` highest-entropy steps of the *finished*
    backbone. Choosing branch points with hindsight makes the backbone's action at those steps
    a non-i.i.d. sibling; kept only to measure that bias."""

    causal = False

    def __init__(self, k: int = 4, b: int = 2) -> None:
        self.k = _check_k(k)
        self.b = int(b)

    def decide(self, point: BranchPoint) -> int:
        raise TypeError("topk_backbone is not causal: call select() on the finished backbone")

    def select(self, backbone: Sequence[BranchPoint]) -> dict[int, int]:
        order = sorted(backbone, key=lambda p: (-p.entropy, p.step))
        return {p.step: self.k for p in order[: self.b]}

    def end_iteration(self) -> None:
        pass
