"""Monte-Carlo study of every registered estimator x branch rule at matched edge budget.

Matching (exactly what "same budget" means here):

* a *batch* is a number M of trees of one task, all grown with the same shape, and its budget
  is ``batch_episodes * E[L]`` edges, where E[L] is the exact expected episode length;
* M is drawn per batch from {floor(m), ceil(m)} with mean m = budget / c, where c is the mean
  edges per tree measured on ``pilot_trees`` trees sampled before (and not used in) the study.
  M is independent of the trees, so the batch mean stays unbiased, and every method spends the
  same expected number of edges per batch (``cost_edges`` reports the measured mean);
* the batch gradient is the mean over its M trees of ``sum_e w(e) A(e) grad log pi(a_e|s_e)``;
* independent groups (rloo, grpo, gigpo, and bpo as a check) use ``root_width = N`` and rule
  ``none``; trees use ``root_width`` backbones, K children per branch node and a per-tree
  budget of N * H edges (never more than the N-group can spend).

Rules are given options computed from the MDP and the policy only (never from returns):
see :func:`rule_options`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from bpo import estimators
from bpo.analysis.forest import (
    Forest,
    batch_gradients,
    check_against_compute,
    forest_advantages,
    make_forest,
    root_values,
)
from bpo.analysis.mdp import Exact, TabularMDP, exact, prefix_share, state_entropy
from bpo.analysis.metrics import event_counts, gradient_stats
from bpo.analysis.sampling import TreeSampler, TreeShape
from bpo.branching import BRANCH_RULES
from bpo.estimators import TreeError

__all__ = [
    "Row",
    "Setting",
    "StudyConfig",
    "accepts_trees",
    "default_settings",
    "rule_options",
    "run_setting",
]


@dataclass(frozen=True)
class StudyConfig:
    """Sizes of the Monte-Carlo study."""

    group_size: int = 8
    """N: episodes per independent group; the per-tree edge budget is N * H."""
    root_width: int = 2
    """Backbones per tree for the branching rows."""
    k: int = 4
    """Children per branch node for the branching rules (``every`` uses 2)."""
    batch_episodes: float = 32.0
    """Batch budget in episodes' worth of edges: batch_episodes * E[L]."""
    n_batches: int = 400
    """Batches per row (the statistics are over batches)."""
    pilot_trees: int = 64
    """Trees sampled first to measure the mean tree size (and warm the rule up); discarded."""
    check_trees: int = 3
    """Trees per row whose advantages are recomputed with bpo.estimators.compute."""
    root_baseline: str = "previous"
    """Per-task baseline from earlier iterations for estimators that take one (``bpo`` uses it
    only for edges above the first branch point when root_width = 1; ``bpo_prior`` mixes it
    into the root's leave-one-out): "previous" batch, "pilot" trees, or "none"."""
    min_events: int = 30
    """A coordinate (p, b) enters the bias z-test only if action b and some other action were
    taken from logit row p in at least this many batches each (normal approximation)."""
    seed: int = 0


@dataclass(frozen=True)
class Setting:
    """One pool of trees (a shape on an MDP) and the estimators evaluated on it."""

    rule_label: str
    shape: TreeShape
    estimators: tuple[str, ...]


@dataclass(frozen=True)
class Row:
    """One (mdp, estimator, rule) result."""

    mdp: str
    estimator: str
    rule: str
    shape: str
    root_width: int
    k: int
    tree_budget: int | None
    bias_max_abs_z: float
    bias_coords: int
    bias_p_bonferroni: float
    scale: float
    scale_z: float
    trace_cov: float
    cost_edges: float
    trace_cov_x_cost: float
    mse: float
    grad_norm_var: float
    grad_norm_mean: float
    cos_to_true: float
    cos_stderr: float
    batches: int
    trees_per_batch: float
    leaves_per_batch: float
    branch_nodes_per_tree: float
    checked_edges: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        d.update(extra)
        return d


def accepts_trees(name: str) -> bool:
    """Whether an estimator accepts trees that branch below the root (probed on a tiny tree)."""
    try:
        estimators.compute(name, [-1, 0, 0, 1, 1], [0, 0, 1, 0, 1], fingerprints=[0, 1, 1, 2, 2])
    except TreeError:
        return False
    return True


def _weighted_quantile(x: np.ndarray, w: np.ndarray, q: float) -> float:
    order = np.argsort(x)
    cw = np.cumsum(w[order])
    return float(x[order][np.searchsorted(cw, q * cw[-1])])


