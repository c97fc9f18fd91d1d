"""Plots and a markdown report for a training run (DESIGN section 7).

:func:`write_run_report` draws the run's curves into ``RUN_DIR/plots/`` and writes
``RUN_DIR/report.md`` (``bpo report RUN_DIR``; ``bpo view`` embeds the same figures). The
curves themselves (a key against another, mean over runs with a 95% band) are
:mod:`bpo.curves`, re-exported here; ``bpo compare`` draws its plots with them too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

# the curves, re-exported (they were defined here before they had a module of their own)
from bpo.curves import LABELS as LABELS
from bpo.curves import NOT_CUMULATIVE as NOT_CUMULATIVE
from bpo.curves import (
    Row,
    draw_curves,
    is_cumulative,
    label,
    mean_ci,
    plot_curves,
    pyplot,
    save_figure,
    series,
)
from bpo.metrics import read_metrics

__all__ = [
    "Plot",
    "RunData",
    "draw_curves",
    "held_out_rows",
    "load_run",
    "main",
    "mean_ci",
    "plot_curves",
    "run_plots",
    "series",
    "write_run_report",
]


@dataclass(frozen=True)
class RunData:
    """What a run directory holds, read once."""

    path: Path
    rows: tuple[dict[str, Any], ...]
    """``metrics.jsonl``, one row per iteration."""
    config: dict[str, Any]
    summary: dict[str, Any] | None
    """``summary.json`` (None while the run has not finished)."""

    def total(self, key: str) -> float:
        return float(sum(r.get(key, 0.0) for r in self.rows))

    def last(self, key: str) -> float | None:
        for row in reversed(self.rows):
            if key in row:
                return float(row[key])
        return None

    def eval_success(self, which: str) -> float | None:
        e = (self.summary or {}).get(which)
        return None if not e else float(e["success"])


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory; fails with a clear message when it is not one."""
    path = Path(run_dir)
    if not (path / "metrics.jsonl").exists() and not (path / "config.yaml").exists():
        raise FileNotFoundError(
            f"{path} is not a bpo run directory (no metrics.jsonl or config.yaml); "
            "pass the directory that `bpo train --out` wrote"
        )
    cfg_path, sum_path = path / "config.yaml", path / "summary.json"
    config = (yaml.safe_load(cfg_path.read_text()) or {}) if cfg_path.exists() else {}
    summary = json.loads(sum_path.read_text()) if sum_path.exists() else None
    return RunData(path, tuple(read_metrics(path)), config, summary)


@dataclass(frozen=True)
class Plot:
    """One figure of a run report."""

    title: str
    path: Path


_SUCCESS_AXES = (
    ("iteration", "iteration"),
    ("generated tokens", "compute/generated_tokens"),
    ("sandbox steps", "compute/sandbox_steps"),
    ("wall time", "time/iteration_s"),
)


Panel = tuple[str, str, Mapping[str, tuple[str, Sequence[Sequence[Row]]]]]
"""(x, y label key, {line name: (y key, runs)}) of one panel."""


def _panels(path: Path, title: str, panels: Sequence[Panel]) -> Plot:
    """A column of panels (it fits the viewer's side bar and reads well in markdown)."""
    plt = pyplot()
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(4.6, 0.3 + 2.2 * len(panels)), dpi=100, sharex=True
    )
    axes = np.atleast_1d(axes)
    for ax, (x, ylabel, lines) in zip(axes, panels, strict=True):
        drawn = sum(draw_curves(ax, {name: runs}, x, y) for name, (y, runs) in lines.items())
        ax.set_ylabel(label(ylabel))
        if drawn == 0:
            ax.text(0.5, 0.5, f"no {ylabel} logged", ha="center", va="center",
                    transform=ax.transAxes)  # fmt: skip
        elif len(lines) > 1:
            ax.legend(fontsize=8)
    for ax in axes[:-1]:
        ax.set_xlabel("")
    axes[0].set_title(title, fontsize=10)
    return Plot(title, save_figure(fig, path))


def held_out_rows(run: RunData) -> list[dict[str, Any]]:
    """The run's rows with ``eval/success`` also at the start (the score before RL, at
    iteration 0 and zero compute) and at the end (the final evaluation, unless the last
    iteration logged one)."""
    rows: list[dict[str, Any]] = [dict(r) for r in run.rows]
    before, after = run.eval_success("eval_before"), run.eval_success("eval_after")
    if after is not None and rows and "eval/success" not in rows[-1]:
        rows[-1]["eval/success"] = after
    if before is not None:
        start = {"iteration": 0.0, "learner/updates": 0.0, "eval/success": before}
        start.update({k: 0.0 for k in {k for r in rows for k in r} if is_cumulative(k)})
        rows.insert(0, start)
    return rows


