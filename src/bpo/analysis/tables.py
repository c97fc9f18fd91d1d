"""Presentation of ``bpo verify`` results: rich tables, markdown tables and a PNG.

Every table is built once as a :class:`TableSpec` (title, columns, rows of strings) and then
printed with rich or rendered as markdown, so the terminal and BENCHMARKS.md show the same
numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = ["TableSpec", "markdown", "pivot_specs", "plot", "print_specs", "specs"]

Rows = list[dict[str, Any]]


class TableSpec(NamedTuple):
    title: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not np.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"


def specs(rows: Rows, checks: Rows, sweep: Rows) -> list[TableSpec]:
    """The full tables: one line per (mdp, estimator, rule), per check and per sweep row."""
    out = [
        TableSpec(
            "Estimators x branch rules at matched edges per batch (ratios vs RLOO)",
            ("mdp", "estimator", "rule", "bias z (coords)", "p", "scale", "trace_cov", "edges",
             "tcov x cost", "vs rloo", "gnorm var", "vs rloo", "cos"),
            [
                (r["mdp"], r["estimator"], r["rule"],
                 f"{fmt(r['bias_max_abs_z'])} ({r['bias_coords']})",
                 fmt(r["bias_p_bonferroni"], 2), fmt(r["scale"]), fmt(r["trace_cov"]),
                 f"{r['cost_edges']:.0f}", fmt(r["trace_cov_x_cost"]),
                 fmt(r.get("trace_cov_x_cost_vs_rloo")), fmt(r["grad_norm_var"]),
                 fmt(r.get("grad_norm_var_vs_rloo")), f"{r['cos_to_true']:.3f}")
                for r in rows
            ],
        )
    ]  # fmt: skip
    if checks:
        out.append(
            TableSpec(
                "Checks: tree-growing choices that bias BPO",
                ("check", "variant", "expected", "bias z (coords)", "p", "scale", "scale z",
                 "note"),
                [
                    (r["check"], r["variant"], r["expected"],
                     f"{fmt(r['bias_max_abs_z'])} ({r['bias_coords']})",
                     fmt(r["bias_p_bonferroni"], 2), fmt(r["scale"]), fmt(r["scale_z"]),
                     r.get("error", ""))
                    for r in checks
                ],
            )
        )  # fmt: skip
    if sweep:
        out.append(
            TableSpec(
                "Regime sweep (agent MDPs, one uncertain decision; ratios vs RLOO N=8)",
                ("mdp", "share before", "share of decision", "estimator", "shape",
                 "tcov x cost", "gnorm var", "cos", "cos rloo"),
                [
                    (r["mdp"], f"{r['share_before_decision']:.2f}",
                     f"{r['share_of_decision']:.2f}", r["estimator"], r["shape"],
                     f"{r['trace_cov_x_cost_vs_rloo']:.2f}", f"{r['grad_norm_var_vs_rloo']:.2f}",
                     f"{r['cos_to_true']:.3f}", f"{r['cos_rloo']:.3f}")
                    for r in sweep
                ],
            )
        )  # fmt: skip
    return out


def pivot_specs(rows: Rows) -> list[TableSpec]:
    """Compact tables for reports: one line per estimator/rule, one column per MDP."""
    mdps = list(dict.fromkeys(r["mdp"] for r in rows))
    keys = list(dict.fromkeys((r["estimator"], r["rule"]) for r in rows))
    cell = {(r["mdp"], r["estimator"], r["rule"]): r for r in rows}

    def table(title: str, value: Any) -> TableSpec:
        body = []
        for est, rule in keys:
            vals = [cell.get((m, est, rule)) for m in mdps]
            body.append((f"{est} / {rule}", *(value(v) if v else "-" for v in vals)))
        return TableSpec(title, ("estimator / rule", *mdps), body)

    return [
        table("trace_cov x cost, relative to RLOO (lower is better)",
              lambda r: fmt(r.get("trace_cov_x_cost_vs_rloo"), 2)),
        table("cosine of the batch gradient with the exact gradient (higher is better)",
              lambda r: f"{r['cos_to_true']:.3f}"),
        table("variance of the gradient norm, relative to RLOO",
              lambda r: fmt(r.get("grad_norm_var_vs_rloo"), 2)),
        table("bias: max |z| over tested coordinates (Bonferroni p)",
              lambda r: f"{r['bias_max_abs_z']:.1f} ({fmt(r['bias_p_bonferroni'], 1)})"),
        table("scale = mean <g_hat, g> / |g|^2 (1 = unbiased along g)",
              lambda r: f"{r['scale']:.2f}"),
    ]  # fmt: skip


def print_specs(tables: list[TableSpec]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=170)
    for spec in tables:
        t = Table(title=spec.title)
        for col in spec.columns:
            t.add_column(col)
        for row in spec.rows:
            t.add_row(*row)
        console.print(t)


def markdown(tables: list[TableSpec]) -> str:
    parts = []
    for spec in tables:
        lines = [f"**{spec.title}**", "", "| " + " | ".join(spec.columns) + " |"]
        lines.append("| " + " | ".join("---" for _ in spec.columns) + " |")
        lines += ["| " + " | ".join(row) + " |" for row in spec.rows]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def plot(rows: Rows, path: Path) -> None:
    """Per MDP: trace_cov x cost relative to RLOO (top) and cosine to the exact gradient."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mdps = list(dict.fromkeys(r["mdp"] for r in rows))
    fig, axes = plt.subplots(2, len(mdps), figsize=(4.2 * len(mdps), 7.5), squeeze=False)
    for j, name in enumerate(mdps):
        rs = [r for r in rows if r["mdp"] == name]
        labels = [f"{r['estimator']}/{r['rule']}" for r in rs]
        y = np.arange(len(rs))
        colors = ["tab:gray" if r["rule"] == "none" else "tab:blue" for r in rs]
        ax = axes[0, j]
        ax.barh(y, [r.get("trace_cov_x_cost_vs_rloo", np.nan) for r in rs], color=colors)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks(y, labels, fontsize=7)
        ax.set_title(f"{name}\ntrace_cov x cost / RLOO", fontsize=8)
        ax = axes[1, j]
        err = [2 * r["cos_stderr"] for r in rs]
        ax.barh(y, [r["cos_to_true"] for r in rs], xerr=err, color=colors)
        ax.set_yticks(y, labels, fontsize=7)
        ax.set_xlim(0, 1)
        ax.set_title("cosine to the exact gradient (2 s.e.)", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
