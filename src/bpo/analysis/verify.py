"""Exact check of every registered estimator on tabular MDPs (``bpo verify``).

Phases:
1. the main table: every registered estimator x branch rule on each MDP at matched budget;
2. checks: tree-growing choices that bias BPO, on MDPs built to expose them, with the study's
   sampler and (full run, or ``--engine-checks``) with the real rollout engine;
3. (full run, or ``--sweep``) the regime sweep: where trees beat independent groups.

Writes JSON ``{"rows": [...], "checks": [...], "sweep": [...], "meta": {...}}`` and prints
rich tables. Exit code 1 when a row that must be unbiased (rloo, bpo and its variants under
causal rules) shows a bias (Bonferroni p < ``--alpha``), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from bpo import estimators
from bpo.analysis.checks import run_checks, run_engine_checks
from bpo.analysis.families import make_mdp
from bpo.analysis.mdp import TabularMDP, exact
from bpo.analysis.regimes import run_sweep, summarise
from bpo.analysis.study import Row, StudyConfig, mdp_meta, run_mdp
from bpo.analysis.tables import markdown, pivot_specs, plot, print_specs, specs
from bpo.branching import BRANCH_RULES

__all__ = ["main", "study_mdps"]

UNBIASED = ("rloo", "bpo", "bpo_prior")
"""Estimators that must be unbiased under causal rules (grpo, gigpo are biased by design)."""


def study_mdps(quick: bool) -> list[TabularMDP]:
    """The MDPs of the main table (quick: small ones)."""
    if quick:
        specs: list[tuple[str, dict[str, Any]]] = [
            ("random", {"horizon": 3, "actions": 3}),
            ("agent", {"horizon": 12, "decisions": (2, 8)}),
            ("chain", {"length": 4, "horizon": 6}),
            ("trap", {}),
        ]
    else:
        specs = [
            ("random", {"horizon": 4, "actions": 3}),
            ("random", {"horizon": 4, "actions": 2, "noise": "gaussian", "step_rewards": True}),
            ("agent", {"horizon": 16, "decisions": (3, 10)}),
            ("agent", {"horizon": 16, "decisions": (3, 10), "noise": "none"}),
            ("agent", {"horizon": 32, "decisions": (28, 30)}),
            ("chain", {"length": 5, "horizon": 8}),
            ("trap", {}),
        ]
    return [make_mdp(f, **kw) for f, kw in specs]


def _relative(rows: list[dict[str, Any]]) -> None:
    """Add ratios to the same MDP's RLOO row (independent groups, matched budget)."""
    ref = {r["mdp"]: r for r in rows if r["estimator"] == "rloo" and r["rule"] == "none"}
    for r in rows:
        base = ref.get(r["mdp"])
        if base is None:
            continue
        r["trace_cov_x_cost_vs_rloo"] = r["trace_cov_x_cost"] / base["trace_cov_x_cost"]
        r["grad_norm_var_vs_rloo"] = r["grad_norm_var"] / base["grad_norm_var"]
        r["cos_vs_rloo"] = r["cos_to_true"] - base["cos_to_true"]


def _failures(rows: list[dict[str, Any]], alpha: float) -> list[dict[str, Any]]:
    causal = {n for n in BRANCH_RULES.names() if getattr(BRANCH_RULES.get(n), "causal", True)}
    return [
        r
        for r in rows
        if r["estimator"] in UNBIASED
        and r["rule"] in causal
        and r.get("expected", "unbiased") == "unbiased"
        and r["bias_p_bonferroni"] < alpha
    ]


