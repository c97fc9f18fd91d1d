"""``bpo compare``: BPO against GRPO, RLOO, GiGPO and PPO in one harness, at matched compute.

Every method gets the same tasks, the same warm-started model (one supervised warm start per
seed, shared by all methods), the same optimizer and number of policy updates per iteration,
the same loss aggregation, and the same per-task budget in the chosen unit (generated tokens
by default): the budget decides how many episodes a baseline's group gets and how far a BPO
tree grows. Results over seeds go to ``summary.json`` and ``report.md`` with plots and 95%
confidence intervals.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from bpo.config import Config, ConfigError, load_config
from bpo.metrics import read_metrics

__all__ = ["METHODS", "main", "summarize"]

# method -> overrides. Baselines are independent groups (root with many children, no other
# branching) whose size the budget decides; BPO grows a tree under the same budget.
METHODS: dict[str, list[str]] = {
    "bpo": ["estimator=bpo", "tree.rule=entropy_quantile", "tree.root_width=2"],
    "grpo": ["estimator=grpo", "tree.rule=none", "tree.root_width=64"],
    "rloo": ["estimator=rloo", "tree.rule=none", "tree.root_width=64"],
    "gigpo": ["estimator=gigpo", "tree.rule=none", "tree.root_width=64"],
    "ppo": ["estimator=ppo", "tree.rule=none", "tree.root_width=64"],
    # other branch rules, for the ablation (--methods bpo,bpo-random,...)
    "bpo-random": ["estimator=bpo", "tree.rule=random", "tree.root_width=2"],
    "bpo-every": ["estimator=bpo", "tree.rule=every", "tree.root_width=2"],
    "bpo-tail": ["estimator=bpo", "tree.rule=tail", "tree.root_width=2"],
    "bpo-topk": ["estimator=bpo", "tree.rule=topk_backbone", "tree.root_width=2"],
}
DEFAULT_METHODS = ("bpo", "grpo", "rloo", "gigpo", "ppo")
QUICK = [
    "run.iterations=2", "run.tasks_per_iteration=2", "sandbox.num_train_tasks=4",
    "sandbox.num_eval_tasks=2", "sft.epochs=1", "budget.amount=100", "run.max_steps=6",
    "run.log_trees=1", "learner.epochs=1", "learner.minibatches=1",
]  # fmt: skip


def _ci95(x: Sequence[float]) -> tuple[float, float]:
    """Mean and half-width of a t-based 95% confidence interval (0 for a single seed)."""
    a = np.asarray(x, dtype=float)
    if len(a) < 2:
        return float(a.mean()) if len(a) else math.nan, 0.0
    return float(a.mean()), float(
        stats.t.ppf(0.975, len(a) - 1) * a.std(ddof=1) / math.sqrt(len(a))
    )


def _warm_start(cfg: Config, out: Path, seed: int) -> Path:
    """One supervised warm start per seed, and its held-out score (``eval_before.json``): every
    method starts from the saved model, so its score before RL is this one and is computed
    once (evaluation seeds its episodes per task, so a method's own evaluation would repeat
    it exactly)."""
    from bpo.train import Trainer

    root = out / f"sft-seed{seed}"
    path = root / "model"
    if (root / "eval_before.json").exists() and (path / "config.json").exists():
        return path
    trainer = Trainer(cfg, root)
    trainer.setup()
    if cfg.sft.episodes_per_task > 0:
        trainer.log(f"[compare] warm start seed {seed}: {trainer.bundle.warm_start(cfg.sft, seed)}")
    try:
        before = trainer.evaluate()
    finally:
        trainer.engine.close()
        trainer.metrics.close()
    path.mkdir(parents=True, exist_ok=True)
    trainer.bundle.model.save_pretrained(path)
    trainer.bundle.tokenizer.save_pretrained(path)
    tmp = root / "eval_before.json.tmp"
    tmp.write_text(json.dumps(before.__dict__))
    os.replace(tmp, root / "eval_before.json")  # last: its presence marks a finished warm start
    trainer.log(f"[compare] seed {seed} held-out success before RL: {before.success:.3f}")
    return path


def _train_method(config: str, overrides: list[str], run: Path, before_path: Path) -> dict:
    """One method's run from the shared warm start (resumed if it has checkpoints)."""
    from bpo.cluster.roles import run_trainer
    from bpo.train import EvalResult, Trainer

    cfg = load_config(config, overrides)
    before = EvalResult(**json.loads(before_path.read_text()))
    resume = (run / "checkpoints").exists()
    return run_trainer(  # on a Ray cluster when the config's cluster section says so
        cfg, str(run), resume,
        lambda p: Trainer(cfg, run, resume=resume, placement=p, eval_before=before).run(),
    )  # fmt: skip


