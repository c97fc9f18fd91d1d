"""``bpo train [overrides] [--config FILE] [--resume RUN_DIR] [--out DIR]``: the command line of
the training loop (:class:`bpo.train.Trainer`).

It loads the config (the demo config, a file, or with ``--resume`` the run's own
``config.yaml``, then the dotted overrides), picks the run directory (under torchrun, rank 0's
for every rank), runs the trainer (in Ray roles when ``cluster.address`` is set) and turns what
stops it into an exit status: 2 for bad input, 1 for a run stopped by sandbox faults or
non-finite losses (its checkpoints intact, named in the message with the ``--resume`` command),
130 for a second Ctrl-C. Under torchrun every rank ends its process group before it exits.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from bpo.checkpoint import CheckpointError
from bpo.config import ConfigError, load_config
from bpo.data_parallel import DataParallel
from bpo.learner import NonFiniteError
from bpo.rollout import RolloutError

__all__ = ["default_config_path", "main"]


def main(argv: list[str]) -> int:
    # here, not at the top: bpo.train re-exports this module's main; the help's description is
    # the training loop's summary line
    from bpo import train

    ap = argparse.ArgumentParser(prog="bpo train", description=train.__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. tree.k=4 estimator=rloo")
    ap.add_argument("--config", help="YAML config file (default: the CPU demo config)")
    ap.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    ap.add_argument("--out", help="run directory (default: runs/<method>-<time>)")
    args = ap.parse_intermixed_args(argv)  # overrides may follow the options
    run_dir = Path(args.resume or args.out or ".")
    code = 1
    try:
        code = _train(args, run_dir, train)
        return code
    finally:
        if torch.distributed.is_initialized():  # torchrun: every rank ends its process group
            DataParallel.from_group().close(clean=code == 0)


def _train(args: argparse.Namespace, run_dir: Path, train: ModuleType) -> int:
    try:
        if args.resume:
            run_dir = Path(args.resume)
            cfg_file = run_dir / "config.yaml"
            if not cfg_file.exists():
                raise ConfigError(
                    f"--resume {run_dir}: no config.yaml there, so not a bpo run directory; give "
                    "the directory a run printed as 'run directory: ...'"
                )
            cfg = load_config(args.config or cfg_file, args.overrides)
        else:
            cfg = load_config(args.config or default_config_path(), args.overrides)
            name = (
                cfg.run.name
                or f"{cfg.estimator.name}-{cfg.tree.rule}-{time.strftime('%Y%m%d-%H%M%S')}"
            )
            run_dir = Path(args.out or Path(cfg.run.out) / name)
        dp = DataParallel.from_env()
        if dp is not None:  # torchrun: one run directory, rank 0's (the clocks may differ)
            if cfg.cluster.address:
                raise ConfigError(
                    "cluster.address with torchrun: run bpo train under torchrun for a "
                    "data-parallel learner, or with cluster.address for Ray roles, not both"
                )
            box = [str(run_dir)]
            torch.distributed.broadcast_object_list(box, src=0, group=dp.group)
            run_dir = Path(box[0])
        from bpo.cluster.roles import run_trainer

        resume = bool(args.resume)
        summary = run_trainer(
            cfg, str(run_dir), resume,
            lambda placement: train.Trainer(cfg, run_dir, resume=resume, placement=placement).run(),
        )  # fmt: skip
    except ConfigError as e:
        print(f"bpo train: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"bpo train: --resume {run_dir}: {e}; start a new run instead", file=sys.stderr)
        return 2
    except (RolloutError, NonFiniteError) as e:
        print(f"bpo train: stopped: {e}. The checkpoints in {run_dir} are intact; after fixing "
              f"the cause, continue with: bpo train --resume {run_dir}", file=sys.stderr)  # fmt: skip
        return 1
    except KeyboardInterrupt:
        found = any((run_dir / "checkpoints").glob("iter-*"))
        hint = f"resume with: bpo train --resume {run_dir}" if found else "no checkpoint yet"
        print(f"\nbpo train: stopped at once, losing the work since the last checkpoint ({hint})",
              file=sys.stderr)  # fmt: skip
        return 130
    if summary["interrupted"]:
        print(f"run directory: {run_dir}")
        return 0
    before = summary["eval_before"]["success"] if summary["eval_before"] else float("nan")
    print(f"held-out success: before {before:.3f} -> after {summary['eval_after']['success']:.3f}")
    print(f"run directory: {run_dir}")
    return 0


def default_config_path() -> Path:
    """The CPU demo config: what ``bpo train`` runs without ``--config``."""
    return Path(__file__).parent / "configs" / "demo.yaml"
