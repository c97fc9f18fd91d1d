"""Where a tree branches: the branch rule's decision at a state, before the backbone's action is
applied, with K capped by the budget (:func:`bpo.rollout.budget.cap`); a branch node keeps its
snapshot and queues K - 1 forks (the engine starts them in turn). The non-causal ablation
decides after its backbone is finished, with hindsight."""

from __future__ import annotations

from bpo.branching import BranchPoint, BranchRule
from bpo.rollout.budget import Budget, CostModel, cap, reserved
from bpo.rollout.config import RolloutConfig
from bpo.rollout.records import _Cursor, _Pending, _TreeRun
from bpo.rollout.snapshots import release, snapshot

__all__ = ["decide", "decide_with_hindsight"]


def decide(
    run: _TreeRun,
    cur: _Cursor,
    entropy: float,
    rule: BranchRule,
    config: RolloutConfig,
    costs: CostModel,
) -> None:
    """The branch rule at the cursor's state (before its action is applied)."""
    point = BranchPoint(
        step=run.tree.nodes[cur.node].step,
        entropy=entropy,
        depth=cur.depth,
        branches_so_far=run.branches,
        budget_left=config.budget.left(run.compute, reserved(config.budget, costs, run)),
        horizon=config.max_steps,
    )
    if not rule.causal:
        if cur.depth == 0:  # the ablation looks at the finished backbone: keep every state
            run.backbone.append((point, snapshot(run), cur.node))
        return
    want = int(rule.decide(point))
    k = cap(config.budget, costs, run, want, point.step)
    run.wanted += max(want - 1, 0)
    if k >= 2:
        run.tree.nodes[cur.node].branch_k = k
        run.pending.append(_Pending(cur.node, snapshot(run), k - 1, cur.depth + 1))
        run.branches += 1


def decide_with_hindsight(
    run: _TreeRun, rule: BranchRule, budget: Budget, costs: CostModel
) -> None:
    """The non-causal ablation: the backbone is finished, so its states (``run.backbone``)
    are chosen as branch points now; the states not chosen release their snapshots."""
    chosen = rule.select([p for p, _, _ in run.backbone])
    for point, snap, node in run.backbone:
        want = chosen.get(point.step, 1)
        run.wanted += max(want - 1, 0)
        k = cap(budget, costs, run, want, point.step)
        if k >= 2:
            run.tree.nodes[node].branch_k = k
            run.pending.append(_Pending(node, snap, k - 1, 1))
            run.branches += 1
        else:
            release(run, snap)
    run.backbone = []
