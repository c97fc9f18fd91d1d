"""``bpo compare``'s results: every method's runs over the seeds read back into
``summary.json`` (held-out success with 95% confidence intervals, gradient-norm variance,
policy updates to reach the best baseline's success, compute) and ``report.md`` with its plots,
and the table of the estimator-variance study appended to it."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from bpo.metrics import read_metrics

__all__ = ["append_variance", "summarize"]


def _ci95(x: Sequence[float]) -> tuple[float, float]:
    """Mean and half-width of a t-based 95% confidence interval (0 for a single seed)."""
    a = np.asarray(x, dtype=float)
    if len(a) < 2:
        return float(a.mean()) if len(a) else math.nan, 0.0
    return float(a.mean()), float(
        stats.t.ppf(0.975, len(a) - 1) * a.std(ddof=1) / math.sqrt(len(a))
    )


def _updates_to_reach(rows: list[dict[str, Any]], target: float, key: str) -> float:
    """Policy updates at the first iteration whose (3-iteration moving average of) ``key``
    reaches ``target``; inf if never."""
    pts = [(r.get("learner/updates", i + 1), r[key]) for i, r in enumerate(rows) if key in r]
    if not pts:
        return math.inf
    xs, ys = zip(*pts, strict=True)
    smooth = [float(np.mean(ys[max(0, i - 2) : i + 1])) for i in range(len(ys))]
    hit = [i for i, y in enumerate(smooth) if y >= target - 1e-12]
    return float(xs[hit[0]]) if hit else math.inf


def _success_key(rows: list[dict[str, Any]]) -> str:
    """The policy's own training success: one episode per root child (a tree's leaves
    over-represent its branch points); runs logged before that metric existed have leaves only."""
    return (
        "rollout/episode_success"
        if any("rollout/episode_success" in r for r in rows)
        else ("rollout/success")
    )


def summarize(out: Path, methods: Sequence[str], seeds: Sequence[int]) -> dict[str, Any]:
    """Read every run under ``out`` and compute the comparison (also writes summary.json)."""
    per: dict[str, Any] = {}
    curves: dict[str, list[list[dict[str, Any]]]] = {}
    for m in methods:
        finals, befores, gvars, walls, tokens = [], [], [], [], []
        curves[m] = []
        for s in seeds:
            run = out / m / f"seed{s}"
            summ = json.loads((run / "summary.json").read_text())
            rows = read_metrics(run)
            curves[m].append(rows)
            finals.append(summ["eval_after"]["success"])
            if summ.get("eval_before"):
                befores.append(summ["eval_before"]["success"])
            g = [r["learner/grad_norm"] for r in rows if "learner/grad_norm" in r]
            gvars.append(float(np.var(g)) if len(g) > 1 else 0.0)
            walls.append(sum(r.get("time/iteration_s", 0.0) for r in rows))
            tokens.append(sum(r.get("compute/generated_tokens", 0.0) for r in rows))
        mean, hw = _ci95(finals)
        per[m] = {
            "final_success": {"mean": mean, "ci95": hw, "per_seed": finals},
            "success_before": _ci95(befores)[0] if befores else None,
            "grad_norm_var": {"mean": float(np.mean(gvars)), "per_seed": gvars},
            "wall_seconds": float(np.mean(walls)),
            "generated_tokens": float(np.mean(tokens)),
        }
    baselines = [m for m in methods if not m.startswith("bpo")]
    ratios: dict[str, Any] = {}
    if "bpo" in per and baselines:
        best = max(baselines, key=lambda m: per[m]["final_success"]["mean"])
        # updates to reach the best baseline's final training success, in one measure on both
        # sides: its episodes' success over its last 3 iterations (mean over seeds), against
        # each seed's 3-iteration moving average of the same measure
        target = float(np.mean([
            np.mean([r[_success_key(rows)] for r in rows[-3:]]) for rows in curves[best]
        ]))  # fmt: skip
        for m in methods:
            ups = [_updates_to_reach(rows, target, _success_key(rows)) for rows in curves[m]]
            per[m]["updates_to_best_baseline_success"] = float(np.median(ups))
        b, o = per["bpo"], per[best]

        def ratio(x: float, y: float) -> float | None:
            return None if y == 0 or not math.isfinite(x) or not math.isfinite(y) else x / y

        ratios = {
            "best_baseline": best,
            "updates_target_train_success": target,
            "success": ratio(b["final_success"]["mean"], o["final_success"]["mean"]),
            "success_diff_points": 100 * (b["final_success"]["mean"] - o["final_success"]["mean"]),
            "grad_norm_var": ratio(b["grad_norm_var"]["mean"], o["grad_norm_var"]["mean"]),
            "updates_to_match": ratio(
                b["updates_to_best_baseline_success"], o["updates_to_best_baseline_success"]
            ),
            "generated_tokens": ratio(b["generated_tokens"], o["generated_tokens"]),
        }
    summary = {"methods": per, "ratios": ratios, "seeds": list(seeds),
               "curves": {m: [[{k: r[k] for k in r if k.split("/")[0] in
                                ("rollout", "learner", "compute", "eval", "iteration")}
                               for r in rows] for rows in runs] for m, runs in curves.items()}}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    _write_report(out, summary, curves)
    return summary


def _write_report(out: Path, summary: dict[str, Any], curves: dict[str, Any]) -> None:
    lines = ["# bpo compare", "", f"Seeds: {summary['seeds']}.", "",
             "| method | held-out success (95% CI) | before RL | grad-norm var | "
             "updates to best baseline | generated tokens | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for m, r in summary["methods"].items():
        fs = r["final_success"]
        before = r["success_before"]
        lines.append(
            f"| {m} | {fs['mean']:.3f} ± {fs['ci95']:.3f} | "
            f"{'' if before is None else f'{before:.3f}'} | {r['grad_norm_var']['mean']:.3g} | "
            f"{r.get('updates_to_best_baseline_success', math.nan):.0f} | "
            f"{r['generated_tokens']:.0f} | {r['wall_seconds']:.0f} |"
        )
    lines += ["", f"Ratios (BPO / best baseline): `{json.dumps(summary['ratios'])}`", ""]
    try:
        from bpo.curves import plot_curves
    except ImportError:  # the plotting module is optional for the summary itself
        plot_curves = None
    if plot_curves is not None:
        for x in ("learner/updates", "compute/generated_tokens", "compute/sandbox_steps",
                  "time/iteration_s"):  # fmt: skip
            name = f"success_vs_{x.split('/')[-1]}.png"
            plot_curves(curves, x, "rollout/episode_success", out / name)
            lines += [f"![success vs {x}]({name})", ""]
    (out / "report.md").write_text("\n".join(lines))


def append_variance(out: Path, study: dict[str, Any]) -> None:
    lines = [
        "", "## Estimator variance at the warm-started policy (seed 0)", "",
        "Batch gradients count-sketched to 4,096 dims; the reference direction is the mean "
        "batch gradient of the unbiased estimators (bpo, rloo).", "",
        "| method | trace cov | tokens / batch | trace cov x tokens | grad-norm var | "
        "cos to reference |", "| --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for m, r in study.items():
        lines.append(
            f"| {m} | {r['trace_cov']:.3g} | {r['cost_tokens']:.0f} | "
            f"{r['trace_cov_x_cost']:.3g} | {r['grad_norm_var']:.3g} | "
            f"{r['cos_to_reference']:.3f} |"
        )
    with open(out / "report.md", "a") as f:
        f.write("\n".join(lines) + "\n")
