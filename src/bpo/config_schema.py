"""The run configuration's schema: one frozen dataclass per concern (sandbox, policy, tree,
estimator, budget, learner, warm start, evaluation, run, cluster), one docstring per field.

A section checks what it can check alone in ``__post_init__``; :mod:`bpo.config` builds these
from YAML files and dotted overrides (and re-exports every name here), checks what needs the
registries or several sections together, and is where callers import them from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bpo.learner_config import LearnerConfig
from bpo.rollout.budget import BUDGET_MODES, BUDGET_UNITS

__all__ = [
    "PLACEMENTS",
    "ROUTINGS",
    "BudgetConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "EstimatorConfig",
    "EvalConfig",
    "PolicyConfig",
    "RunConfig",
    "SFTConfig",
    "SandboxConfig",
    "TreeConfig",
]


class ConfigError(ValueError):
    """A configuration problem; the message names the key (or file) and the fix."""


@dataclass(frozen=True)
class SandboxConfig:
    name: str = "textworld"
    """Environment name (``bpo check-sandbox --list`` shows them)."""
    backend: str = "auto"
    """Snapshot backend: auto, native, replay, pickle, fork."""
    options: dict[str, Any] = field(default_factory=dict)
    """Environment options (e.g. challenge, level, max_steps)."""
    train_split: str = "train"
    eval_split: str = "test"
    num_train_tasks: int = 64
    num_eval_tasks: int = 32
    faults: dict[str, Any] = field(default_factory=dict)
    """Fault injection in training rollouts, for soak tests (bpo.sandbox.faults.FaultConfig:
    rate, kinds, hang_seconds, seed); empty = off. Evaluation never gets faults."""


@dataclass(frozen=True)
class PolicyConfig:
    model: str = "tiny"
    """A local model directory, "tiny" (``bpo init-model`` on the environment's text), or
    "smollm2-135m" (``bpo fetch-model``)."""
    backend: str = "hf"
    """Inference backend: hf (transformers) or vllm."""
    dtype: str = "float32"
    device: str = "auto"
    """Where the trained model (its sampling with the hf backend, the learner, the KL reference)
    runs: "auto" (cuda when torch sees a GPU, else cpu), "cpu", "cuda" or "cuda:N". Checked by
    preflight: "cuda" without a GPU fails there, naming this key."""
    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    max_context_tokens: int = 2048
    cache_tokens: int = 65536
    """HF backend: tokens of KV kept in the prefix cache. Too small a cache makes forks started
    late recompute their context (BENCHMARKS.md, Rollout); each token costs
    2 x layers x kv_heads x head_dim x 4 bytes (2 KB for the tiny model, 46 KB for SmolLM2)."""
    show_admissible: bool = True
    """List the admissible actions in the prompt where the environment has them."""
    snap_to_admissible: bool = False
    """Map parsed action text to the closest admissible action (case-insensitive match)."""
    tiny_hidden: int = 128
    tiny_layers: int = 2
    lora_rank: int = 0
    """0 = full fine-tuning; > 0 = train peft LoRA adapters of this rank on ``lora_targets``
    (the base weights stay frozen; checkpoints hold the adapters only; the vLLM backend samples
    through the adapter, synced after every update)."""
    lora_alpha: float = 32.0
    lora_targets: list[str] = field(
        default_factory=lambda: [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
        ]
    )  # fmt: skip


@dataclass(frozen=True)
class TreeConfig:
    rule: str = "entropy_quantile"
    """Branch rule (bpo.branching): entropy_quantile, entropy_threshold, every, fixed_depths,
    random, tail, none, topk_backbone (non-causal ablation)."""
    k: int = 4
    """Children per branch node."""
    root_width: int = 2
    """Children of the root (1 = single backbone; N with rule none = an independent group)."""
    entropy: str = "first"
    """Turn entropy for the rule: "first" token (causal, default), "greedy" (mean along the
    state's greedy continuation: causal, costs a probe) or "mean" of the sampled action
    (biased; see bpo.rollout.engine.RolloutConfig.entropy)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra rule options (quantile, threshold, steps, p, max_branches, max_depth, ...)."""
    fill_budget: bool = True
    """Expected-budget mode: widen the root with more backbones until the tree's expected cost
    reaches the budget, as a group's does (``root_width`` is then the least width); off, a
    stingy rule leaves budget unspent (bpo.rollout.RolloutConfig.fill_budget)."""
    max_root_width: int = 64
    """Most children of the root when the budget decides them (groups and fill_budget)."""


@dataclass(frozen=True)
class EstimatorConfig:
    name: str = "bpo"
    """Advantage estimator (bpo.estimators): bpo, rloo, grpo, gigpo, ..., or ppo (GAE over
    turns with a value head; its gamma and lambda are learner options)."""
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BudgetConfig:
    unit: str = "tokens"
    """Matched-compute unit: tokens (generated), steps (sandbox) or leaves."""
    amount: float = 1200
    """Per-task budget in that unit."""
    mode: str = "expected"
    """"expected": causal, matched in expected cost (unbiased); "hard": stop at the amount
    (biased; see bpo.rollout.budget)."""
    truncate: bool = False
    """hard mode only: cut the rollout in flight when the budget runs out."""

    def __post_init__(self) -> None:
        if self.mode not in BUDGET_MODES:
            raise ConfigError(
                f"budget.mode={self.mode!r} is not valid; valid: {', '.join(BUDGET_MODES)}"
            )
        if self.unit not in BUDGET_UNITS:
            raise ConfigError(
                f"budget.unit={self.unit!r} is not valid; valid: {', '.join(BUDGET_UNITS)}"
            )


@dataclass(frozen=True)
class SFTConfig:
    episodes_per_task: int = 1
    """Expert demonstrations per training task for the warm start (0 = no warm start)."""
    epochs: int = 3
    lr: float = 1e-3
    batch_size: int = 16


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0
    """Evaluate on held-out tasks every N iterations (0 = only before and after training)."""
    temperature: float = 0.0
    """0 = greedy evaluation."""
    episodes_per_task: int = 1


@dataclass(frozen=True)
class RunConfig:
    iterations: int = 10
    tasks_per_iteration: int = 8
    seed: int = 0
    out: str = "runs"
    """Runs are written to OUT/NAME."""
    name: str = ""
    """Run directory name (default: method and time)."""
    checkpoint_every: int = 1
    log_trees: int = 2
    """Sampled trees per iteration saved (with advantages) to trees.jsonl for ``bpo view``."""
    concurrency: int = 8
    max_steps: int = 20
    max_retries: int = 2
    """Restarts of a rollout hit by a sandbox fault, from its snapshot, before it is dropped."""
    max_fault_frac: float = 0.25
    """Stop the run when more than this share of an iteration's rollouts is lost to faults."""
    invalid_penalty: float = 0.0
    """Reward subtracted for an invalid action (no stop token within policy.max_new_tokens, or a
    command outside the admissible list); success metrics use the sandbox's own rewards
    (bpo.rollout.RolloutConfig.invalid_penalty)."""
    max_staleness: int = 0
    """Asynchronous rollouts (bpo.rollout.asynchronous): 0 = synchronous (each iteration samples
    with the weights of the update before it: the default, and the mode for exact comparisons
    and bitwise resume); N >= 1 = the next iterations' rollouts run while the learner updates,
    sampled by a policy at most N updates older than the learner that trains on them (the
    importance ratio against the sampling log-probs corrects for the lag)."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"run.max_staleness must be >= 0 (0 = synchronous), got "
                             f"{self.max_staleness}")  # fmt: skip


ROUTINGS = ("prefix", "round_robin")
PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class ClusterConfig:
    """Where the parts run (bpo.cluster). The defaults run everything in this process; the same
    config runs on a Ray cluster by setting ``address`` and the number of actors per role."""

    address: str = ""
    """"" = no Ray (everything in this process); "local" = start Ray on this machine; else a Ray
    address ("auto", "HOST:6379", "ray://HOST:10001") of a running cluster, whose nodes have
    bpo installed and share the run directory's filesystem."""
    inference_engines: int = 0
    """Ray actors that each hold a copy of the policy (transformers, or vLLM with
    policy.backend=vllm: full weights, no LoRA) and serve the rollouts' sampling calls (0 = the
    learner's model samples in this process)."""
    sandbox_actors: int = 0
    """Ray actors hosting the training rollouts' sandboxes (bpo.sandbox.pool; 0 = in this
    process). Evaluation sandboxes stay in the trainer's process."""
    engine_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1})
    """Ray resources of one inference engine, as a placement-group bundle: CPU, GPU, memory
    (bytes) and custom resources, e.g. {CPU: 4, GPU: 1}."""
    sandbox_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 0.5})
    """Ray resources of one sandbox actor (a bundle, as engine_resources)."""
    learner_resources: dict[str, float] = field(default_factory=dict)
    """Ray resources of the learner: when given, the trainer itself (learner, rollout loop,
    checkpoints) runs in a Ray actor placed with these, e.g. {GPU: 1}; empty = in the process
    that ran bpo train."""
    placement: str = "PACK"
    """Ray placement-group strategy for all the bundles: PACK, SPREAD, STRICT_PACK,
    STRICT_SPREAD."""
    routing: str = "prefix"
    """How sampling calls are spread over inference engines: "prefix" sends a context to the
    engine that served its longest routed prefix (all turns and forks of a tree go to one
    engine, whose prefix cache then serves them), new trees to the least loaded engine;
    "round_robin" ignores prefixes (for comparison)."""
    placement_timeout_s: float = 120.0
    """How long to wait for the cluster to hold every role's bundle before giving up."""
    object_store_mb: int = 512
    """Object store of a Ray started with address "local" (a plain ray.init reserves 30% of
    memory)."""

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"cluster.routing={self.routing!r} is not valid; valid: "
                             f"{', '.join(ROUTINGS)}")  # fmt: skip
        if self.placement not in PLACEMENTS:
            raise ValueError(f"cluster.placement={self.placement!r} is not valid; valid: "
                             f"{', '.join(PLACEMENTS)}")  # fmt: skip
        if self.inference_engines < 0 or self.sandbox_actors < 0:
            raise ValueError("cluster.inference_engines and cluster.sandbox_actors must be >= 0")
        for name in ("engine_resources", "sandbox_resources", "learner_resources"):
            for key, amount in getattr(self, name).items():
                if not isinstance(amount, (int, float)) or isinstance(amount, bool) or amount < 0:
                    raise ValueError(f"cluster.{name}.{key} must be a number >= 0, got {amount!r}")
        uses_ray = self.inference_engines or self.sandbox_actors or self.learner_resources
        if uses_ray and not self.address:
            raise ValueError(
                "cluster.inference_engines, cluster.sandbox_actors and cluster.learner_resources "
                "need Ray: set cluster.address=local (Ray on this machine) or the address of a "
                "running cluster"
            )


@dataclass(frozen=True)
class Config:
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
