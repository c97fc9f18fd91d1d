"""Per-iteration metrics, logged from one place (STYLE rule 11): flat namespaced keys
(``rollout/``, ``tree/``, ``loss/``, ``learner/``, ``compute/``, ``snapshot/``, ``eval/``) written
to ``metrics.jsonl`` (one JSON object per iteration) and TensorBoard event files."""

from __future__ import annotations

import json
import math
import os
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bpo.rollout.budget import Compute
from bpo.tree import Tree, tree_stats

__all__ = ["MetricsLogger", "tree_metrics"]


def tree_metrics(trees: Sequence[Tree], prefix: str = "") -> dict[str, float]:
    """Rollout, tree-shape, compute and snapshot metrics of one iteration's trees."""
    stats = [tree_stats(t) for t in trees]
    compute = Compute()
    for t in trees:
        c = t.meta.get("compute")
        if isinstance(c, Compute):
            compute.add(c)
    groups = sum(s.branch_nodes for s in stats)
    equal = sum(s.sibling_groups_all_equal for s in stats)
    depths = [d for s in stats for d in s.branch_depths]
    ents = [e for s in stats for e in s.branch_entropies]
    # success and return in the sandbox's own rewards (without invalid-action penalties)
    leaf_returns = (
        np.concatenate([t.returns(shaped=False) for t in trees]) if trees else np.zeros(0)
    )
    episodes = np.array([r for t in trees for r in _episode_returns(t)])
    out = {
        # every leaf (the estimators' view) and one episode per root child (the policy's own
        # success: branch leaves over-represent uncertain, often failing, states)
        "rollout/success": float(np.mean(leaf_returns > 0)) if len(leaf_returns) else 0.0,
        "rollout/return": float(np.mean(leaf_returns)) if len(leaf_returns) else 0.0,
        "rollout/episode_success": float(np.mean(episodes > 0)) if len(episodes) else 0.0,
        "rollout/episode_return": float(np.mean(episodes)) if len(episodes) else 0.0,
        "rollout/task_success": float(np.mean([s.success > 0 for s in stats])) if stats else 0.0,
        "tree/leaves": float(np.mean([s.leaves for s in stats])) if stats else 0.0,
        "tree/nodes": float(np.mean([s.nodes for s in stats])) if stats else 0.0,
        "tree/branch_nodes": float(np.mean([s.branch_nodes for s in stats])) if stats else 0.0,
        "tree/branch_depth_mean": float(np.mean(depths)) if depths else 0.0,
        "tree/branch_entropy_mean": float(np.mean(ents)) if ents else 0.0,
        "tree/all_equal_group_frac": equal / groups if groups else 0.0,
        "tree/max_depth": float(np.mean([s.max_depth for s in stats])) if stats else 0.0,
        "snapshot/live_after_tree": float(
            sum(t.meta.get("live_snapshots_after", 0) for t in trees)
        ),
    }
    out.update(compute.as_dict("compute/"))
    computed = compute.prefill_tokens + compute.generated_tokens
    unique = sum(
        len(n.obs_ids) + (len(n.turn.action_ids) if n.turn else 0) for t in trees for n in t.nodes
    )
    out["compute/token_efficiency"] = computed / unique if unique else 0.0
    out["rollout/invalid_frac"] = (
        compute.invalid_actions / compute.sandbox_steps if compute.sandbox_steps else 0.0
    )
    if compute.wall_seconds > 0:
        out["snapshot/time_frac"] = compute.snapshot_seconds / compute.wall_seconds
    return {prefix + k: v for k, v in out.items()}


def _episode_returns(tree: Tree) -> list[float]:
    ret = dict(zip(tree.leaves(), tree.returns(shaped=False).tolist(), strict=True))
    return [ret[leaf] for leaf in tree.episode_leaves()]


class MetricsLogger:
    """Appends one JSON line per iteration (fsynced: a killed run keeps what it logged) and
    mirrors scalars to TensorBoard. Keeps a sliding window of gradient norms for their
    variance (DESIGN section 7)."""

    def __init__(self, run_dir: str | Path, window: int = 20, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.grad_norms: deque[float] = deque(maxlen=window)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))

    def log(self, iteration: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        row: dict[str, Any] = {"iteration": iteration}
        for k, v in metrics.items():
            if isinstance(v, (int, float, np.floating, np.integer)):
                row[k] = float(v)
        if "learner/grad_norm" in row and math.isfinite(row["learner/grad_norm"]):
            self.grad_norms.append(row["learner/grad_norm"])
            row["learner/grad_norm_var"] = float(np.var(self.grad_norms))
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._tb is not None:
            for k, v in row.items():
                if k != "iteration" and math.isfinite(v):
                    self._tb.add_scalar(k, v, iteration)
            self._tb.flush()
        return row

    def truncate_after(self, iteration: int) -> None:
        """Drop rows past ``iteration`` (after a resume from an earlier checkpoint)."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if row.get("iteration", -1) <= iteration:
                keep.append(line)
        self.path.write_text("".join(k + "\n" for k in keep))
        self.grad_norms.clear()
        for line in keep:
            g = json.loads(line).get("learner/grad_norm")
            if g is not None and math.isfinite(g):
                self.grad_norms.append(g)
        if self._tb is not None:  # drop the lost iterations' TensorBoard events too
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=iteration + 1)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows
