"""Tree-growing choices that can bias BPO, each on an MDP built to expose it.

* ``topk_backbone`` (the labelled non-causal ablation) on ``trap``;
* the engine's budget stop (``budget_mode="engine"``: queued forks dropped once the budget is
  spent) on ``budget_trap``, against the causal reservation rule (``"reserve"``);
* the entropy the rule sees: the sampled action's own ("action", like the engine's default
  mean-token entropy, which it computes after sampling the backbone's action) against the
  state's ("state", like first-token entropy), on a random tree MDP whose per-action turn
  entropies vary (:func:`bpo.analysis.mdp.with_action_entropy`).

Each check is a pair of rows (the causal reference and the suspect) with the same budget.
:func:`run_engine_checks` repeats them on trees grown by the real rollout engine.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bpo.analysis.families import budget_trap, random_tree, trap
from bpo.analysis.forest import batch_gradients, forest_advantages, make_forest
from bpo.analysis.mdp import exact, with_action_entropy
from bpo.analysis.metrics import event_counts, gradient_stats
from bpo.analysis.sampling import TreeShape
from bpo.analysis.study import Setting, StudyConfig, entropy_threshold_for, run_mdp

__all__ = ["run_checks", "run_engine_checks"]


def run_checks(cfg: StudyConfig) -> list[dict[str, Any]]:
    """Rows: check, variant, expected ("unbiased" or "biased"), and the row's statistics."""
    out: list[dict[str, Any]] = []

    def add(check: str, mdp: Any, settings: list[tuple[str, str, Setting]], index: int) -> None:
        rows = run_mdp(mdp, cfg, [s for _, _, s in settings], index=index)
        for (variant, expected, _), row in zip(settings, rows, strict=True):
            d = row.to_dict()
            d.update(check=check, variant=variant, expected=expected)
            out.append(d)

    m = trap()
    opts = {"k": 4}
    add(
        "topk_backbone",
        m,
        [
            (
                "fixed_depths steps=[1,2] (causal)",
                "unbiased",
                Setting(
                    "fixed_depths",
                    TreeShape(2, "fixed_depths", {**opts, "steps": [1, 2]}, 24),
                    ("bpo",),
                ),
            ),
            (
                "topk_backbone b=1 (hindsight)",
                "biased",
                Setting(
                    "topk_backbone", TreeShape(2, "topk_backbone", {**opts, "b": 1}, 24), ("bpo",)
                ),
            ),
        ],
        2000,
    )

    m = budget_trap()
    shape = {"k": 4, "steps": [0]}
    add(
        "budget_stop",
        m,
        [
            (
                "reserve: children fixed before sampling",
                "unbiased",
                Setting("fixed_depths", TreeShape(1, "fixed_depths", shape, 40), ("bpo",)),
            ),
            (
                "engine: drop queued forks once spent",
                "biased",
                Setting(
                    "fixed_depths",
                    TreeShape(1, "fixed_depths", shape, 12, budget_mode="engine"),
                    ("bpo",),
                ),
            ),
        ],
        2001,
    )

    m = with_action_entropy(random_tree(seed=3, horizon=3, actions=2, logit_scale=0.5), 0.5, 1)
    thr = entropy_threshold_for(m, exact(m))
    rule = {"k": 4, "threshold": thr}
    add(
        "entropy_source",
        m,
        [
            (
                "state entropy (first token)",
                "unbiased",
                Setting("entropy_threshold", TreeShape(2, "entropy_threshold", rule, 24), ("bpo",)),
            ),
            (
                "sampled action's entropy (mean token)",
                "biased",
                Setting(
                    "entropy_threshold",
                    TreeShape(2, "entropy_threshold", rule, 24, entropy="action"),
                    ("bpo",),
                ),
            ),
        ],
        2002,
    )
    return out


def run_engine_checks(n_trees: int = 3000, seed: int = 0) -> list[dict[str, Any]]:
    """The same checks on trees grown by the real :class:`bpo.rollout.engine.RolloutEngine`
    (``mdp`` sandbox, tabular policy; see :mod:`bpo.analysis.bridge`), 4 trees per batch.

    A construction the engine cannot run is reported with its ``error``.
    """
    from bpo.analysis.bridge import engine_trees
    from bpo.branching import make_rule
    from bpo.rollout.budget import Budget
    from bpo.rollout.engine import RolloutConfig

    def config(width: int, amount: float, entropy: str, mode: str = "expected") -> RolloutConfig:
        budget = Budget(unit="steps", amount=amount, mode=mode)
        return RolloutConfig(width, max_steps=40, budget=budget, entropy=entropy, concurrency=8)

    cases = [
        ("engine_budget_stop", "no binding budget", "unbiased", "budget_trap-0", "fixed_depths",
         {"k": 4, "steps": [0]}, config(1, 1e9, "first"), None),
        ("engine_budget_stop", "budget 12 steps, expected mode (default): K fixed before "
         "sampling", "unbiased", "budget_trap-0", "fixed_depths", {"k": 4, "steps": [0]},
         config(1, 12, "first"), None),
        ("engine_budget_stop", "budget 12 steps, hard mode: queued forks dropped", "biased",
         "budget_trap-0", "fixed_depths", {"k": 4, "steps": [0]},
         config(1, 12, "first", "hard"), None),
        ("engine_entropy", "entropy='first' (the default)", "unbiased", "random-3", "entropy_threshold",
         {"k": 3, "threshold": 0.9}, config(2, 1e9, "first"), 1.0),
        ("engine_entropy", "entropy='mean'", "biased", "random-3",
         "entropy_threshold", {"k": 3, "threshold": 0.9}, config(2, 1e9, "mean"), 1.0),
        ("engine_topk", "topk_backbone b=1, root_width 2", "biased", "agent-1", "topk_backbone",
         {"k": 3, "b": 1}, config(2, 1e9, "first"), None),
    ]  # fmt: skip
    out: list[dict[str, Any]] = []
    for i, (check, variant, expected, task, rule, opts, cfg, spread) in enumerate(cases):
        row: dict[str, Any] = {"check": check, "variant": variant, "expected": expected,
                               "mdp": task, "estimator": "bpo", "rule": rule}  # fmt: skip
        rng = np.random.default_rng([seed, 3000 + i])
        try:
            mdp, trees, _ = engine_trees(
                task, range(n_trees), make_rule(rule, **opts), cfg, rng, spread
            )
        except Exception as e:  # the construction crashes inside the engine: report it
            row.update(error=f"{type(e).__name__}: {e}", bias_max_abs_z=float("nan"),
                       bias_coords=0, bias_p_bonferroni=float("nan"), scale=float("nan"),
                       scale_z=float("nan"))  # fmt: skip
            out.append(row)
            continue
        row.update(_engine_stats(mdp, trees)._asdict())
        out.append(row)
    return out


def _engine_stats(mdp: Any, trees: list[Any]) -> Any:
    forest = make_forest(trees, mdp)
    res = forest_advantages("bpo", forest, mdp)
    nb = len(trees) // 4
    batch = np.minimum(np.arange(len(trees)) // 4, nb - 1)
    g_hat = batch_gradients(forest, res, mdp, batch, nb, mdp.probs())
    e = np.flatnonzero(forest.parents >= 0)
    param = mdp.param_of[forest.states[forest.parents[e]]]
    seen, other = event_counts(
        batch[forest.tree[e]], param, forest.actions[e], nb, mdp.logits.shape
    )
    return gradient_stats(g_hat, exact(mdp).grad.ravel(), (seen >= 30) & (other >= 30))
