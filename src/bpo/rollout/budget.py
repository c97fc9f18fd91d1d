"""Compute accounting and the per-task budget that makes comparisons "at matched compute"
(DESIGN section 3)."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["BUDGET_UNITS", "Budget", "Compute"]

BUDGET_UNITS = ("tokens", "steps", "leaves")


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
    """How much one task's tree (or group) may consume before it stops growing.

    The budget is checked before every new rollout (episode or fork) starts and, with
    ``truncate``, before every turn: then a rollout in flight when the budget runs out is cut
    (its leaf marked truncated) and matching holds to within one turn. Without ``truncate``
    rollouts in flight always finish (at most ``max_steps``), so a tree can overshoot by one
    rollout; the iteration's metrics always report what was really consumed.
    """

    unit: str = "tokens"
    """What is matched: "tokens" (generated), "steps" (sandbox steps) or "leaves"."""
    amount: float = 2048
    """Per-task budget in that unit."""
    truncate: bool = False
    min_rollouts: int = 2
    """Rollouts started regardless of the budget (a group needs 2 for any baseline)."""

    def __post_init__(self) -> None:
        if self.unit not in BUDGET_UNITS:
            raise ValueError(f"unknown budget unit {self.unit!r}; valid: {', '.join(BUDGET_UNITS)}")
        if self.amount <= 0:
            raise ValueError(f"budget amount must be > 0, got {self.amount}")

    def used(self, c: Compute) -> float:
        if self.unit == "tokens":
            return float(c.generated_tokens)
        if self.unit == "steps":
            return float(c.sandbox_steps)
        return float(c.leaves)

    def left(self, c: Compute) -> float:
        """Fraction of the budget not yet spent, in [0, 1]."""
        return max(0.0, 1.0 - self.used(c) / self.amount)
