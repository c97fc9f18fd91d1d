"""``bpo train``: the training loop, one visible loop with numbered phases.

Setup: tasks (train and held-out splits), the model (a local path, a tiny model built on the
environment's own text, or SmolLM2), the policy backend, the learner, the rollout engine.
Warm start: supervised fine-tuning on the environment's expert trajectories.
Then, every iteration:

1. rollouts: one tree (BPO) or group (baselines) per training task, at the configured budget;
2. update: advantages from the estimator, ``epochs * minibatches`` optimizer steps;
3. the policy's prefix cache is dropped (the weights changed);
4. metrics (one line in ``metrics.jsonl``, TensorBoard), a checkpoint, periodic evaluation.

Everything a run produces goes into its run directory.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from bpo import agent, estimators
from bpo.branching import BranchRule, make_rule
from bpo.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from bpo.config import Config, ConfigError, load_config, to_dict
from bpo.learner import Learner
from bpo.metrics import MetricsLogger, tree_metrics
from bpo.report import write_run_report
from bpo.rollout import Budget, RolloutConfig, RolloutEngine
from bpo.sandbox import list_tasks, make_env
from bpo.tree import Tree

__all__ = ["EvalResult", "Trainer", "main"]


@dataclass(frozen=True)
class EvalResult:
    success: float
    mean_return: float
    mean_steps: float
    per_task: dict[str, float] = field(default_factory=dict)

    def as_metrics(self, prefix: str = "eval/") -> dict[str, float]:
        return {
            prefix + "success": self.success,
            prefix + "return": self.mean_return,
            prefix + "steps": self.mean_steps,
        }


class Interrupted(Exception):
    pass


class Trainer:
    def __init__(
        self, cfg: Config, run_dir: str | Path, *, resume: bool = False, write: bool = True
    ) -> None:
        """``write=False`` opens an existing run read-only (for ``bpo eval``)."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.write = write
        self.iteration = 0
        self.log: Callable[[str], None] = print

    # -- setup ---------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg_path = self.run_dir / "config.yaml"
        resolved = to_dict(cfg)
        if self.resume:
            if not cfg_path.exists():
                raise ConfigError(f"--resume {self.run_dir}: no config.yaml there (not a run dir)")
            old = yaml.safe_load(cfg_path.read_text())
            if old != resolved:
                diff = sorted(
                    f"{s}.{k}" for s in resolved for k in resolved[s]
                    if old.get(s, {}).get(k) != resolved[s][k]
                )  # fmt: skip
                raise ConfigError(
                    f"--resume {self.run_dir}: the run was made with a different config "
                    f"(differs in {', '.join(diff[:8])}); resume without overrides or start a "
                    "new run directory"
                )
        elif self.write:
            cfg_path.write_text(yaml.safe_dump(resolved, sort_keys=False))
        torch.manual_seed(cfg.run.seed)
        np.random.seed(cfg.run.seed)
        s = cfg.sandbox
        # ``n`` lets generating environments make only what is needed; others ignore it
        self.train_tasks = list(
            list_tasks(s.name, s.train_split, n=s.num_train_tasks, **s.options)
        )[: s.num_train_tasks]
        self.eval_tasks = list(list_tasks(s.name, s.eval_split, n=s.num_eval_tasks, **s.options))[
            : s.num_eval_tasks
        ]
        if not self.train_tasks or not self.eval_tasks:
            raise ConfigError(
                f"sandbox {s.name!r} listed no tasks for {s.train_split}/{s.eval_split}"
            )
        self.env_factory = lambda: make_env(s.name, s.backend, **s.options)
        resuming = (self.resume or not self.write) and (self.run_dir / "checkpoints").exists()
        self.bundle = agent.build(
            cfg, self.run_dir, self.env_factory, self.train_tasks, need_demos=not resuming
        )
        self.learner = Learner(
            self.bundle.model, cfg.learner, pad_id=self.bundle.pad_id,
            critic=cfg.estimator.name == "ppo",
        )  # fmt: skip
        self.rule = self._make_rule()
        self.engine = self._engine(
            self.rule,
            cfg.tree.root_width,
            cfg.policy.temperature,
            Budget(cfg.budget.unit, cfg.budget.amount, cfg.budget.mode, cfg.budget.truncate),
        )
        self.task_rng = np.random.default_rng(cfg.run.seed)
        if self.write:
            self.metrics = MetricsLogger(self.run_dir)

    def _make_rule(self) -> BranchRule:
        t = self.cfg.tree
        if t.rule == "none":
            return make_rule("none", **t.options)
        return make_rule(t.rule, k=t.k, **t.options)

    def _engine(
        self, rule: BranchRule, width: int, temperature: float, budget: Budget
    ) -> RolloutEngine:
        b = self.bundle
        rc = RolloutConfig(
            root_width=width, max_steps=self.cfg.run.max_steps, budget=budget,
            entropy=self.cfg.tree.entropy, concurrency=self.cfg.run.concurrency,
        )  # fmt: skip
        return RolloutEngine(
            b.policy, b.prompter, b.parse, rule, self.env_factory, rc, b.sampling(temperature)
        )

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(self, tasks: list[str] | None = None) -> EvalResult:
        tasks = tasks or self.eval_tasks
        e = self.cfg.eval
        width = 1 if e.temperature == 0 else max(1, e.episodes_per_task)
        budget = Budget("leaves", float(width), mode="hard", min_rollouts=width)
        engine = self._engine(make_rule("none"), width, e.temperature, budget)
        try:
            trees = engine.run([(t, 1_000_003 + i) for i, t in enumerate(tasks)])
        finally:
            engine.close()
        self.bundle.policy.clear_cache()
        per_task = {t.task: float(np.mean(t.returns() > 0)) for t in trees}
        rets = np.concatenate([t.returns() for t in trees])
        steps = [t.nodes[leaf].step for t in trees for leaf in t.leaves()]
        return EvalResult(float(np.mean(rets > 0)), float(np.mean(rets)), float(np.mean(steps)),
                          per_task)  # fmt: skip

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self) -> Path:
        state = {
            "iteration": self.iteration,
            "updates": self.learner.updates,
            "rng": rng_state(),
            "task_rng": self.task_rng.bit_generator.state,
            "rule": self.rule,
            "costs": self.engine.costs.state_dict(),
            "policy_rng": self.bundle.policy_rng_state(),
            "eval_before": getattr(self, "eval_before", None),
        }
        return save_checkpoint(
            self.run_dir / "checkpoints", self.iteration, self.bundle.trainable_state(),
            self.learner.optimizer.state_dict(), state,
        )  # fmt: skip

    def load(self) -> bool:
        root = self.run_dir / "checkpoints"
        if not root.exists():
            return False
        ck = load_checkpoint(root)
        for msg in ck.skipped:
            self.log(f"[resume] skipped {msg}")
        self.bundle.load_trainable_state(ck.weights)
        self.learner.optimizer.load_state_dict(ck.optimizer)
        st = ck.state
        self.iteration = int(st["iteration"])
        self.learner.updates = int(st["updates"])
        set_rng_state(st["rng"])
        self.task_rng.bit_generator.state = st["task_rng"]
        self.rule = st["rule"]
        self.engine.rule = self.rule
        self.engine.costs.load_state_dict(st["costs"])
        self.bundle.set_policy_rng_state(st["policy_rng"])
        self.eval_before = st.get("eval_before")
        self.metrics.truncate_after(self.iteration)
        self.log(f"[resume] from {ck.path.name} (iteration {self.iteration})")
        return True

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.setup()
        resumed = self.resume and self.load()
        if not resumed:
            if cfg.sft.episodes_per_task > 0:
                sft = self.bundle.warm_start(cfg.sft, cfg.run.seed)
                self.log(f"[warm start] {sft}")
            self.eval_before = self.evaluate()
            self.log(f"[eval] held-out success before RL: {self.eval_before.success:.3f}")
            self.save()
        stop = {"flag": False}

        def on_sigint(signum: int, frame: Any) -> None:
            stop["flag"] = True

        old = signal.signal(signal.SIGINT, on_sigint)
        try:
            while self.iteration < cfg.run.iterations and not stop["flag"]:
                self._iteration()
        finally:
            signal.signal(signal.SIGINT, old)
            if stop["flag"]:
                self.save()
                self.log(f"[interrupted] checkpoint saved at iteration {self.iteration}")
        after = self.evaluate()
        summary = {
            "eval_before": self.eval_before.__dict__ if self.eval_before else None,
            "eval_after": after.__dict__,
            "iterations": self.iteration,
            "policy_updates": self.learner.updates,
            "interrupted": stop["flag"],
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.log(f"[report] {write_run_report(self.run_dir)}")
        self.metrics.close()
        self.engine.close()
        return summary

    def _iteration(self) -> None:
        cfg = self.cfg
        t0 = time.perf_counter()
        # 1. rollouts
        idx = self.task_rng.choice(
            len(self.train_tasks),
            cfg.run.tasks_per_iteration,
            replace=len(self.train_tasks) < cfg.run.tasks_per_iteration,
        )
        seeds = self.task_rng.integers(0, 2**31 - 1, len(idx))
        trees: list[Tree] = self.engine.run(
            [(self.train_tasks[i], int(s)) for i, s in zip(idx, seeds, strict=True)]
        )
        t1 = time.perf_counter()
        # 2. update
        upd = self.learner.update(trees, cfg.estimator.name, **cfg.estimator.options)
        # 3. the weights changed: cached prefixes are stale
        self.bundle.policy.clear_cache()
        self.iteration += 1
        # 4. metrics, checkpoint, evaluation
        m = {**tree_metrics(trees), **upd, "time/rollout_s": t1 - t0,
             "time/iteration_s": time.perf_counter() - t0}  # fmt: skip
        if cfg.eval.every and self.iteration % cfg.eval.every == 0:
            m.update(self.evaluate().as_metrics())
        row = self.metrics.log(self.iteration, m)
        self._log_trees(trees[: cfg.run.log_trees])
        if self.iteration % cfg.run.checkpoint_every == 0 or self.iteration == cfg.run.iterations:
            self.save()
        self.log(
            f"[iter {self.iteration}/{cfg.run.iterations}] success {row['rollout/success']:.3f} "
            f"return {row['rollout/return']:.3f} leaves {row['tree/leaves']:.1f} "
            f"tokens {row['compute/generated_tokens']:.0f} grad {row['learner/grad_norm']:.3f} "
            f"{row['time/iteration_s']:.1f}s"
        )

    def _log_trees(self, trees: list[Tree]) -> None:
        est = self.cfg.estimator
        with open(self.run_dir / "trees.jsonl", "a") as f:
            for tree in trees:
                adv = None
                if est.name != "ppo":  # PPO's advantages depend on the critic of the moment
                    fps = tree.fingerprints() if est.name == "gigpo" else None
                    res = estimators.compute(
                        est.name, tree.parents(), tree.rewards(), fingerprints=fps, **est.options
                    )
                    adv = res.advantage.tolist()
                d = tree.to_dict(advantages=adv)
                d["iteration"] = self.iteration
                f.write(json.dumps(d) + "\n")


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="bpo train", description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. tree.k=4 estimator=rloo")
    ap.add_argument("--config", help="YAML config file (default: the CPU demo config)")
    ap.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    ap.add_argument("--out", help="run directory (default: runs/<method>-<time>)")
    args = ap.parse_args(argv)
    try:
        if args.resume:
            run_dir = Path(args.resume)
            cfg_file = run_dir / "config.yaml"
            if not cfg_file.exists():
                raise ConfigError(f"--resume {run_dir}: no config.yaml (not a bpo run directory)")
            cfg = load_config(args.config or cfg_file, args.overrides)
        else:
            cfg = load_config(args.config or default_config_path(), args.overrides)
            name = (
                cfg.run.name
                or f"{cfg.estimator.name}-{cfg.tree.rule}-{time.strftime('%Y%m%d-%H%M%S')}"
            )
            run_dir = Path(args.out or Path(cfg.run.out) / name)
        trainer = Trainer(cfg, run_dir, resume=bool(args.resume))
        summary = trainer.run()
    except ConfigError as e:
        print(f"bpo train: {e}")
        return 2
    before = summary["eval_before"]["success"] if summary["eval_before"] else float("nan")
    print(f"held-out success: before {before:.3f} -> after {summary['eval_after']['success']:.3f}")
    print(f"run directory: {run_dir}")
    return 0


def default_config_path() -> Path:
    return Path(__file__).parent / "configs" / "demo.yaml"