def run_plots(run: RunData, out_dir: str | Path) -> list[Plot]:
    """Draw a run's figures into ``out_dir`` (PNG, matplotlib Agg): success and return against
    iterations, generated tokens, sandbox steps and wall time (held-out success included, with
    the score before RL at 0); gradient norm, its variance and the loss; tree shape; held-out
    success before and after."""
    out = Path(out_dir)
    rows = list(run.rows)
    held_out = held_out_rows(run)
    wall = (
        "time/iteration_s" if any("time/iteration_s" in r for r in rows) else "compute/wall_seconds"
    )
    plots = []
    for name, x in _SUCCESS_AXES:
        x = wall if name == "wall time" else x
        success = {
            "train episodes": ("rollout/episode_success", [rows]),
            "train leaves": ("rollout/success", [rows]),
            "held-out": ("eval/success", [held_out]),
        }
        ret = {"train rollouts": ("rollout/return", [rows])}
        panels: list[Panel] = [(x, "rollout/success", success), (x, "rollout/return", ret)]
        path = out / f"success_vs_{name.replace(' ', '_')}.png"
        plots.append(_panels(path, f"Success and return vs {name}", panels))
    learner = ("learner/grad_norm", "learner/grad_norm_var", "loss/pg")
    plots.append(_panels(out / "learner.png", "Gradients and loss",
                         [("iteration", y, {"run": (y, [rows])}) for y in learner]))  # fmt: skip
    shape = ("tree/leaves", "tree/branch_nodes", "tree/all_equal_group_frac",
             "tree/branch_entropy_mean")  # fmt: skip
    plots.append(_panels(out / "tree_shape.png", "Tree shape",
                         [("iteration", y, {"run": (y, [rows])}) for y in shape]))  # fmt: skip
    plots.append(_eval_bars(run, out / "eval.png"))
    return plots


def _eval_bars(run: RunData, path: Path) -> Plot:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.6, 2.6), dpi=100)
    names = ["before RL", "after RL"]
    vals = [run.eval_success("eval_before"), run.eval_success("eval_after")]
    bars = ax.bar(names, [v or 0.0 for v in vals], color=["#9e9e9e", "#1f77b4"], width=0.5)
    for bar, v in zip(bars, vals, strict=True):
        text = "n/a" if v is None else f"{v:.3f}"
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center",
                va="bottom", fontsize=9)  # fmt: skip
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("held-out success")
    ax.set_title("Held-out evaluation", fontsize=10)
    return Plot("Held-out evaluation", save_figure(fig, path))


def _fmt(v: float | None, digits: int = 3) -> str:
    """A rate or mean (``digits`` decimals); whole numbers >= 1 as counts."""
    if v is None:
        return "n/a"
    if float(v).is_integer() and abs(v) >= 1:
        return f"{int(v):,}"
    return f"{v:.{digits}f}"


def _count(v: float | None) -> str:
    return "n/a" if v is None else f"{round(v):,}"


def summary_numbers(run: RunData) -> list[tuple[str, str]]:
    """The headline numbers of a run, as (name, formatted value) pairs."""
    before, after = run.eval_success("eval_before"), run.eval_success("eval_after")
    delta = "" if before is None or after is None else f" ({after - before:+.3f})"
    s = run.summary or {}
    wall = run.total("time/iteration_s") or run.total("compute/wall_seconds")
    return [
        ("held-out success before RL", _fmt(before)),
        ("held-out success after RL", _fmt(after) + delta),
        ("iterations", _count(s.get("iterations", len(run.rows)))),
        ("policy updates", _count(s.get("policy_updates", run.last("learner/updates")))),
        ("train episode success (last iteration)", _fmt(run.last("rollout/episode_success"))),
        ("train leaf success (last iteration)", _fmt(run.last("rollout/success"))),
        ("generated tokens", _count(run.total("compute/generated_tokens"))),
        ("sandbox steps", _count(run.total("compute/sandbox_steps"))),
        ("wall time (s)", _fmt(wall, 1)),
    ]


def describe_config(config: Mapping[str, Any]) -> str:
    """One line naming the method of a run (sandbox, estimator, branch rule, budget, model)."""

    def g(section: str, key: str) -> Any:
        v = (config.get(section) or {}).get(key)
        return int(v) if isinstance(v, float) and v.is_integer() else v

    parts = [f"sandbox `{g('sandbox', 'name')}`", f"estimator `{g('estimator', 'name')}`",
             f"branch rule `{g('tree', 'rule')}` (k={g('tree', 'k')}, "
             f"root width {g('tree', 'root_width')})",
             f"budget {g('budget', 'amount')} {g('budget', 'unit')} per task",
             f"model `{g('policy', 'model')}`", f"seed {g('run', 'seed')}"]  # fmt: skip
    return " · ".join(parts)


def write_run_report(run_dir: str | Path) -> Path:
    """Draw the run's plots into ``RUN_DIR/plots/`` and write ``RUN_DIR/report.md``."""
    run = load_run(run_dir)
    plots = run_plots(run, run.path / "plots")
    lines = [f"# Run report: {run.path.name}", ""]
    if run.config:
        lines += [describe_config(run.config), ""]
    if run.summary is None:
        lines += ["**The run has not finished** (no `summary.json`): numbers so far.", ""]
    lines += ["## Summary", "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in summary_numbers(run)]
    lines += ["", "## Curves", ""]
    for p in plots:
        lines += [f"### {p.title}", "", f"![{p.title}]({p.path.relative_to(run.path)})", ""]
    if run.rows:
        last = run.rows[-1]
        lines += [f"## Last iteration ({int(last['iteration'])})", "", "| metric | value |",
                  "| --- | --- |"]  # fmt: skip
        lines += [f"| `{k}` | {_fmt(v, 4)} |" for k, v in sorted(last.items()) if k != "iteration"]
        lines.append("")
    lines += ["Sampled trees: `bpo view " + str(run.path) + "` (writes `view.html`).", ""]
    path = run.path / "report.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str]) -> int:
    """``bpo report RUN_DIR``: (re)generate a run's plots and report.md."""
    import argparse

    ap = argparse.ArgumentParser(prog="bpo report", description=main.__doc__)
    ap.add_argument("run_dir", help="a run directory written by `bpo train`")
    args = ap.parse_args(argv)
    try:
        path = write_run_report(args.run_dir)
    except FileNotFoundError as e:
        print(f"bpo report: {e}")
        return 2
    print(f"report: {path}")
    return 0