def _git_rev() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bpo verify", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small MDPs, fewer batches (< 60 s)")
    p.add_argument(
        "--json",
        type=Path,
        default=Path("runs/verify/verify.json"),
        help="where to write the JSON results (default: %(default)s)",
    )
    p.add_argument("--plot", type=Path, default=None, help="write a PNG comparing methods")
    p.add_argument(
        "--markdown", type=Path, default=None, help="write compact markdown tables (reports)"
    )
    p.add_argument("--seed", type=int, default=0, help="base seed of every random stream")
    p.add_argument(
        "--batches", type=int, default=None, help="batches per row (default 150 quick, 600 full)"
    )
    p.add_argument(
        "--check-batches",
        type=int,
        default=None,
        help="batches per row of the checks (default: max(1000, --batches))",
    )
    p.add_argument(
        "--engine-checks",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="repeat the checks on trees grown by bpo.rollout.engine (default: full run only)",
    )
    p.add_argument(
        "--sweep",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the regime sweep (default: on for the full run, off with --quick)",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=1e-4,
        help="Bonferroni p below which an unbiased estimator's row fails",
    )
    args = p.parse_args(list(argv) if argv is not None else None)

    t_start = time.perf_counter()
    nb = args.batches or (150 if args.quick else 600)
    cfg = StudyConfig(n_batches=nb, batch_episodes=16.0, pilot_trees=32, seed=args.seed)
    mdps = study_mdps(args.quick)
    rows: list[dict[str, Any]] = []
    # 1. main table
    for i, mdp in enumerate(mdps):
        t0 = time.perf_counter()
        res: list[Row] = run_mdp(mdp, cfg, index=i)
        rows.extend(r.to_dict() for r in res)
        print(
            f"[verify] {mdp.name}: {len(res)} rows in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    _relative(rows)
    # 2. checks
    t0 = time.perf_counter()
    nc = args.check_batches or max(nb, 1000)
    checks = run_checks(
        StudyConfig(n_batches=nc, batch_episodes=16.0, pilot_trees=32, seed=args.seed)
    )
    if args.engine_checks if args.engine_checks is not None else not args.quick:
        checks += run_engine_checks(3000, args.seed)
    print(f"[verify] checks in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    # 3. sweep
    sweep: list[dict[str, Any]] = []
    if args.sweep if args.sweep is not None else not args.quick:
        t0 = time.perf_counter()
        sweep = run_sweep(
            StudyConfig(
                n_batches=min(nb, 400), batch_episodes=16.0, pilot_trees=32, seed=args.seed
            ),
            quick=args.quick,
        )
        print(f"[verify] sweep in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    print_specs(specs(rows, checks, sweep))
    missing = sorted(set(estimators.names()) - {r["estimator"] for r in rows})
    failures = _failures(rows + checks, args.alpha)
    meta = {
        "command": "bpo verify " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "seconds": round(time.perf_counter() - t_start, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "git": _git_rev(),
        "config": asdict(cfg),
        "estimators": estimators.names(),
        "estimators_without_rows": missing,
        "branch_rules": BRANCH_RULES.names(),
        "mdps": [mdp_meta(m, exact(m)) for m in mdps],
        "sweep_summary": summarise(sweep) if sweep else None,
        "failures": [(r["mdp"], r["estimator"], r["rule"]) for r in failures],
        "matching": "M trees per batch, M in {floor(m), ceil(m)} with mean m = batch_episodes * "
        "E[L] / mean edges per tree (pilot trees); trees use root_width backbones "
        "and a per-tree budget of N * H edges",
    }
    out = {"rows": rows, "checks": checks, "sweep": sweep, "meta": meta}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=_jsonable))
        print(f"[verify] wrote {args.json}", file=sys.stderr)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(pivot_specs(rows) + specs([], checks, sweep)[1:]))
        print(f"[verify] wrote {args.markdown}", file=sys.stderr)
    if args.plot:
        plot(rows, args.plot)
        print(f"[verify] wrote {args.plot}", file=sys.stderr)
    print(
        f"[verify] {len(rows)} rows, {len(checks)} checks, {len(sweep)} sweep rows in "
        f"{meta['seconds']} s",
        file=sys.stderr,
    )
    if missing:
        print(f"[verify] FAIL: no rows for estimators {missing}", file=sys.stderr)
        return 1
    if failures:
        for r in failures:
            print(
                f"[verify] FAIL: {r['estimator']} under {r['rule']} on {r['mdp']} looks biased "
                f"(max |z| {r['bias_max_abs_z']:.2f}, Bonferroni p {r['bias_p_bonferroni']:.2g})",
                file=sys.stderr,
            )
        return 1
    return 0


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, tuple | set):
        return list(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
