"""Where does branching win? A sweep over agent MDPs and tree shapes at matched budget.

Each regime is an ``agent`` MDP with one uncertain irreversible decision (3 routes) at step
``d`` of a horizon ``H``, confident steps elsewhere (blunder probability 0.03), and either a
Bernoulli success reward (noise) or its mean (no noise). Against RLOO with N = 8 it compares
BPO trees that branch exactly at the decision (``fixed_depths``, the best causal placement,
known here) with several root widths W and branch factors K, plus the realistic
``entropy_threshold`` rule. Reported per row: the prefix-explained share of return variance
before the decision and the share the decision itself explains (law of total variance), and
trace_cov x cost and cosine relative to RLOO.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from bpo.analysis.families import agent
from bpo.analysis.mdp import TabularMDP, exact, prefix_share
from bpo.analysis.sampling import TreeShape
from bpo.analysis.study import Setting, StudyConfig, entropy_threshold_for, run_mdp

__all__ = ["Regime", "regimes", "run_sweep"]

SHAPES: tuple[tuple[int, int], ...] = ((1, 4), (2, 2), (2, 4), (2, 8), (4, 2), (4, 4))
"""(root width W, children per branch node K); W = 1 uses a root baseline from earlier trees."""


@dataclass(frozen=True)
class Regime:
    horizon: int
    decision: int
    noise: str

    def mdp(self) -> TabularMDP:
        return agent(
            seed=1,
            horizon=self.horizon,
            decisions=(self.decision,),
            options=3,
            noise=self.noise,
        )


def regimes(quick: bool) -> list[Regime]:
    """Horizon x decision depth (early / late) x reward noise."""
    horizons = (8, 24) if quick else (8, 16, 32)
    out = []
    for h in horizons:
        for d in (1, h - 2):
            for noise in ("bernoulli", "none"):
                out.append(Regime(h, d, noise))
    return out


def _settings(reg: Regime, mdp: TabularMDP, cfg: StudyConfig) -> list[Setting]:
    ex = exact(mdp)
    budget = cfg.group_size * mdp.horizon
    out = [Setting("none", TreeShape(cfg.group_size, "none"), ("rloo", "bpo_prior"))]
    for w, k in SHAPES:
        shape = TreeShape(w, "fixed_depths", {"k": k, "steps": [reg.decision]}, budget)
        out.append(Setting(f"fixed_depths W={w} K={k}", shape, ("bpo", "bpo_prior")))
    thr = entropy_threshold_for(mdp, ex)
    shape = TreeShape(2, "entropy_threshold", {"k": 4, "threshold": thr}, budget)
    out.append(Setting("entropy_threshold W=2 K=4", shape, ("bpo", "bpo_prior")))
    return out


def run_sweep(cfg: StudyConfig, quick: bool) -> list[dict[str, Any]]:
    """One row per (regime, shape): ratios to RLOO at matched expected edges per batch."""
    rows: list[dict[str, Any]] = []
    for i, reg in enumerate(regimes(quick)):
        t0 = time.perf_counter()
        mdp = reg.mdp()
        share = prefix_share(mdp)
        res = run_mdp(mdp, cfg, _settings(reg, mdp, cfg), index=1000 + i)
        ref = next(r for r in res if r.estimator == "rloo")
        for r in res:
            rows.append(
                {
                    "mdp": mdp.name,
                    "horizon": reg.horizon,
                    "decision_step": reg.decision,
                    "noise": reg.noise,
                    "share_before_decision": float(share[reg.decision]),
                    "share_of_decision": float(share[reg.decision + 1] - share[reg.decision]),
                    "estimator": r.estimator,
                    "shape": r.rule,
                    "root_width": r.root_width,
                    "k": r.k,
                    "cost_edges": r.cost_edges,
                    "trace_cov_x_cost_vs_rloo": r.trace_cov_x_cost / ref.trace_cov_x_cost,
                    "grad_norm_var_vs_rloo": r.grad_norm_var / ref.grad_norm_var,
                    "cos_to_true": r.cos_to_true,
                    "cos_rloo": ref.cos_to_true,
                    "bias_max_abs_z": r.bias_max_abs_z,
                    "bias_p_bonferroni": r.bias_p_bonferroni,
                    "seconds": round(time.perf_counter() - t0, 2),
                }
            )
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per regime: the best independent-group row (rloo, or rloo with the same per-task prior,
    i.e. bpo_prior on the group) against the best tree row, by trace_cov x cost."""
    out: dict[str, Any] = {}
    for mdp in dict.fromkeys(r["mdp"] for r in rows):
        rs = [r for r in rows if r["mdp"] == mdp]
        group = min(
            (r for r in rs if r["shape"] == "none"), key=lambda r: r["trace_cov_x_cost_vs_rloo"]
        )
        tree = min(
            (r for r in rs if r["shape"] != "none"), key=lambda r: r["trace_cov_x_cost_vs_rloo"]
        )
        out[mdp] = {
            "best_group": f"{group['estimator']} ({group['trace_cov_x_cost_vs_rloo']:.2f})",
            "best_tree": f"{tree['estimator']} {tree['shape']} "
            f"({tree['trace_cov_x_cost_vs_rloo']:.2f})",
            "tree_over_group": round(
                tree["trace_cov_x_cost_vs_rloo"] / group["trace_cov_x_cost_vs_rloo"], 3
            ),
        }
    return out
