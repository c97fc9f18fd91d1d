"""Rollout engines: grow BPO trees and independent groups under one budget."""

from bpo.rollout.budget import BUDGET_UNITS, Budget, Compute
from bpo.rollout.engine import RolloutConfig, RolloutEngine, RolloutError

__all__ = ["BUDGET_UNITS", "Budget", "Compute", "RolloutConfig", "RolloutEngine", "RolloutError"]