def entropy_threshold_for(mdp: TabularMDP, ex: Exact, quantile: float = 0.8) -> float:
    """The visit-weighted ``quantile`` of the policy's entropy over live states; when no
    visited state lies strictly above it (few distinct entropies), the largest visited entropy
    below the maximum, so that the rule (``entropy > threshold``) fires somewhere."""
    live = (~mdp.terminal) & (ex.occupancy > 0)
    ent = state_entropy(mdp)[live]
    thr = _weighted_quantile(ent, ex.occupancy[live], quantile)
    if not np.any(ent > thr + 1e-12):
        below = ent[ent < ent.max() - 1e-12]
        thr = float(below.max()) if len(below) else float(ent.max()) - 1e-9
    return round(thr + 1e-9, 9)


def rule_options(rule: str, mdp: TabularMDP, ex: Exact, cfg: StudyConfig) -> dict[str, Any]:
    """Options for each shipped rule, from the MDP's horizon and the policy's entropies only.

    entropy_threshold: :func:`entropy_threshold_for`; entropy_quantile: window 512 (the policy
    is fixed, and the rule recomputes the quantile of its window at every decision);
    fixed_depths: steps H//3 and 2H//3; random: p = 2/H; every: K = 2; topk_backbone: b = 2;
    seeds come from the study seed. Unknown (newly registered) rules get ``k`` only.
    """
    h = mdp.horizon
    k = cfg.k
    if rule == "entropy_threshold":
        return {"k": k, "threshold": entropy_threshold_for(mdp, ex)}
    if rule == "entropy_quantile":
        return {"k": k, "window": 512}
    if rule == "every":
        return {"k": 2}
    if rule == "fixed_depths":
        return {"k": k, "steps": sorted({max(1, h // 3), max(1, 2 * h // 3)})}
    if rule == "random":
        return {"k": k, "p": min(1.0, 2.0 / h), "seed": cfg.seed}
    if rule == "tail":
        return {"k": k, "seed": cfg.seed}
    if rule == "topk_backbone":
        return {"k": k, "b": 2}
    if rule == "none":
        return {}
    return {"k": k}


def default_settings(mdp: TabularMDP, ex: Exact, cfg: StudyConfig) -> list[Setting]:
    """Independent groups for every estimator + one tree pool per branch rule."""
    names = estimators.names()
    tree_est = tuple(n for n in names if accepts_trees(n))
    settings = [Setting("none", TreeShape(cfg.group_size, "none"), tuple(names))]
    budget = cfg.group_size * mdp.horizon
    for rule in BRANCH_RULES.names():
        if rule == "none":
            continue
        opts = rule_options(rule, mdp, ex, cfg)
        shape = TreeShape(cfg.root_width, rule, opts, budget)
        settings.append(Setting(rule, shape, tree_est))
    return settings


def run_setting(
    mdp: TabularMDP,
    ex: Exact,
    setting: Setting,
    cfg: StudyConfig,
    rng: np.random.Generator,
) -> list[Row]:
    """Sample one pool of trees and evaluate every estimator of the setting on it."""
    t0 = time.perf_counter()
    sampler = TreeSampler(mdp, setting.shape, rng)
    pilot = [sampler.sample() for _ in range(cfg.pilot_trees)]
    sampler.end_iteration()
    mean_edges = float(np.mean([t.edges for t in pilot]))
    budget = cfg.batch_episodes * ex.mean_length
    m = budget / mean_edges
    sizes = np.floor(m).astype(np.int64) + (rng.random(cfg.n_batches) < m - np.floor(m))
    sizes = np.maximum(sizes, 1)
    trees = []
    for size in sizes:
        trees.extend(sampler.sample() for _ in range(int(size)))
        sampler.end_iteration()
    sample_seconds = time.perf_counter() - t0
    forest = make_forest(trees, mdp)
    batch_of_tree = np.repeat(np.arange(cfg.n_batches), sizes)
    edges = np.bincount(batch_of_tree, weights=[t.edges for t in trees])
    leaves = np.bincount(batch_of_tree, weights=[t.leaves for t in trees])
    branch_nodes = float(np.mean([t.branch_nodes for t in trees]))
    per_tree = _root_baselines(forest, make_forest(pilot, mdp), batch_of_tree, sizes, cfg)
    probs = mdp.probs()
    edges_idx = np.flatnonzero(forest.parents >= 0)
    seen, seen_other = event_counts(
        batch_of_tree[forest.tree[edges_idx]],
        mdp.param_of[forest.states[forest.parents[edges_idx]]],
        forest.actions[edges_idx],
        cfg.n_batches,
        mdp.logits.shape,
    )
    testable = (seen >= cfg.min_events) & (seen_other >= cfg.min_events)
    check = _check_indices(len(trees), cfg.check_trees, rng)
    g = ex.grad.ravel()
    rows = []
    for name in setting.estimators:
        t1 = time.perf_counter()
        res = forest_advantages(name, forest, mdp, per_tree=per_tree)
        checked = check_against_compute(name, forest, mdp, res, check, per_tree=per_tree)
        gh = batch_gradients(forest, res, mdp, batch_of_tree, cfg.n_batches, probs)
        st = gradient_stats(gh, g, testable)
        cost = float(edges.mean())
        rows.append(
            Row(
                mdp=mdp.name,
                estimator=name,
                rule=setting.rule_label,
                shape=setting.shape.label,
                root_width=setting.shape.root_width,
                k=int(setting.shape.rule_options.get("k", 1)),
                tree_budget=setting.shape.budget,
                cost_edges=cost,
                trace_cov_x_cost=st.trace_cov * cost,
                trees_per_batch=float(sizes.mean()),
                leaves_per_batch=float(leaves.mean()),
                branch_nodes_per_tree=branch_nodes,
                checked_edges=checked,
                seconds=sample_seconds / len(setting.estimators) + time.perf_counter() - t1,
                **st._asdict(),
            )
        )
    return rows


def _root_baselines(
    forest: Forest,
    pilot: Forest,
    batch_of_tree: np.ndarray,
    sizes: np.ndarray,
    cfg: StudyConfig,
) -> dict[str, np.ndarray]:
    """Per-tree ``root_baseline`` and ``prior_weight`` from trees sampled *before* the batch.

    "previous": the mean root value of the previous batch's trees (the pilot trees for the
    first batch), weighted by the number of root children it averages -- a per-task baseline
    from the last iteration. "pilot": the pilot trees' mean for every batch (a long moving
    average). "none": no baseline from earlier iterations.
    """
    if cfg.root_baseline == "none":
        return {}
    pv = root_values(pilot)
    pilot_mean = float(pv.mean())
    pilot_children = float(pilot.num_children[pilot.roots].sum())
    if cfg.root_baseline == "pilot":
        t = forest.num_trees
        return {"root_baseline": np.full(t, pilot_mean), "prior_weight": np.full(t, pilot_children)}
    values = root_values(forest)
    children = forest.num_children[forest.roots].astype(np.float64)
    nb = len(sizes)
    mean = np.bincount(batch_of_tree, weights=values, minlength=nb) / sizes
    count = np.bincount(batch_of_tree, weights=children, minlength=nb)
    prev_mean = np.concatenate([[pilot_mean], mean[:-1]])
    prev_count = np.concatenate([[pilot_children], count[:-1]])
    return {
        "root_baseline": prev_mean[batch_of_tree],
        "prior_weight": prev_count[batch_of_tree],
    }


def _check_indices(n: int, k: int, rng: np.random.Generator) -> list[int]:
    if k <= 0 or n == 0:
        return []
    first = [0]
    rest = rng.choice(n, size=min(n, k - 1), replace=False).tolist() if k > 1 else []
    return sorted(set(first + rest))


def mdp_meta(mdp: TabularMDP, ex: Exact) -> dict[str, Any]:
    """What a reader needs to know about an MDP row: size, J, variance, prefix shares."""
    try:
        share = [round(float(x), 4) for x in prefix_share(mdp)]
    except ValueError:
        share = None
    return {
        "name": mdp.name,
        "description": mdp.description,
        "horizon": mdp.horizon,
        "states": mdp.num_states,
        "gradient_coords": mdp.num_params * mdp.num_actions,
        "J": ex.j,
        "return_var": ex.return_var,
        "mean_length": ex.mean_length,
        "grad_norm": float(np.linalg.norm(ex.grad)),
        "prefix_share": share,
    }


def run_mdp(
    mdp: TabularMDP,
    cfg: StudyConfig,
    settings: Sequence[Setting] | None = None,
    index: int = 0,
) -> list[Row]:
    """Every setting on one MDP (default: :func:`default_settings`)."""
    ex = exact(mdp)
    rows = []
    for j, setting in enumerate(settings or default_settings(mdp, ex, cfg)):
        rng = np.random.default_rng([cfg.seed, index, j])
        rows.extend(run_setting(mdp, ex, setting, cfg, rng))
    return rows
