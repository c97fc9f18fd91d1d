"""``bpo train``: the training loop, one visible loop with numbered phases.

Setup: tasks (train and held-out splits), the model (a local path, a tiny model built on the
environment's own text, or SmolLM2), the policy backend, the learner, the rollout engine.
Warm start: supervised fine-tuning on the environment's expert trajectories.
Then, every iteration:

1. rollouts: one tree (BPO) or group (baselines) per training task, at the configured budget;
2. update: advantages from the estimator, ``epochs * minibatches`` optimizer steps;
3. the policy's prefix cache is dropped (the weights changed);
4. metrics (one line in ``metrics.jsonl``, TensorBoard), a checkpoint, periodic evaluation.

Everything a run produces goes into its run directory. A run stopped at any moment (killed,
out of memory, power loss) continues with ``bpo train --resume RUN_DIR`` from its last
checkpoint and reproduces, on the same machine, exactly what the uninterrupted run would have
logged: the checkpoint holds the weights, the optimizer, every random stream (Python, NumPy,
torch, the policy's sampling generator, the task sampler), the branch rule's state and the cost
model, and ``metrics.jsonl`` and ``trees.jsonl`` are cut back to the checkpoint. Ctrl-C
(SIGINT) finishes the iteration in flight, saves a checkpoint and exits 0; a second Ctrl-C stops
at once (the iteration in flight is lost). A bad config fails in :func:`preflight`, before any
work, with a message that names the key and the fix.

The loop's parts live beside it: :mod:`bpo.rollout_setup` (the tasks, the sampler, the rollout
engines), :mod:`bpo.evaluate` (held-out evaluation), :mod:`bpo.resume` (the run directory's
checks, the trainer's checkpoints, the logs cut back) and :mod:`bpo.train_cli` (the command
line; ``main`` is re-exported here).
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import yaml
from rich.console import Console

from bpo import agent, estimators
from bpo.config import Config, ConfigError, to_dict
from bpo.data_parallel import DataParallel
from bpo.evaluate import EvalResult, evaluate_held_out
from bpo.learner import Learner
from bpo.metrics import MetricsLogger, tree_metrics
from bpo.preflight import make_branch_rule, preflight
from bpo.progress import IterationProgress
from bpo.report import write_run_report
from bpo.resume import check_run_dir, load_trainer, save_trainer, set_reference, truncate_logs
from bpo.rollout import Budget, RolloutError
from bpo.rollout.asynchronous import Rollouts, check_versions
from bpo.rollout_setup import check_env, make_engine, make_sampler, split_tasks
from bpo.sandbox import make_env
from bpo.sandbox.faults import FaultConfig, FaultInjector
from bpo.train_cli import default_config_path, main
from bpo.tree import Tree

if TYPE_CHECKING:
    from bpo.cluster.roles import Placement

__all__ = ["EvalResult", "Trainer", "default_config_path", "main", "preflight"]


class Trainer:
    def __init__(
        self,
        cfg: Config,
        run_dir: str | Path,
        *,
        resume: bool = False,
        write: bool = True,
        placement: Placement | None = None,
        eval_before: EvalResult | None = None,
    ) -> None:
        """``write=False`` opens an existing run read-only (for ``bpo eval``); ``placement``:
        the Ray bundles of the run's roles (:func:`bpo.cluster.roles.run_trainer`);
        ``eval_before``: the held-out score of the starting policy when it is already known
        (``bpo compare`` evaluates a shared warm start once), instead of evaluating it again."""
        self.cfg = cfg
        self.placement = placement
        self.pool: Any = None
        self.engines: Any = None
        self.rollouts: Rollouts | None = None
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.write = write
        # data parallelism under torchrun (WORLD_SIZE > 1): every rank samples its share of the
        # tasks, the trees are gathered, the learner shards each minibatch (bpo.data_parallel);
        # rank 0 alone writes the run directory
        self.dp = DataParallel.from_env()
        self.writes = write and (self.dp is None or self.dp.rank == 0)
        self.iteration = 0
        self.eval_before = eval_before
        self.log: Callable[[str], None] = print if self.writes or not write else _quiet

    # -- setup ---------------------------------------------------------------------------------
    def setup(self) -> None:
        """Check the config (:func:`preflight`) and the run directory, then build tasks, agent,
        learner and rollout engine. Bad input fails here, before any expensive work."""
        cfg = self.cfg
        preflight(cfg)
        check_run_dir(self.run_dir, cfg, resume=self.resume, write=self.write)
        s = cfg.sandbox
        self.env_factory = lambda: make_env(s.name, s.backend, **s.options)
        self.train_factory = self.env_factory
        self.fault_config: FaultConfig | None = None
        if s.faults:
            try:
                self.fault_config = FaultConfig(**s.faults)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"sandbox.faults={s.faults}: {e}") from None
        check_env(s, self.env_factory)
        if self.placement is not None and self.placement.sandboxes:
            from bpo.cluster.roles import sandbox_pool

            self.pool = sandbox_pool(self.placement, cfg)
            self.train_factory = self.pool.open
        if self.fault_config is not None:
            fc, inner = self.fault_config, self.train_factory
            self.train_factory = lambda: FaultInjector(inner(), fc)  # soak runs only
        self.train_tasks = split_tasks(s, s.train_split, s.num_train_tasks)
        # held-out tasks never overlap the training tasks: from the training split they are
        # the ones listed after them (unseen games of the same distribution)
        skip = s.num_train_tasks if s.eval_split == s.train_split else 0
        self.eval_tasks = split_tasks(s, s.eval_split, s.num_eval_tasks, skip)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.writes and not self.resume:
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        np.random.seed(cfg.run.seed)
        resuming = (self.resume or not self.write) and (self.run_dir / "checkpoints").exists()
        first = self.dp is None or self.dp.rank == 0
        if not first:  # torchrun: rank 0 writes the run's files (the tiny model) first
            torch.distributed.barrier(group=self.dp.group)
        self.bundle = agent.build(
            cfg, self.run_dir, self.env_factory, self.train_tasks, need_demos=not resuming
        )
        if first and self.dp is not None:
            torch.distributed.barrier(group=self.dp.group)
        # KL to the frozen policy RL starts from: a copy whose weights are set after the warm
        # start (or, on resume, from the kept iteration-0 checkpoint; see bpo.resume.set_reference)
        ref = None
        if cfg.learner.kl_coef > 0:
            ref = copy.deepcopy(self.bundle.model).eval().requires_grad_(False)
        self.learner = Learner(
            self.bundle.model, cfg.learner, ref_model=ref, pad_id=self.bundle.pad_id,
            critic=cfg.estimator.name == "ppo", data_parallel=self.dp,
            total_updates=cfg.run.iterations * cfg.learner.epochs * cfg.learner.minibatches,
        )  # fmt: skip
        self._seed_rank()
        self.rule = make_branch_rule(cfg)
        self.sampler = make_sampler(self)
        self.engine = make_engine(
            self,
            self.rule,
            cfg.tree.root_width,
            cfg.policy.temperature,
            Budget(cfg.budget.unit, cfg.budget.amount, cfg.budget.mode, cfg.budget.truncate),
            train=True,
        )
        self.task_rng = np.random.default_rng(cfg.run.seed)
        if self.writes:
            self.metrics = MetricsLogger(self.run_dir)

    def _seed_rank(self) -> None:
        """Ranks other than 0 sample with streams of their own (else every rank's trees would
        repeat rank 0's on the same tasks' seeds)."""
        if self.dp is not None and self.dp.rank > 0:
            g = torch.Generator().manual_seed(self.cfg.run.seed + 7919 * self.dp.rank
                                              + 104729 * self.iteration)  # fmt: skip
            self.bundle.set_policy_rng_state(g.get_state())

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(self, tasks: list[str] | None = None) -> EvalResult:
        """The current policy on ``tasks`` (default: the held-out tasks):
        :func:`bpo.evaluate.evaluate_held_out`."""
        return evaluate_held_out(self, tasks)

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self) -> Path | None:
        """A checkpoint of the iteration (:func:`bpo.resume.save_trainer`; every rank calls it)."""
        return save_trainer(self)

    def load(self) -> bool:
        """Continue from the newest valid checkpoint, if any (:func:`bpo.resume.load_trainer`)."""
        return load_trainer(self)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Set up, warm-start (or resume), train, evaluate; returns the summary (also written to
        ``summary.json`` unless the run was interrupted before its last iteration)."""
        cfg = self.cfg
        self.setup()
        resumed = self.resume and self.load()
        if self.resume and not resumed:
            self.log(f"[resume] no checkpoint in {self.run_dir} yet: starting from the beginning")
            if self.writes:
                truncate_logs(self.run_dir, self.metrics, 0)
        if not resumed:
            if cfg.sft.episodes_per_task > 0:
                sft = self.bundle.warm_start(cfg.sft, cfg.run.seed)
                self.log(f"[warm start] {sft}")
                if self.dp is not None:  # the replicas start RL equal (GPU kernels may differ)
                    self.dp.broadcast_module(self.bundle.model)
                    self.bundle.sync_policy()
            set_reference(self.learner, self.bundle)
            if self.eval_before is None:
                self.eval_before = self.evaluate()
            self.log(f"[eval] held-out success before RL: {self.eval_before.success:.3f}")
            self.save()
        stop = {"flag": False}

        def on_stop(signum: int, frame: Any) -> None:
            # Ctrl-C, or SIGTERM (a job scheduler's warning before it kills, ``bpo compare``
            # stopping its runs): finish the iteration, checkpoint, exit; a second one stops
            # at once
            stop["flag"] = True
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            how = "press Ctrl-C" if signum == signal.SIGINT else "send SIGTERM"
            os.write(2, f"\n[interrupt] finishing this iteration, then a checkpoint; {how} again "
                        "to stop at once (this iteration is lost)\n".encode())  # fmt: skip

        main_thread = threading.current_thread() is threading.main_thread()
        stops = (signal.SIGINT, signal.SIGTERM) if main_thread else ()
        old = {sig: signal.signal(sig, on_stop) for sig in stops}
        self.rollouts = Rollouts(
            self.engine, self.sampler, self._draw, lambda: self.task_rng.bit_generator.state,
            cfg.run.max_staleness, self.iteration, cfg.run.iterations,
            self.bundle.trainable_state(),
        )  # fmt: skip
        try:
            quiet = None if self.writes else Console(quiet=True)
            with IterationProgress(cfg.run.iterations, self.iteration, quiet) as bar:
                # under torchrun every rank stops after the same iteration (any rank's Ctrl-C
                # counts), or the others would wait forever in the next collective
                while self.iteration < cfg.run.iterations and not (
                    self.dp.any(stop["flag"]) if self.dp else stop["flag"]
                ):
                    row = self._iteration()
                    bar.update(row["rollout/success"], row["time/tokens_per_s"])
        except BaseException:
            self._close_roles()
            raise
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            self.rollouts.close()
        if self.iteration < cfg.run.iterations:
            return self._interrupted()
        if self.dp is not None:
            self.dp.check_equal(self.bundle.model)
        after = self.evaluate()
        summary = {
            "eval_before": self.eval_before.__dict__ if self.eval_before else None,
            "eval_after": after.__dict__,
            "iterations": self.iteration,
            "policy_updates": self.learner.updates,
            "interrupted": False,
        }
        if self.writes:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            self.log(f"[report] {write_run_report(self.run_dir)}")
            self.metrics.close()
        self._close_roles()
        return summary

    def _gather(self, items: list[Any]) -> list[Any]:
        """Under torchrun every rank's items (in rank order), else ``items``."""
        return self.dp.gather(items) if self.dp is not None else items

    def _close_roles(self) -> None:
        """Close the rollout engine's sandboxes, the sampler, the cluster's actors."""
        if self.rollouts is not None:
            self.rollouts.close()
        self.engine.close()
        if self.engines is not None:
            self.engines.close()
        if self.pool is not None:
            self.pool.close()

    def _interrupted(self) -> dict[str, Any]:
        """After Ctrl-C: a checkpoint of the last finished iteration; no final evaluation and
        no ``summary.json`` (the run is not finished)."""
        if getattr(self, "saved_at", None) != self.iteration:
            self.save()
        self.log(
            f"[interrupted] checkpoint saved at iteration {self.iteration}/"
            f"{self.cfg.run.iterations}; continue with: bpo train --resume {self.run_dir}"
        )
        if self.writes:
            self.metrics.close()
        self._close_roles()
        return {
            "eval_before": self.eval_before.__dict__ if self.eval_before else None,
            "eval_after": None,
            "iterations": self.iteration,
            "policy_updates": self.learner.updates,
            "interrupted": True,
        }

    def _draw(self) -> list[tuple[str, int]]:
        """The next batch's (task, seed) jobs, from the task sampler."""
        n = self.cfg.run.tasks_per_iteration
        idx = self.task_rng.choice(len(self.train_tasks), n, replace=len(self.train_tasks) < n)
        seeds = self.task_rng.integers(0, 2**31 - 1, len(idx))
        jobs = [(self.train_tasks[i], int(s)) for i, s in zip(idx, seeds, strict=True)]
        return jobs[self.dp.rank :: self.dp.world] if self.dp else jobs

    def _iteration(self) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.perf_counter()
        # 1. rollouts (sampled now, or already by the rollout thread in asynchronous mode)
        assert self.rollouts is not None
        batch = self.rollouts.next(self.iteration + 1)
        check_versions(batch.trees, batch.version)
        trees: list[Tree] = self._gather(batch.trees)
        t1 = time.perf_counter()
        faults = batch.faults
        if not trees:
            raise RolloutError(
                f"iteration {self.iteration + 1}: every tree was lost to sandbox faults "
                f"({faults}); check the sandbox with bpo check-sandbox"
            )
        # 2. update
        upd = self.learner.update(trees, cfg.estimator.name, **cfg.estimator.options)
        # 3. the weights changed: cached prefixes are stale (or the engine's copy is); the
        # sampler of the training rollouts takes the new weights before its next batch
        staleness = self.iteration - batch.version
        self.bundle.sync_policy()
        self.iteration += 1
        self.rollouts.publish(self.iteration, self.bundle.trainable_state)
        # 4. metrics, checkpoint, evaluation
        m = {**tree_metrics(trees), **upd, "time/rollout_s": batch.seconds,
             "time/rollout_wait_s": t1 - t0, "time/iteration_s": time.perf_counter() - t0,
             "async/staleness": staleness, "async/policy_version": batch.version,
             "rollout/prefix_hit_rate": batch.prefix_hit_rate}  # fmt: skip
        if self.engines is not None:
            m["time/weight_sync_s"] = self.engines.sync_seconds
            m["cluster/engine_restarts"] = self.engines.restarts
        m["time/tokens_per_s"] = m["compute/generated_tokens"] / max(batch.seconds, 1e-9)
        if self.fault_config is not None:
            m.update({f"faults/injected_{k}": v for k, v in self.fault_config.counts.items()})
        m.update({"rollout/retries": faults["retries"], "rollout/failed_episodes":
                  faults["failed_rollouts"], "rollout/failed_trees": faults["failed_trees"],
                  "rollout/policy_retries": faults["policy_retries"]})  # fmt: skip
        if cfg.eval.every and self.iteration % cfg.eval.every == 0:
            m.update(self.evaluate().as_metrics())
        if self.writes:  # rank 0 of a torchrun job, or the only process
            row = self.metrics.log(self.iteration, m)
            self._log_trees(trees[: cfg.run.log_trees])
        else:
            row = {k: float(v) for k, v in m.items()}
        if self.iteration % cfg.run.checkpoint_every == 0 or self.iteration == cfg.run.iterations:
            self.save()
        self.log(
            f"[iter {self.iteration}/{cfg.run.iterations}] success {row['rollout/success']:.3f} "
            f"return {row['rollout/return']:.3f} leaves {row['tree/leaves']:.1f} "
            f"tokens {row['compute/generated_tokens']:.0f} grad {row['learner/grad_norm']:.3f} "
            f"{row['time/iteration_s']:.1f}s"
        )
        return row

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


def _quiet(message: str) -> None:
    """The log of ranks other than 0 (rank 0 speaks for the run)."""
