"""Curves over runs: a metrics key against another from each run's ``metrics.jsonl``, one line
per method, the mean over its runs (seeds) with a 95% confidence band (Student t).
:func:`plot_curves` draws one PNG (``bpo compare`` uses it); :func:`draw_curves` draws onto a
matplotlib axis (the panels of a run report, :mod:`bpo.report`).

x axes: ``iteration`` and ``learner/updates`` are read as logged. Per-iteration counters
(``compute/*``, ``time/*``) are summed over iterations, so "success vs generated tokens" means
success against the tokens generated so far.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "LABELS",
    "NOT_CUMULATIVE",
    "Row",
    "draw_curves",
    "is_cumulative",
    "label",
    "mean_ci",
    "plot_curves",
    "pyplot",
    "save_figure",
    "series",
]

Row = Mapping[str, Any]

LABELS: dict[str, str] = {
    "iteration": "iteration",
    "learner/updates": "policy updates",
    "compute/generated_tokens": "generated tokens",
    "compute/sandbox_steps": "sandbox steps",
    "compute/wall_seconds": "rollout wall time (s)",
    "time/iteration_s": "wall time (s)",
    "rollout/success": "success rate",
    "rollout/episode_success": "success rate",
    "rollout/return": "mean return",
    "eval/success": "held-out success",
    "learner/grad_norm": "gradient norm (before clipping)",
    "learner/grad_norm_var": "grad-norm variance (window)",
    "loss/pg": "policy-gradient loss",
    "tree/leaves": "leaves per tree",
    "tree/branch_nodes": "branch nodes per tree",
    "tree/all_equal_group_frac": "all-equal sibling groups",
    "tree/branch_entropy_mean": "entropy at branch points",
}
NOT_CUMULATIVE = frozenset({"compute/token_efficiency"})
"""Ratios under ``compute/`` that must not be summed over iterations."""


def label(key: str) -> str:
    """Human-readable axis label of a metrics key."""
    return LABELS.get(key, key)


def is_cumulative(key: str) -> bool:
    """Whether ``key`` is a per-iteration counter that an x axis sums over iterations."""
    return key.startswith(("compute/", "time/")) and key not in NOT_CUMULATIVE


# -- series and statistics --------------------------------------------------------------------
def series(
    rows: Sequence[Row], x: str, y: str, *, cumulative: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) points of one run, skipping rows where ``y`` is missing or not finite (e.g.
    ``eval/success`` is logged only every few iterations). With ``cumulative`` (default:
    :func:`is_cumulative` of ``x``) x is the running sum of ``x`` over all rows."""
    cum = is_cumulative(x) if cumulative is None else cumulative
    xs: list[float] = []
    ys: list[float] = []
    acc = 0.0
    for row in rows:
        xv = row.get(x)
        if xv is None or not math.isfinite(xv):
            continue
        if cum:
            acc += float(xv)
            xv = acc
        yv = row.get(y)
        if yv is None or not math.isfinite(yv):
            continue
        xs.append(float(xv))
        ys.append(float(yv))
    return np.array(xs), np.array(ys)


def mean_ci(
    curves: Sequence[tuple[np.ndarray, np.ndarray]], points: int = 100
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean and 95% confidence band (Student t over runs) of several runs' curves.

    Runs logged at the same x values are averaged point by point; otherwise (e.g. x = tokens,
    which differs by seed) each is interpolated on ``points`` values spanning the x range that
    every run covers. One run gives a band of zero width. Returns (x, mean, low, high)."""
    curves = [(x, y) for x, y in curves if len(x)]
    if not curves:
        empty = np.zeros(0)
        return empty, empty, empty, empty
    x0 = curves[0][0]
    if all(len(x) == len(x0) and np.array_equal(x, x0) for x, _ in curves):
        grid = x0
        ys = np.stack([y for _, y in curves])  # [runs, points]
    else:
        lo, hi = max(x[0] for x, _ in curves), min(x[-1] for x, _ in curves)
        if hi < lo:  # the runs do not overlap: average over the union instead of failing
            lo, hi = min(x[0] for x, _ in curves), max(x[-1] for x, _ in curves)
        grid = np.linspace(lo, hi, points)
        ys = np.stack([np.interp(grid, x, y) for x, y in curves])  # [runs, points]
    mean = ys.mean(axis=0)
    n = len(ys)
    if n < 2:
        return grid, mean, mean.copy(), mean.copy()
    from scipy import stats

    half = stats.t.ppf(0.975, n - 1) * ys.std(axis=0, ddof=1) / math.sqrt(n)
    return grid, mean, mean - half, mean + half


# -- drawing ----------------------------------------------------------------------------------
def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (figures to files, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_curves(
    ax: Any,
    runs_by_method: Mapping[str, Sequence[Sequence[Row]]],
    x: str,
    y: str,
    *,
    cumulative: bool | None = None,
) -> int:
    """Draw one line per method (mean over its runs) with its 95% band on a matplotlib axis.
    Returns how many lines had data."""
    drawn = 0
    for method, runs in runs_by_method.items():
        curves = [series(rows, x, y, cumulative=cumulative) for rows in runs]
        n = sum(1 for cx, _ in curves if len(cx))
        grid, mean, lo, hi = mean_ci(curves)
        if not len(grid):
            continue
        name = method if n == 1 or len(runs_by_method) == 1 else f"{method} (n={n})"
        (line,) = ax.plot(grid, mean, marker="o" if len(grid) <= 30 else None, ms=3, label=name)
        if n > 1:
            ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
        drawn += 1
    ax.set_xlabel(label(x) + (" (so far)" if (cumulative or is_cumulative(x)) else ""))
    if x in ("iteration", "learner/updates"):
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(label(y))
    ax.grid(alpha=0.3)
    return drawn


def plot_curves(
    runs_by_method: Mapping[str, Sequence[Sequence[Row]]],
    x: str,
    y: str,
    path: str | Path,
    *,
    title: str | None = None,
    cumulative: bool | None = None,
) -> Path:
    """One PNG: ``y`` against ``x`` for each method, mean over its runs with a 95% CI band.

    ``runs_by_method`` maps a method name to its runs, each a list of ``metrics.jsonl`` rows
    (see :func:`bpo.metrics.read_metrics`)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    if draw_curves(ax, runs_by_method, x, y, cumulative=cumulative) == 0:
        ax.text(0.5, 0.5, f"no {y} logged", ha="center", va="center", transform=ax.transAxes)
    if len(runs_by_method) > 1:
        ax.legend(fontsize=8)
    ax.set_title(title or f"{label(y)} vs {label(x)}")
    return save_figure(fig, Path(path))


def save_figure(fig: Any, path: Path) -> Path:
    """Save ``fig`` as ``path`` (its folder created) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    pyplot().close(fig)
    return path
