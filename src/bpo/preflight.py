"""Checks of a run's configuration that loading it cannot make (value ranges, registered
names, the branch rule's and the estimator's options, the model directory), run by ``bpo train``
before any work: nothing is written, no model is loaded, no episode is run."""

from __future__ import annotations

from bpo import agent, estimators
from bpo.branching import BranchRule, make_rule
from bpo.config import Config, ConfigError, to_dict
from bpo.registry import UnknownNameError
from bpo.sandbox import BACKENDS, env_spec

__all__ = ["make_branch_rule", "preflight"]


def make_branch_rule(cfg: Config) -> BranchRule:
    """The configured branch rule (``k`` is not passed to ``none``)."""
    t = cfg.tree
    if t.rule == "none":
        return make_rule("none", **t.options)
    return make_rule(t.rule, k=t.k, **t.options)


_AT_LEAST = {
    "run.iterations": 1, "run.tasks_per_iteration": 1, "run.checkpoint_every": 1,
    "run.max_steps": 1, "run.concurrency": 1, "run.log_trees": 0,
    "sandbox.num_train_tasks": 1, "sandbox.num_eval_tasks": 1, "eval.every": 0,
    "eval.episodes_per_task": 1, "sft.episodes_per_task": 0, "sft.epochs": 1,
    "sft.batch_size": 1, "tree.root_width": 1, "policy.max_new_tokens": 1,
    "policy.lora_rank": 0, "tree.max_root_width": 1, "learner.warmup_updates": 0,
    "run.invalid_penalty": 0,
}  # fmt: skip


def preflight(cfg: Config) -> None:
    """Check what loading the config cannot (ranges, registered names, rule, estimator and
    sandbox options, the model directory), before any work: nothing is written, no model is
    loaded, no episode is run. Raises :class:`ConfigError` naming the key and the fix."""
    values = to_dict(cfg)
    for key, low in _AT_LEAST.items():
        section, name = key.split(".")
        if values[section][name] < low:
            raise ConfigError(f"{key}={values[section][name]} is not valid; it must be >= {low}")
    if cfg.budget.amount <= 0:
        raise ConfigError(f"budget.amount={cfg.budget.amount} is not valid; it must be > 0")
    s = cfg.sandbox
    try:
        env_spec(s.name)
    except UnknownNameError as e:
        raise ConfigError(f"sandbox.name={s.name!r}: {e} (bpo check-sandbox --list)") from None
    if s.backend not in BACKENDS:
        raise ConfigError(
            f"sandbox.backend={s.backend!r} is not valid; valid: {', '.join(BACKENDS.names())}"
        )
    try:
        make_branch_rule(cfg)
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"tree (rule {cfg.tree.rule!r}, k={cfg.tree.k}, options {cfg.tree.options}): {e}; "
            "see bpo.branching for each rule's options"
        ) from None
    est = cfg.estimator
    if est.name == "ppo" and est.options:
        raise ConfigError(
            f"estimator.options={est.options}: ppo takes none; set learner.gamma and "
            "learner.gae_lambda instead"
        )
    if est.name != "ppo":
        try:  # a 2-leaf tree: unknown or invalid options fail now, not after the first rollouts
            estimators.compute(est.name, [-1, 0, 0], [0.0, 1.0, 0.0],
                               fingerprints=["r", "a", "b"], **est.options)  # fmt: skip
        except (TypeError, ValueError) as e:
            raise ConfigError(f"estimator.options={est.options}: {e}") from None
    if cfg.learner.kl_coef < 0:
        raise ConfigError(f"learner.kl_coef={cfg.learner.kl_coef} is not valid; it must be >= 0")
    t = cfg.tree
    if t.fill_budget and t.max_root_width < t.root_width:
        raise ConfigError(
            f"tree.max_root_width={t.max_root_width} is below tree.root_width={t.root_width}; "
            "raise tree.max_root_width or set tree.fill_budget=false"
        )
    agent.check_model(cfg.policy)
