"""``bpo eval RUN_DIR_OR_CHECKPOINT``: held-out success, return and steps, with a per-task table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bpo.checkpoint import CheckpointError, load_checkpoint
from bpo.config import ConfigError, load_config
from bpo.train import Trainer

__all__ = ["main"]


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
