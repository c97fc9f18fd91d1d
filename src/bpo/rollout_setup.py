"""What a :class:`~bpo.train.Trainer`'s rollouts are made of, built from its config: the tasks
of each split, a sandbox checked before any work, the sampler of the training rollouts and the
rollout engines (training and evaluation).

The sampler is the learner's model itself (synchronous, in process), an in-process copy of it
(asynchronous rollouts, ``run.max_staleness > 0``) or the cluster's inference engines
(``cluster.inference_engines``); the training engine samples with it on the training sandboxes
(local, or the cluster's sandbox actors, with injected faults for soak runs), an evaluation
engine with the learner's policy on local sandboxes.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from bpo.branching import BranchRule
from bpo.config import ConfigError, SandboxConfig
from bpo.rollout import Budget, RolloutConfig, RolloutEngine
from bpo.rollout.asynchronous import LocalCopy, SharedModel, WeightSync
from bpo.sandbox import env_spec, list_tasks
from bpo.sandbox.protocol import Sandbox

if TYPE_CHECKING:
    from bpo.train import Trainer

__all__ = ["check_env", "make_engine", "make_sampler", "split_tasks", "write_cluster_info"]


def split_tasks(s: SandboxConfig, split: str, n: int, skip: int = 0) -> list[str]:
    """Tasks ``skip`` to ``skip + n`` of the sandbox's ``split``; a split that has none there
    is a :class:`ConfigError` naming the keys to check."""
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


def check_env(s: SandboxConfig, env_factory: Callable[[], Sandbox]) -> None:
    """Make (and close) one sandbox, so that bad ``sandbox.options`` fail before any work."""
    try:
        env_factory().close()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"sandbox.options={s.options} (sandbox {s.name!r}): {e}") from None
    except ImportError as e:
        raise ConfigError(
            f"sandbox.name={s.name!r} needs a package that is not installed ({e}); install "
            f"it with: pip install 'bpo[{s.name}]'"
        ) from None


def make_sampler(trainer: Trainer) -> WeightSync:
    """The policy of the training rollouts: the learner's model (synchronous, in process),
    a copy of it (asynchronous, in process) or the cluster's inference engines."""
    cfg, b = trainer.cfg, trainer.bundle
    if trainer.placement is not None and trainer.placement.engines:
        from bpo.cluster.roles import EngineGroup

        p = cfg.policy
        trainer.engines = EngineGroup(
            trainer.placement, b.model, b.policy.tokenizer, b.policy.stop_token_ids,
            cfg.run.seed, p.cache_tokens, cfg.cluster.routing, backend=p.backend,
            max_model_len=p.max_context_tokens + p.max_new_tokens,
        )  # fmt: skip
        write_cluster_info(trainer)
        return trainer.engines
    if cfg.run.max_staleness > 0:
        from bpo.policy.hf import HFPolicy

        return LocalCopy(b.model, lambda m: HFPolicy(
            m, b.policy.tokenizer, seed=cfg.run.seed + 1,
            cache_budget_tokens=cfg.policy.cache_tokens,
        ))  # fmt: skip
    return SharedModel(b.policy)


def write_cluster_info(trainer: Trainer) -> None:
    """Where each role runs (``cluster.json`` in the run directory)."""
    from bpo.cluster.roles import node_id

    info = {
        "trainer": {"node": node_id(), "pid": os.getpid()},
        "engines": trainer.engines.where() if trainer.engines else [],
        "sandbox_actors": trainer.pool.where() if trainer.pool else [],
    }
    if trainer.writes:
        (trainer.run_dir / "cluster.json").write_text(json.dumps(info, indent=1))


def make_engine(
    trainer: Trainer,
    rule: BranchRule,
    width: int,
    temperature: float,
    budget: Budget,
    train: bool = False,
) -> RolloutEngine:
    """A rollout engine; ``train``: the training rollouts' (the sampler's policy, the
    training sandboxes), else an evaluation engine (the learner's policy, local
    sandboxes)."""
    b = trainer.bundle
    rc = RolloutConfig(
        root_width=width, max_steps=trainer.cfg.run.max_steps, budget=budget,
        entropy=trainer.cfg.tree.entropy, concurrency=trainer.cfg.run.concurrency,
        fill_budget=trainer.cfg.tree.fill_budget, max_root_width=trainer.cfg.tree.max_root_width,
        invalid_penalty=trainer.cfg.run.invalid_penalty, max_retries=trainer.cfg.run.max_retries,
        max_fault_frac=trainer.cfg.run.max_fault_frac,
        # sandbox actors: one step in flight per actor, across the trees
        step_threads=max(1, trainer.cfg.cluster.sandbox_actors) if train else 1,
    )  # fmt: skip
    factory = trainer.train_factory if train else trainer.env_factory
    policy = trainer.sampler.policy if train else b.policy
    return RolloutEngine(policy, b.prompter, b.parse, rule, factory, rc, b.sampling(temperature))
