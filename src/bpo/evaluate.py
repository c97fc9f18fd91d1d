"""``bpo eval RUN_DIR_OR_CHECKPOINT``: held-out success, return and steps, with a per-task table.

The evaluation itself is here too: :func:`evaluate_held_out` and its :class:`EvalResult`, which
the trainer runs before RL, every ``eval.every`` iterations and after it
(:meth:`bpo.train.Trainer.evaluate`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bpo.branching import make_rule
from bpo.checkpoint import CheckpointError, load_checkpoint
from bpo.config import ConfigError, load_config
from bpo.rollout import Budget
from bpo.rollout_setup import make_engine

if TYPE_CHECKING:
    from bpo.train import Trainer

__all__ = ["EvalResult", "evaluate_held_out", "main"]


@dataclass(frozen=True)
class EvalResult:
    """Held-out scores of a policy: the share of episodes that succeeded (positive return), the
    mean return and steps, and each task's share."""

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


def evaluate_held_out(trainer: Trainer, tasks: list[str] | None = None) -> EvalResult:
    """Success, return and steps of ``trainer``'s current policy on ``tasks`` (default: its
    held-out tasks), with fixed seeds: one greedy episode per task, or
    ``eval.episodes_per_task`` sampled ones when ``eval.temperature > 0``; the asynchronous
    training rollouts pause meanwhile."""
    tasks = tasks or trainer.eval_tasks
    e = trainer.cfg.eval
    width = 1 if e.temperature == 0 else max(1, e.episodes_per_task)
    budget = Budget("leaves", float(width), mode="hard", min_rollouts=width)
    engine = make_engine(trainer, make_rule("none"), width, e.temperature, budget)
    pause = trainer.rollouts.paused() if trainer.rollouts else contextlib.nullcontext()
    jobs = [(t, 1_000_003 + i) for i, t in enumerate(tasks)]
    try:
        with pause:
            trees = engine.run(jobs[trainer.dp.rank :: trainer.dp.world] if trainer.dp else jobs)
    finally:
        engine.close()
    trees = trainer._gather(trees)
    trainer.bundle.policy.clear_cache()
    per_task = {t.task: float(np.mean(t.returns(shaped=False) > 0)) for t in trees}
    rets = np.concatenate([t.returns(shaped=False) for t in trees])
    steps = [t.nodes[leaf].step for t in trees for leaf in t.leaves()]
    return EvalResult(float(np.mean(rets > 0)), float(np.mean(rets)), float(np.mean(steps)),
                      per_task)  # fmt: skip


def _run_dir_of(target: Path) -> tuple[Path, Path | None]:
    """(run directory, specific checkpoint or None for the newest valid one)."""
    if (target / "config.yaml").is_file():
        return target, None
    if target.name.startswith("iter-") and (target.parent.parent / "config.yaml").is_file():
        return target.parent.parent, target
    raise ConfigError(
        f"{target} is neither a run directory (with config.yaml) nor a checkpoint "
        "(RUN_DIR/checkpoints/iter-XXXXXX)"
    )


def main(argv: list[str]) -> int:
    from bpo.train import Trainer  # here, not at the top: bpo.train imports this module

    ap = argparse.ArgumentParser(prog="bpo eval", description=__doc__.split("\n")[0])
    ap.add_argument("target", help="run directory or checkpoint directory")
    ap.add_argument("--split", help="task split (default: the run's eval split)")
    ap.add_argument("--tasks", type=int, help="number of tasks (default: the run's)")
    ap.add_argument("--json", help="write the results as JSON here")
    ap.add_argument(
        "overrides", nargs="*",
        help="eval.* overrides, e.g. eval.temperature=1.0 eval.episodes_per_task=4 (sampled "
        "success; the default is the run's eval settings, greedy unless it set others), and "
        "policy.device (evaluate a GPU run on a CPU)",
    )  # fmt: skip
    args = ap.parse_intermixed_args(argv)  # overrides may follow the options
    try:
        run_dir, ckpt = _run_dir_of(Path(args.target))
        bad = [o for o in args.overrides if not o.startswith(("eval.", "policy.device="))]
        if bad:
            raise ConfigError(
                f"bpo eval takes only eval.* and policy.device overrides (got "
                f"{', '.join(bad)}); the other settings are the run's own"
            )
        overrides = list(args.overrides)
        if args.split:
            overrides.append(f"sandbox.eval_split={args.split}")
        if args.tasks:
            overrides.append(f"sandbox.num_eval_tasks={args.tasks}")
        cfg = load_config(run_dir / "config.yaml", overrides)
        trainer = Trainer(cfg, run_dir, resume=False, write=False)
        trainer.setup()
        loaded = load_checkpoint(ckpt or run_dir / "checkpoints")
        trainer.bundle.load_trainable_state(loaded.weights)
        res = trainer.evaluate()
        trainer.engine.close()
    except (ConfigError, CheckpointError) as e:
        print(f"bpo eval: {e}")
        return 2
    width = max(len(t) for t in res.per_task) if res.per_task else 4
    print(f"checkpoint: {loaded.path}")
    print(f"{'task'.ljust(width)}  success")
    for task, s in sorted(res.per_task.items()):
        print(f"{task.ljust(width)}  {s:.2f}")
    print(f"success {res.success:.3f}  return {res.mean_return:.3f}  steps {res.mean_steps:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({**res.__dict__, "checkpoint": str(loaded.path)}))
    return 0
