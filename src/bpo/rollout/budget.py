"""Compute accounting and the per-task budget that makes comparisons "at matched compute"
(DESIGN section 3).

Two budget modes:

* ``expected`` (default, causal, unbiased): every decision that adds rollouts to a tree is made
  *before* those rollouts are sampled and uses only the prefix and the costs of *other*,
  finished trees. A branch node gets K children only if K - 1 forks fit in the budget left after
  reserving the expected cost of everything already queued; an independent group's size N is
  fixed when the task starts, from the budget and the expected cost of an episode. Queued
  rollouts always run. Trees and groups therefore match in *expected* cost per task, and the
  metrics report what each really consumed.
* ``hard`` (biased; kept labelled for comparison): stop starting queued rollouts once the
  spent budget reaches the amount (and, with ``truncate``, cut the rollout in flight). The
  number of children a node ends up with then depends on how long its earlier children ran,
  which correlates with their returns: measured bias in the exact study (``bpo verify
  --engine-checks``: gradient scale 0.84).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields

import numpy as np

__all__ = ["BUDGET_MODES", "BUDGET_UNITS", "Budget", "Compute", "CostModel"]

BUDGET_UNITS = ("tokens", "steps", "leaves")
BUDGET_MODES = ("expected", "hard")


@dataclass
class Compute:
    """What one tree (or group) consumed. Summed over tasks for the iteration's metrics."""

    generated_tokens: int = 0
    prefill_tokens: int = 0
    """Context tokens the policy actually computed (cache hits excluded)."""
    context_tokens: int = 0
    """Context tokens the policy was asked to condition on (cached or not)."""
    sandbox_steps: int = 0
    snapshots: int = 0
    restores: int = 0
    leaves: int = 0
    episodes: int = 0
    """Root-to-leaf rollouts started (backbones, forks and independent episodes)."""
    retries: int = 0
    """Rollouts started again after a sandbox fault (RolloutEngine.run)."""
    failed_rollouts: int = 0
    """Rollouts dropped after their retries ran out."""
    invalid_actions: int = 0
    """Turns that ran out of tokens before a stop token or sent a command outside the
    admissible list (see RolloutConfig.invalid_penalty)."""
    policy_seconds: float = 0.0
    sandbox_seconds: float = 0.0
    snapshot_seconds: float = 0.0
    wall_seconds: float = 0.0

    def add(self, other: Compute) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self, prefix: str = "compute/") -> dict[str, float]:
        return {prefix + f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Budget:
    """How much one task's tree (or group) may consume."""

    unit: str = "tokens"
    """What is matched: "tokens" (generated), "steps" (sandbox steps) or "leaves"."""
    amount: float = 2048
    """Per-task budget in that unit."""
    mode: str = "expected"
    """"expected" (causal, unbiased) or "hard" (biased; see the module docstring)."""
    truncate: bool = False
    """hard mode only: cut the rollout in flight when the budget runs out (matching within one
    turn; the cut leaf is marked truncated)."""
    min_rollouts: int = 2
    """Rollouts every task gets regardless of the budget (a group needs 2 for a baseline)."""

    def __post_init__(self) -> None:
        if self.unit not in BUDGET_UNITS:
            raise ValueError(f"unknown budget unit {self.unit!r}; valid: {', '.join(BUDGET_UNITS)}")
        if self.mode not in BUDGET_MODES:
            raise ValueError(f"unknown budget mode {self.mode!r}; valid: {', '.join(BUDGET_MODES)}")
        if self.amount <= 0:
            raise ValueError(f"budget amount must be > 0, got {self.amount}")

    def used(self, c: Compute) -> float:
        if self.unit == "tokens":
            return float(c.generated_tokens)
        if self.unit == "steps":
            return float(c.sandbox_steps)
        return float(c.leaves)

    def left(self, c: Compute, reserved: float = 0.0) -> float:
        """Fraction of the budget neither spent nor reserved, in [0, 1]."""
        return max(0.0, 1.0 - (self.used(c) + reserved) / self.amount)


@dataclass
class CostModel:
    """Expected cost of a rollout, learnt from *finished trees*. A tree's decisions use the
    costs of other trees (earlier iterations, or other tasks already finished in this one),
    never its own, which are independent of its samples: the decisions stay causal. Before any
    tree has finished: half the step limit and half the token limit per turn."""

    max_steps: int
    max_new_tokens: int
    window: int = 2048
    lengths: deque[int] = field(default_factory=deque)
    """Turns of recent root-to-leaf paths."""
    per_turn: deque[float] = field(default_factory=deque)
    """Generated tokens per turn of recent trees."""
    trees: deque[tuple[float, ...]] = field(default_factory=deque)
    """Recent finished trees: (generated tokens, sandbox steps, leaves, rollouts run, rollouts
    the branch rule asked for, root width)."""

    def observe(self, path_turns: int, tokens: int, turns: int) -> None:
        """Record one root-to-leaf path of a finished tree (and the tree's tokens per turn)."""
        self.lengths.append(path_turns)
        if turns:
            self.per_turn.append(tokens / turns)
        while len(self.lengths) > self.window:
            self.lengths.popleft()
        while len(self.per_turn) > self.window:
            self.per_turn.popleft()

    def observe_tree(self, c: Compute, wanted: int, root_width: int) -> None:
        """Record a finished tree's totals; ``wanted`` counts the rollouts it ran plus the forks
        the budget refused."""
        self.trees.append(
            (c.generated_tokens, c.sandbox_steps, c.leaves, c.episodes, wanted, root_width)
        )
        while len(self.trees) > self.window:
            self.trees.popleft()

    def root_child_cost(self, unit: str) -> float | None:
        """Expected cost of one root child with every rollout its branch rule asks for: the
        rule's appetite (rollouts wanted per root child) times the mean cost of a rollout, both
        from finished trees. Refused forks count as wanted, so a tight budget does not feed back
        into an ever wider root."""
        if not self.trees:
            return None
        tok, steps, leaves, run, wanted, width = (
            float(sum(x)) for x in zip(*self.trees, strict=True)
        )
        if run <= 0 or width <= 0:
            return None
        spent = {"tokens": tok, "steps": steps, "leaves": leaves}[unit]
        return (wanted / width) * (spent / run)

    def end_iteration(self) -> None:
        """Nothing to roll over: finished trees are used as soon as they finish."""

    @property
    def turn_tokens(self) -> float | None:
        return float(np.mean(self.per_turn)) if self.per_turn else None

    def turns_from(self, step: int) -> float:
        """Expected turns of a rollout from a state at ``step`` to its leaf (>= 1)."""
        if not self.lengths:
            return max(1.0, self.max_steps / 2 - step)
        longer = [n - step for n in self.lengths if n > step]
        return float(np.mean(longer)) if longer else 1.0

    def rollout_cost(self, unit: str, step: int) -> float:
        """Expected cost, in ``unit``, of one rollout (fork or episode) from ``step``."""
        if unit == "leaves":
            return 1.0
        turns = self.turns_from(step)
        if unit == "steps":
            return turns
        per_turn = self.turn_tokens
        return turns * (per_turn if per_turn is not None else self.max_new_tokens / 2)

    def state_dict(self) -> dict:
        return {
            "lengths": list(self.lengths),
            "per_turn": list(self.per_turn),
            "trees": [list(t) for t in self.trees],
        }

    def load_state_dict(self, d: dict) -> None:
        self.lengths = deque(d["lengths"])
        self.per_turn = deque(d["per_turn"])
        self.trees = deque(tuple(t) for t in d.get("trees", []))
