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
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import yaml
from rich.console import Console

from bpo import agent, estimators
from bpo.branching import BranchRule, make_rule
from bpo.checkpoint import (
    CheckpointError,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from bpo.config import Config, ConfigError, load_config, to_dict
from bpo.data_parallel import DataParallel
from bpo.learner import Learner, NonFiniteError
from bpo.metrics import MetricsLogger, tree_metrics
from bpo.preflight import make_branch_rule, preflight
from bpo.progress import IterationProgress
from bpo.report import write_run_report
from bpo.rollout import Budget, RolloutConfig, RolloutEngine, RolloutError
from bpo.rollout.asynchronous import (
    LocalCopy,
    Rollouts,
    SharedModel,
    WeightSync,
    check_versions,
)
from bpo.sandbox import env_spec, list_tasks, make_env
from bpo.sandbox.faults import FaultConfig, FaultInjector
from bpo.tree import Tree

if TYPE_CHECKING:
    from bpo.cluster.roles import Placement

__all__ = ["EvalResult", "Trainer", "main", "preflight"]


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
        self._check_run_dir()
        s = cfg.sandbox
        self.env_factory = lambda: make_env(s.name, s.backend, **s.options)
        self.train_factory = self.env_factory
        self.fault_config: FaultConfig | None = None
        if s.faults:
            try:
                self.fault_config = FaultConfig(**s.faults)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"sandbox.faults={s.faults}: {e}") from None
        self._check_env()
        if self.placement is not None and self.placement.sandboxes:
            from bpo.cluster.roles import sandbox_pool

            self.pool = sandbox_pool(self.placement, cfg)
            self.train_factory = self.pool.open
        if self.fault_config is not None:
            fc, inner = self.fault_config, self.train_factory
            self.train_factory = lambda: FaultInjector(inner(), fc)  # soak runs only
        self.train_tasks = self._tasks(s.train_split, s.num_train_tasks)
        # held-out tasks never overlap the training tasks: from the training split they are
        # the ones listed after them (unseen games of the same distribution)
        skip = s.num_train_tasks if s.eval_split == s.train_split else 0
        self.eval_tasks = self._tasks(s.eval_split, s.num_eval_tasks, skip)
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
        # start (or, on resume, from the kept iteration-0 checkpoint; see _set_reference)
        ref = None
        if cfg.learner.kl_coef > 0:
            ref = copy.deepcopy(self.bundle.model).eval().requires_grad_(False)
        self.learner = Learner(
            self.bundle.model, cfg.learner, ref_model=ref, pad_id=self.bundle.pad_id,
            critic=cfg.estimator.name == "ppo", data_parallel=self.dp,
        )  # fmt: skip
        self._seed_rank()
        self.rule = make_branch_rule(cfg)
        self.sampler = self._sampler()
        self.engine = self._engine(
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

    def _sampler(self) -> WeightSync:
        """The policy of the training rollouts: the learner's model (synchronous, in process),
        a copy of it (asynchronous, in process) or the cluster's inference engines."""
        cfg, b = self.cfg, self.bundle
        if self.placement is not None and self.placement.engines:
            from bpo.cluster.roles import EngineGroup

            p = cfg.policy
            self.engines = EngineGroup(
                self.placement, b.model, b.policy.tokenizer, b.policy.stop_token_ids,
                cfg.run.seed, p.cache_tokens, cfg.cluster.routing, backend=p.backend,
                max_model_len=p.max_context_tokens + p.max_new_tokens,
            )  # fmt: skip
            self._write_cluster_info()
            return self.engines
        if cfg.run.max_staleness > 0:
            from bpo.policy.hf import HFPolicy

            return LocalCopy(b.model, lambda m: HFPolicy(
                m, b.policy.tokenizer, seed=cfg.run.seed + 1,
                cache_budget_tokens=cfg.policy.cache_tokens,
            ))  # fmt: skip
        return SharedModel(b.policy)

    def _write_cluster_info(self) -> None:
        """Where each role runs (``cluster.json`` in the run directory)."""
        from bpo.cluster.roles import node_id

        info = {
            "trainer": {"node": node_id(), "pid": os.getpid()},
            "engines": self.engines.where() if self.engines else [],
            "sandbox_actors": self.pool.where() if self.pool else [],
        }
        if self.writes:
            (self.run_dir / "cluster.json").write_text(json.dumps(info, indent=1))

    def _check_run_dir(self) -> None:
        """``--resume``: the directory holds a run made with this very config. A new run: the
        directory holds no run with checkpoints (it would be overwritten)."""
        d, cfg_path = self.run_dir, self.run_dir / "config.yaml"
        if self.resume:
            if not cfg_path.is_file():
                raise ConfigError(
                    f"--resume {d}: no config.yaml there, so not a bpo run directory; give the "
                    "directory a run printed as 'run directory: ...'"
                )
            try:
                saved = to_dict(load_config(cfg_path))
            except ConfigError as e:
                raise ConfigError(f"--resume {d}: its config.yaml does not load: {e}") from None
            now = to_dict(self.cfg)
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
        elif self.write and (d / "checkpoints").exists():
            raise ConfigError(
                f"{d} already holds a run (it has checkpoints); continue it with "
                f"'bpo train --resume {d}', or give a new --out or run.name"
            )

    def _check_env(self) -> None:
        """Make (and close) one sandbox, so that bad ``sandbox.options`` fail before any work."""
        s = self.cfg.sandbox
        try:
            self.env_factory().close()
        except (TypeError, ValueError) as e:
            raise ConfigError(f"sandbox.options={s.options} (sandbox {s.name!r}): {e}") from None
        except ImportError as e:
            raise ConfigError(
                f"sandbox.name={s.name!r} needs a package that is not installed ({e}); install "
                f"it with: pip install 'bpo[{s.name}]'"
            ) from None

    def _tasks(self, split: str, n: int, skip: int = 0) -> list[str]:
        s = self.cfg.sandbox
        # ``n`` lets generating environments (textworld) make only the games needed; it is
        # passed only to task listers that take it (alfworld rejects unknown options)
        lister = env_spec(s.name).tasks
        extra = {"n": skip + n} if "n" in inspect.signature(lister).parameters else {}
        try:
            tasks = list(list_tasks(s.name, split, **extra, **s.options))[skip : skip + n]
        except (TypeError, ValueError) as e:
            raise ConfigError(f"sandbox {s.name!r}, split {split!r}: {e}") from None
        if not tasks:
            after = f" after the {skip} training tasks" if skip else ""
            raise ConfigError(
                f"sandbox {s.name!r} listed no tasks for split {split!r}{after} with options "
                f"{s.options}; check sandbox.train_split / sandbox.eval_split, "
                "sandbox.num_train_tasks and sandbox.options"
            )
        return tasks

    def _engine(
        self, rule: BranchRule, width: int, temperature: float, budget: Budget, train: bool = False
    ) -> RolloutEngine:
        """A rollout engine; ``train``: the training rollouts' (the sampler's policy, the
        training sandboxes), else an evaluation engine (the learner's policy, local
        sandboxes)."""
        b = self.bundle
        rc = RolloutConfig(
            root_width=width, max_steps=self.cfg.run.max_steps, budget=budget,
            entropy=self.cfg.tree.entropy, concurrency=self.cfg.run.concurrency,
            fill_budget=self.cfg.tree.fill_budget, max_root_width=self.cfg.tree.max_root_width,
            invalid_penalty=self.cfg.run.invalid_penalty, max_retries=self.cfg.run.max_retries,
            max_fault_frac=self.cfg.run.max_fault_frac,
            # sandbox actors: one step in flight per actor, across the trees
            step_threads=max(1, self.cfg.cluster.sandbox_actors) if train else 1,
        )  # fmt: skip
        factory = self.train_factory if train else self.env_factory
        policy = self.sampler.policy if train else b.policy
        return RolloutEngine(
            policy, b.prompter, b.parse, rule, factory, rc, b.sampling(temperature)
        )

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(self, tasks: list[str] | None = None) -> EvalResult:
        tasks = tasks or self.eval_tasks
        e = self.cfg.eval
        width = 1 if e.temperature == 0 else max(1, e.episodes_per_task)
        budget = Budget("leaves", float(width), mode="hard", min_rollouts=width)
        engine = self._engine(make_rule("none"), width, e.temperature, budget)
        pause = self.rollouts.paused() if self.rollouts else contextlib.nullcontext()
        jobs = [(t, 1_000_003 + i) for i, t in enumerate(tasks)]
        try:
            with pause:
                trees = engine.run(jobs[self.dp.rank :: self.dp.world] if self.dp else jobs)
        finally:
            engine.close()
        trees = self._gather(trees)
        self.bundle.policy.clear_cache()
        per_task = {t.task: float(np.mean(t.returns(shaped=False) > 0)) for t in trees}
        rets = np.concatenate([t.returns(shaped=False) for t in trees])
        steps = [t.nodes[leaf].step for t in trees for leaf in t.leaves()]
        return EvalResult(float(np.mean(rets > 0)), float(np.mean(rets)), float(np.mean(steps)),
                          per_task)  # fmt: skip

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self) -> Path | None:
        """A checkpoint of the iteration (rank 0 writes it; the replicas are equal). Every rank
        calls it: under FSDP the optimizer state is first gathered whole onto rank 0."""
        optimizer = self.learner.optimizer_state()
        # what differs between ranks: each samples its own share of the tasks with its own
        # stream and calibrates its own budget cost model from its own trees
        mine = {
            "policy_rng": self.bundle.policy_rng_state(),
            "costs": self.engine.costs.state_dict(),
        }
        ranks = self.dp.gather([mine]) if self.dp is not None else [mine]
        if not self.writes:
            self.saved_at = self.iteration
            return None
        state = {
            "iteration": self.iteration,
            "updates": self.learner.updates,
            "bad_in_a_row": self.learner.bad_in_a_row,
            "rng": rng_state(),
            "task_rng": (
                self.rollouts.next_draw_state()
                if self.rollouts
                else self.task_rng.bit_generator.state
            ),
            "rule": self.rule,
            "costs": self.engine.costs.state_dict(),
            "policy_rng": self.bundle.policy_rng_state(),
            "ranks": ranks,
            "eval_before": getattr(self, "eval_before", None),
        }
        path = save_checkpoint(
            self.run_dir / "checkpoints", self.iteration, self.bundle.trainable_state(),
            optimizer, state,
        )  # fmt: skip
        self.saved_at = self.iteration
        return path

    def load(self) -> bool:
        root = self.run_dir / "checkpoints"
        if not root.exists():
            return False
        ck = load_checkpoint(root)
        for msg in ck.skipped:
            self.log(f"[resume] skipped {msg}")
        self.bundle.load_trainable_state(ck.weights)
        self.learner.load_optimizer_state(ck.optimizer)
        st = ck.state
        self.iteration = int(st["iteration"])
        self.learner.updates = int(st["updates"])
        self.learner.bad_in_a_row = int(st.get("bad_in_a_row", 0))
        set_rng_state(st["rng"])
        self.task_rng.bit_generator.state = st["task_rng"]
        self.rule = st["rule"]
        self.engine.rule = self.rule
        self.engine.costs.load_state_dict(st["costs"])
        self.bundle.set_policy_rng_state(st["policy_rng"])
        self.eval_before = st.get("eval_before")
        if self.learner.ref_model is not None:
            first = root / "iter-000000"
            if not first.is_dir():
                raise CheckpointError(
                    f"{first} (the warm-started policy, the KL reference) is missing"
                )
            self._set_reference(load_checkpoint(first).weights)
        self.saved_at = self.iteration
        if self.writes:
            self._truncate_logs(self.iteration)
        ranks = st.get("ranks", [])
        if self.dp is not None and len(ranks) == self.dp.world:  # each rank's own, exactly
            self.bundle.set_policy_rng_state(ranks[self.dp.rank]["policy_rng"])
            self.engine.costs.load_state_dict(ranks[self.dp.rank]["costs"])
        else:  # a single process, or another number of ranks than the run had: fresh streams
            self._seed_rank()
        self.log(f"[resume] from {ck.path.name} (iteration {self.iteration})")
        return True

    def _set_reference(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Set the frozen KL reference to ``weights`` (trainable parameters of a checkpoint) or
        to the current policy."""
        ref = self.learner.ref_model
        if ref is None:
            return
        src = weights if weights is not None else self.bundle.trainable_state()
        params = dict(ref.named_parameters())
        with torch.no_grad():
            for name, value in src.items():
                if name in params:  # the value head (PPO) lives on the policy only
                    params[name].copy_(value)

    def _truncate_logs(self, iteration: int) -> None:
        """Drop what was logged after checkpoint ``iteration`` (and lines cut by a crash)."""
        self.metrics.truncate_after(iteration)
        path = self.run_dir / "trees.jsonl"
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
                self._truncate_logs(0)
        if not resumed:
            if cfg.sft.episodes_per_task > 0:
                sft = self.bundle.warm_start(cfg.sft, cfg.run.seed)
                self.log(f"[warm start] {sft}")
                if self.dp is not None:  # the replicas start RL equal (GPU kernels may differ)
                    self.dp.broadcast_module(self.bundle.model)
                    self.bundle.sync_policy()
            self._set_reference()
            if self.eval_before is None:
                self.eval_before = self.evaluate()
            self.log(f"[eval] held-out success before RL: {self.eval_before.success:.3f}")
            self.save()
        stop = {"flag": False}

        def on_sigint(signum: int, frame: Any) -> None:
            stop["flag"] = True
            signal.signal(signal.SIGINT, signal.default_int_handler)  # a second one stops at once
            os.write(2, b"\n[interrupt] finishing this iteration, then a checkpoint; press Ctrl-C "
                        b"again to stop at once (this iteration is lost)\n")  # fmt: skip

        main_thread = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, on_sigint) if main_thread else None
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
            if main_thread:
                signal.signal(signal.SIGINT, old)
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


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="bpo train", description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. tree.k=4 estimator=rloo")
    ap.add_argument("--config", help="YAML config file (default: the CPU demo config)")
    ap.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    ap.add_argument("--out", help="run directory (default: runs/<method>-<time>)")
    args = ap.parse_args(argv)
    run_dir = Path(args.resume or args.out or ".")
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
            lambda placement: Trainer(cfg, run_dir, resume=resume, placement=placement).run(),
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


def _quiet(message: str) -> None:
    """The log of ranks other than 0 (rank 0 speaks for the run)."""


def default_config_path() -> Path:
    return Path(__file__).parent / "configs" / "demo.yaml"
