"""``bpo compare``: BPO against GRPO, RLOO, GiGPO and PPO in one harness, at matched compute.

Every method gets the same tasks, the same warm-started model (one supervised warm start per
seed, shared by all methods), the same optimizer and number of policy updates per iteration,
the same loss aggregation, and the same per-task budget in the chosen unit (generated tokens
by default): the budget decides how many episodes a baseline's group gets and how far a BPO
tree grows. Results over seeds go to ``summary.json`` and ``report.md`` with plots and 95%
confidence intervals.

The warm starts and runs go through :class:`bpo.jobs.Jobs` (in spawned processes at once, or
one after another); :mod:`bpo.compare_report` reads the finished runs back (``summarize``,
re-exported here).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from bpo.compare_report import append_variance, summarize
from bpo.config import Config, ConfigError, load_config
from bpo.jobs import Job, Jobs, default_jobs

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


def _variance_method(
    method: str, cfg: Config, out: Path, batches: int, seed: int
) -> dict[str, np.ndarray]:
    """One method's part of the gradient-variance study at the warm-started policy:
    ``batches`` batches of ``run.tasks_per_iteration`` trees, each turned into its policy
    gradient's count sketch. Every method draws the same tasks and rollout seeds (one
    generator from ``seed``): common random numbers, so the methods differ by their estimator
    and tree shape, not by the draw. Saved to ``variance/<method>.npz``; a rerun of compare
    reads it back."""
    from bpo.analysis.gradvar import gradient_samples
    from bpo.train import Trainer

    path = out / "variance" / f"{method}.npz"
    if path.exists():
        with np.load(path) as f:
            return dict(f)
    tr = Trainer(cfg, out / "variance" / method, write=False)
    tr.setup()
    rng = np.random.default_rng(seed)
    n = tr.cfg.run.tasks_per_iteration

    def sample_batch(b: int) -> tuple[Any, float]:
        idx = rng.choice(len(tr.train_tasks), n, replace=len(tr.train_tasks) < n)
        trees = tr.engine.run([(tr.train_tasks[i], int(rng.integers(1 << 30))) for i in idx])
        est = tr.cfg.estimator
        g = tr.learner.gradient(trees, est.name, **est.options)
        return g, float(sum(t.meta["compute"].generated_tokens for t in trees))

    try:
        tasks = [(t, 0) for t in tr.train_tasks[:n]]
        tr.engine.run(tasks)  # calibrates the budget's cost model; discarded
        samples = gradient_samples(sample_batch, batches, seed=seed)
    finally:
        tr.engine.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **samples)
    os.replace(tmp, path)
    return samples


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
    args = ap.parse_intermixed_args(argv)  # overrides may follow the options
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
    nvar = args.variance_batches if args.variance_batches is not None else (3 if args.quick else 6)
    jobs = Jobs(args.jobs or default_jobs(bases[seeds[0]]))
    try:
        # one list, in priority order: warm starts, then each seed's runs as soon as its warm
        # start is done, then the variance study's short jobs to fill the gaps at the end
        todo: list[Job] = []
        warm: dict[int, str | None] = {}
        for s in seeds:
            warm[s] = None
            if not (out / f"sft-seed{s}" / "eval_before.json").exists():
                warm[s] = f"warm start seed {s}"
                todo.append(Job(warm[s], out / f"sft-seed{s}" / "log.txt", _warm_start,
                                (bases[s], out, s)))  # fmt: skip
        for s in seeds:
            model = out / f"sft-seed{s}" / "model"
            for m in methods:
                run = out / m / f"seed{s}"
                if (run / "summary.json").exists():
                    continue  # finished earlier (compare is resumable)
                over = [*common, *METHODS[m], f"run.seed={s}", f"policy.model={model}",
                        "sft.episodes_per_task=0"]  # fmt: skip
                before = out / f"sft-seed{s}" / "eval_before.json"
                todo.append(Job(f"{m} seed {s}", run / "log.txt", _train_method,
                                (config, over, run, before), warm[s]))  # fmt: skip
        if nvar > 0:  # at seed 0's warm-started policy
            for m in methods:
                cfg = load_config(
                    config,
                    [*common, *METHODS[m], "run.seed=0",
                     f"policy.model={out / 'sft-seed0' / 'model'}", "sft.episodes_per_task=0"],
                )  # fmt: skip
                todo.append(Job(f"variance {m}", out / "variance" / f"{m}.log",
                                _variance_method, (m, cfg, out, nvar, 0), warm[0]))  # fmt: skip
        results = jobs.map(todo)
        if any(isinstance(r, dict) and r.get("interrupted") for r in results):
            print("bpo compare: interrupted; run the same command to continue")
            return 0
    except KeyboardInterrupt:
        print("bpo compare: interrupted; run the same command to continue")
        return 130
    finally:
        jobs.close()
    summary = summarize(out, methods, seeds)
    if nvar > 0:
        from bpo.analysis.gradvar import gradient_summary

        samples = {j.label.removeprefix("variance "): r for j, r in zip(todo, results, strict=True)
                   if j.label.startswith("variance ")}  # fmt: skip
        study = gradient_summary(samples)
        summary["variance_study"] = study
        base = [m for m in methods if not m.startswith("bpo")]
        if "bpo" in study and base:
            ref = min(base, key=lambda m: study[m]["trace_cov_x_cost"])
            denom = study[ref]["trace_cov_x_cost"]
            summary["ratios"]["trace_cov_x_cost_vs_best"] = (
                study["bpo"]["trace_cov_x_cost"] / denom if denom > 0 else None
            )  # None: no gradient signal (every return equal), nothing to compare
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        append_variance(out, study)
    for m, r in summary["methods"].items():
        fs = r["final_success"]
        print(f"{m:10s} held-out success {fs['mean']:.3f} ± {fs['ci95']:.3f}")
    print(f"ratios: {summary['ratios']}")
    print(
        f"wrote {out / 'summary.json'} and {out / 'report.md'} in {time.perf_counter() - t0:.0f}s"
    )
    return 0
