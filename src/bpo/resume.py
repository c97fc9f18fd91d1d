"""Continuing a run: the run directory's checks, what a :class:`~bpo.train.Trainer` checkpoint
holds, and the logs cut back to it.

:func:`check_run_dir` makes ``--resume`` refuse a directory that holds no run or one made with
another config, and a new run refuse a directory that already holds one. :func:`save_trainer`
writes the trainer's state: the weights, the optimizer, every random stream (Python, NumPy,
torch, the policy's sampling generator, the task sampler), the branch rule's state and the cost
model, per rank under torchrun. :func:`load_trainer` restores it, sets the KL reference from
the kept iteration-0 checkpoint and cuts ``metrics.jsonl`` and ``trees.jsonl`` back to the
checkpoint (:func:`truncate_logs`), so that the continued run logs what the uninterrupted one
would have (exactly, on the same machine). The files themselves (atomic writes, manifests,
falling back past a corrupt checkpoint) are :mod:`bpo.checkpoint`'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bpo.checkpoint import (
    CheckpointError,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from bpo.config import Config, ConfigError, load_config, to_dict

if TYPE_CHECKING:
    from bpo.agent import Agent
    from bpo.learner import Learner
    from bpo.metrics import MetricsLogger
    from bpo.train import Trainer

__all__ = ["check_run_dir", "load_trainer", "save_trainer", "set_reference", "truncate_logs"]


def check_run_dir(run_dir: Path, cfg: Config, *, resume: bool, write: bool) -> None:
    """``--resume``: the directory holds a run made with this very config. A new run: the
    directory holds no run with checkpoints (it would be overwritten)."""
    d, cfg_path = run_dir, run_dir / "config.yaml"
    if resume:
        if not cfg_path.is_file():
            raise ConfigError(
                f"--resume {d}: no config.yaml there, so not a bpo run directory; give the "
                "directory a run printed as 'run directory: ...'"
            )
        try:
            saved = to_dict(load_config(cfg_path))
        except ConfigError as e:
            raise ConfigError(f"--resume {d}: its config.yaml does not load: {e}") from None
        now = to_dict(cfg)
        # where the run computes may change (a GPU run continued on a CPU, another
        # cluster, DDP or FSDP: their checkpoints share one layout); what it computes may not
        diff = [
            f"{s}.{k}" for s in now for k in now[s]
            if saved.get(s, {}).get(k) != now[s][k] and s != "cluster"
            and f"{s}.{k}" not in ("policy.device", "learner.parallel")
        ]  # fmt: skip
        if diff:
            raise ConfigError(
                f"--resume {d}: the run was made with a different config (differs in "
                f"{', '.join(diff[:8])}); resume without overrides or --config, or start a "
                "new run directory"
            )
    elif write and (d / "checkpoints").exists():
        raise ConfigError(
            f"{d} already holds a run (it has checkpoints); continue it with "
            f"'bpo train --resume {d}', or give a new --out or run.name"
        )


def save_trainer(trainer: Trainer) -> Path | None:
    """A checkpoint of the iteration (rank 0 writes it; the replicas are equal). Every rank
    calls it: under FSDP the optimizer state is first gathered whole onto rank 0."""
    optimizer = trainer.learner.optimizer_state()
    # what differs between ranks: each samples its own share of the tasks with its own
    # stream and calibrates its own budget cost model from its own trees
    mine = {
        "policy_rng": trainer.bundle.policy_rng_state(),
        "costs": trainer.engine.costs.state_dict(),
    }
    ranks = trainer.dp.gather([mine]) if trainer.dp is not None else [mine]
    if not trainer.writes:
        trainer.saved_at = trainer.iteration
        return None
    state = {
        "iteration": trainer.iteration,
        "updates": trainer.learner.updates,
        "bad_in_a_row": trainer.learner.bad_in_a_row,
        "rng": rng_state(),
        "task_rng": (
            trainer.rollouts.next_draw_state()
            if trainer.rollouts
            else trainer.task_rng.bit_generator.state
        ),
        "rule": trainer.rule,
        "costs": trainer.engine.costs.state_dict(),
        "policy_rng": trainer.bundle.policy_rng_state(),
        "ranks": ranks,
        "eval_before": getattr(trainer, "eval_before", None),
    }
    path = save_checkpoint(
        trainer.run_dir / "checkpoints", trainer.iteration, trainer.bundle.trainable_state(),
        optimizer, state,
    )  # fmt: skip
    trainer.saved_at = trainer.iteration
    return path


def load_trainer(trainer: Trainer) -> bool:
    """Restore ``trainer`` from the newest valid checkpoint of its run directory; False when
    there is none yet."""
    root = trainer.run_dir / "checkpoints"
    if not root.exists():
        return False
    ck = load_checkpoint(root)
    for msg in ck.skipped:
        trainer.log(f"[resume] skipped {msg}")
    trainer.bundle.load_trainable_state(ck.weights)
    trainer.learner.load_optimizer_state(ck.optimizer)
    st = ck.state
    trainer.iteration = int(st["iteration"])
    trainer.learner.updates = int(st["updates"])
    trainer.learner.bad_in_a_row = int(st.get("bad_in_a_row", 0))
    set_rng_state(st["rng"])
    trainer.task_rng.bit_generator.state = st["task_rng"]
    trainer.rule = st["rule"]
    trainer.engine.rule = trainer.rule
    trainer.engine.costs.load_state_dict(st["costs"])
    trainer.bundle.set_policy_rng_state(st["policy_rng"])
    trainer.eval_before = st.get("eval_before")
    if trainer.learner.ref_model is not None:
        first = root / "iter-000000"
        if not first.is_dir():
            raise CheckpointError(f"{first} (the warm-started policy, the KL reference) is missing")
        set_reference(trainer.learner, trainer.bundle, load_checkpoint(first).weights)
    trainer.saved_at = trainer.iteration
    if trainer.writes:
        truncate_logs(trainer.run_dir, trainer.metrics, trainer.iteration)
    ranks = st.get("ranks", [])
    if trainer.dp is not None and len(ranks) == trainer.dp.world:  # each rank's own, exactly
        trainer.bundle.set_policy_rng_state(ranks[trainer.dp.rank]["policy_rng"])
        trainer.engine.costs.load_state_dict(ranks[trainer.dp.rank]["costs"])
    else:  # a single process, or another number of ranks than the run had: fresh streams
        trainer._seed_rank()
    trainer.log(f"[resume] from {ck.path.name} (iteration {trainer.iteration})")
    return True


def set_reference(
    learner: Learner, bundle: Agent, weights: dict[str, torch.Tensor] | None = None
) -> None:
    """Set the frozen KL reference to ``weights`` (trainable parameters of a checkpoint) or
    to the current policy."""
    ref = learner.ref_model
    if ref is None:
        return
    src = weights if weights is not None else bundle.trainable_state()
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, value in src.items():
            if name in params:  # the value head (PPO) lives on the policy only
                params[name].copy_(value)


def truncate_logs(run_dir: Path, metrics: MetricsLogger, iteration: int) -> None:
    """Drop what was logged after checkpoint ``iteration`` (and lines cut by a crash)."""
    metrics.truncate_after(iteration)
    path = run_dir / "trees.jsonl"
    if not path.exists():
        return
    tmp = path.with_suffix(".jsonl.tmp")
    with open(path) as src, open(tmp, "w") as dst:
        for line in src:
            try:
                keep = json.loads(line).get("iteration", 0) <= iteration
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if keep:
                dst.write(line if line.endswith("\n") else line + "\n")
    os.replace(tmp, path)