def _in_child(log: Path, threads: int, parent: int, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` in a pool process: its output (file descriptors 1 and 2, so a sandbox's
    subprocesses too) goes to ``log``, and torch gets ``threads`` threads. When ``bpo
    compare`` (process ``parent``) dies, even by SIGKILL, the run gets SIGTERM: it checkpoints
    and stops, instead of running on as an orphan that a rerun would race."""
    _term_with_parent(parent)
    import torch

    torch.set_num_threads(threads)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    return fn(*args)


def _term_with_parent(parent: int) -> None:
    """SIGTERM to this process, once, when its parent dies (Linux ``PR_SET_PDEATHSIG``;
    elsewhere nothing: Ctrl-C still reaches every run, a kill of the parent alone does not).
    The kernel sends the death signal again each time the child passes to another thread of
    the dying parent, and a second SIGTERM stops ``bpo train`` at once, without its
    checkpoint: so the death signal is SIGUSR1, turned into one SIGTERM here."""
    if sys.platform.startswith("linux"):
        import ctypes

        def on_parent_death(signum: int, frame: Any) -> None:
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGUSR1, on_parent_death)
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGUSR1)
    if os.getppid() != parent:  # it died before the request took effect
        raise SystemExit("bpo compare stopped before this run started")


class _Jobs:
    """Runs compare's jobs in this process (``jobs=1``: live progress, Ctrl-C as in ``bpo
    train``) or in ``jobs`` fresh processes at once, each with ``cpu_count // jobs`` torch
    threads and its output in a log file (the runs are independent: on a CPU machine, where a
    tiny model's kernels do not use many cores well, two runs on one core each finish sooner
    than two runs in a row on two). Ctrl-C reaches every child, which checkpoints and stops as
    ``bpo train`` does; ``bpo compare`` then continues where they stopped. SIGTERM to ``bpo
    compare`` is passed on to the runs (the same clean stop), and a run whose ``bpo compare``
    died gets one (:func:`_term_with_parent`)."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.threads = max(1, (os.cpu_count() or 1) // jobs)
        self.pool: Any = None
        if jobs > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            os.environ.setdefault("OMP_NUM_THREADS", str(self.threads))  # read at child start
            self.pool = ProcessPoolExecutor(
                jobs, mp_context=mp.get_context("spawn"), max_tasks_per_child=1
            )

    def map(self, calls: list[tuple[str, Path, Callable[..., Any], tuple]]) -> list[Any]:
        """``calls``: (label, log file, function, args); results in order."""
        if self.pool is None:
            return [fn(*args) for _, _, fn, args in calls]
        import multiprocessing as mp
        from concurrent.futures import as_completed

        def on_term(signum: int, frame: Any) -> None:
            for child in mp.active_children():  # the pool's processes
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGTERM)  # type: ignore[arg-type]
            raise KeyboardInterrupt

        t0 = time.perf_counter()
        futures = {}
        for label, log, fn, args in calls:
            futures[self.pool.submit(_in_child, log, self.threads, os.getpid(), fn, *args)] = label
            print(f"[compare] queued {label} (output: {log})")
        results = {}
        old = signal.signal(signal.SIGTERM, on_term)
        try:
            for done, fut in enumerate(as_completed(futures), 1):
                results[fut] = fut.result()
                print(f"[compare] finished {futures[fut]} ({done}/{len(futures)}, "
                      f"{time.perf_counter() - t0:.0f}s)")  # fmt: skip
        finally:
            signal.signal(signal.SIGTERM, old)
        return [results[f] for f in futures]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def _variance_study(
    cfg_for: Callable[[str], Config], out: Path, methods: Sequence[str], batches: int, seed: int
) -> dict[str, Any]:
    """Gradient variance of every method at the warm-started policy (one seed)."""
    from bpo.analysis.gradvar import gradient_study
    from bpo.train import Trainer

    trainers: dict[str, Trainer] = {}
    rng = np.random.default_rng(seed)

    def sample_batch(method: str, b: int) -> tuple[Any, float]:
        if method not in trainers:
            tr = Trainer(cfg_for(method), out / "variance" / method, write=False)
            tr.setup()
            tasks = [(t, 0) for t in tr.train_tasks[: tr.cfg.run.tasks_per_iteration]]
            tr.engine.run(tasks)  # calibrates the budget's cost model; discarded
            trainers[method] = tr
        tr = trainers[method]
        n = tr.cfg.run.tasks_per_iteration
        idx = rng.choice(len(tr.train_tasks), n, replace=len(tr.train_tasks) < n)
        trees = tr.engine.run([(tr.train_tasks[i], int(rng.integers(1 << 30))) for i in idx])
        est = tr.cfg.estimator
        g = tr.learner.gradient(trees, est.name, **est.options)
        return g, float(sum(t.meta["compute"].generated_tokens for t in trees))

    try:
        return gradient_study(methods, sample_batch, batches, seed=seed)
    finally:
        for tr in trainers.values():
            tr.engine.close()


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
        from bpo.report import plot_curves
    except ImportError:  # the plotting module is optional for the summary itself
        plot_curves = None
    if plot_curves is not None:
        for x in ("learner/updates", "compute/generated_tokens", "compute/sandbox_steps",
                  "time/iteration_s"):  # fmt: skip
            name = f"success_vs_{x.split('/')[-1]}.png"
            plot_curves(curves, x, "rollout/episode_success", out / name)
            lines += [f"![success vs {x}]({name})", ""]
    (out / "report.md").write_text("\n".join(lines))


def _append_variance(out: Path, study: dict[str, Any]) -> None:
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


def _default_jobs(cfg: Config) -> int:
    import torch

    device = cfg.policy.device
    gpu = torch.cuda.is_available() if device == "auto" else not device.startswith("cpu")
    if cfg.cluster.address or gpu:
        return 1
    return max(1, min(8, os.cpu_count() or 1))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bpo compare", description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="dotted overrides applied to every method")
    ap.add_argument("--config", help="YAML config (default: the CPU demo config)")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma-separated, from: {', '.join(METHODS)}")  # fmt: skip
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--unit", choices=("tokens", "steps", "leaves"), help="budget unit")
    ap.add_argument("--quick", action="store_true", help="a reduced run for CI (minutes)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="runs at once, each in its own process (default: one per CPU core, at "
                         "most 8, on a CPU-only config; 1 when it uses a GPU or a Ray cluster)")  # fmt: skip
    ap.add_argument("--out", help="output directory (default: runs/compare-<time>)")
    ap.add_argument("--variance-batches", type=int, default=None,
                    help="batches per method for the gradient-variance study at the warm-started "
                         "policy of seed 0 (default 6; 3 with --quick; 0 = skip)")  # fmt: skip
    args = ap.parse_args(argv)
    from bpo.train import default_config_path

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        print(f"bpo compare: unknown methods {unknown}; valid: {', '.join(METHODS)}")
        return 2
    if args.jobs is not None and args.jobs < 1:
        print(f"bpo compare: --jobs must be >= 1 (got {args.jobs})")
        return 2
    common = (QUICK if args.quick else []) + list(args.overrides)
    if args.unit:
        common.append(f"budget.unit={args.unit}")
    out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    seeds = list(range(args.seeds))
    config = str(args.config or default_config_path())
    t0 = time.perf_counter()
    try:
        bases = {s: load_config(config, [*common, f"run.seed={s}"]) for s in seeds}
        for m in methods:  # every method's config is checked before any work
            load_config(config, [*common, *METHODS[m]])
    except ConfigError as e:
        print(f"bpo compare: {e}")
        return 2
    jobs = _Jobs(args.jobs or _default_jobs(bases[seeds[0]]))
    try:
        todo = [s for s in seeds if not (out / f"sft-seed{s}" / "eval_before.json").exists()]
        jobs.map([(f"warm start seed {s}", out / f"sft-seed{s}" / "log.txt", _warm_start,
                   (bases[s], out, s)) for s in todo])  # fmt: skip
        calls = []
        for s in seeds:
            model = out / f"sft-seed{s}" / "model"
            for m in methods:
                run = out / m / f"seed{s}"
                if (run / "summary.json").exists():
                    continue  # finished earlier (compare is resumable)
                over = [*common, *METHODS[m], f"run.seed={s}", f"policy.model={model}",
                        "sft.episodes_per_task=0"]  # fmt: skip
                before = out / f"sft-seed{s}" / "eval_before.json"
                calls.append((f"{m} seed {s}", run / "log.txt", _train_method,
                              (config, over, run, before)))  # fmt: skip
        if jobs.pool is None:
            for label, _, fn, a in calls:
                print(f"[compare] {label} -> {a[2]}")
                if fn(*a).get("interrupted"):
                    print("bpo compare: interrupted; run the same command to continue")
                    return 0
        elif any(r.get("interrupted") for r in jobs.map(calls)):
            print("bpo compare: interrupted; run the same command to continue")
            return 0
    except KeyboardInterrupt:
        print("bpo compare: interrupted; run the same command to continue")
        return 130
    finally:
        jobs.close()
    summary = summarize(out, methods, seeds)
    nvar = args.variance_batches if args.variance_batches is not None else (3 if args.quick else 6)
    if nvar > 0:
        model0 = out / "sft-seed0" / "model"

        def cfg_for(m: str) -> Config:
            return load_config(
                config,
                [*common, *METHODS[m], "run.seed=0", f"policy.model={model0}",
                 "sft.episodes_per_task=0"],
            )  # fmt: skip

        study = _variance_study(cfg_for, out, methods, nvar, seed=0)
        summary["variance_study"] = study
        base = [m for m in methods if not m.startswith("bpo")]
        if "bpo" in study and base:
            ref = min(base, key=lambda m: study[m]["trace_cov_x_cost"])
            denom = study[ref]["trace_cov_x_cost"]
            summary["ratios"]["trace_cov_x_cost_vs_best"] = (
                study["bpo"]["trace_cov_x_cost"] / denom if denom > 0 else None
            )  # None: no gradient signal (every return equal), nothing to compare
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        _append_variance(out, study)
    for m, r in summary["methods"].items():
        fs = r["final_success"]
        print(f"{m:10s} held-out success {fs['mean']:.3f} ± {fs['ci95']:.3f}")
    print(f"ratios: {summary['ratios']}")
    print(
        f"wrote {out / 'summary.json'} and {out / 'report.md'} in {time.perf_counter() - t0:.0f}s"
    )
    return 0
