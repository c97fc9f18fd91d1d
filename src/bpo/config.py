"""Run configuration: one frozen dataclass per concern, YAML files, dotted command-line overrides.

    bpo train                                   # the default CPU demo config
    bpo train --config configs/alfworld.yaml tree.k=4 estimator=rloo learner.lr=3e-5

Some sections accept a bare value for their main field: ``estimator=rloo`` sets
``estimator.name``, ``sandbox=alfworld`` sets ``sandbox.name``, ``tree=every`` sets
``tree.rule`` and ``policy=PATH`` sets ``policy.model``. Unknown keys, wrong types and invalid values fail at load time with a
message that names the key and lists the valid choices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bpo.learner_config import LearnerConfig
from bpo.rollout.budget import BUDGET_MODES, BUDGET_UNITS

__all__ = [
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
    "load_config",
    "to_dict",
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


# --------------------------------------------------------------------------------------------
# building dataclasses from plain data, with errors that name the key


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: cannot be {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping of fields, got {value!r}")
        return _build(tp, value, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        inner = args[0] if args and (len(args) == 2 and args[1] is Ellipsis) else None
        if inner is not None:
            return tuple(_coerce(v, inner, key) for v in value)
        if len(args) != len(value):
            raise ConfigError(f"{key} must have {len(args)} entries, got {value!r}")
        return tuple(_coerce(v, a, key) for v, a in zip(value, args, strict=True))
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        _check_writable(value, key)
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        number: float | None = None
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = float(value)  # YAML 1.1 reads 3e-5 (no dot) as a string
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                raise ConfigError(f"{key} is too large for a float: {value!r}") from None
        if number is None:
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    return value


_MAX_VALUES = 100_000
_MAX_DEPTH = 64


def _check_writable(value: Any, key: str) -> None:
    """Refuse values that a run could not write back to its config.yaml: self-referencing YAML
    aliases (``&a [*a]``), aliases that expand to huge trees, absurd nesting."""
    stack = [(value, 0)]
    count = 0
    while stack:
        x, depth = stack.pop()
        count += 1
        if count > _MAX_VALUES or depth > _MAX_DEPTH:
            raise ConfigError(
                f"{key} is too large or nested too deeply (over {_MAX_VALUES} values or "
                f"{_MAX_DEPTH} levels); a YAML alias that refers to itself, such as '&a [*a]'?"
            )
        if isinstance(x, Mapping):
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend((v, depth + 1) for v in x)


def _build(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            raise ConfigError(f"unknown config key {key!r}; valid keys here: {', '.join(names)}")
        kwargs[k] = _coerce(v, hints[k], key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict (YAML-safe) of a config."""
    out = dataclasses.asdict(cfg)

    def fix(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [fix(v) for v in x]
        return x

    return fix(out)


# What yaml.safe_load raises besides YAMLError: ValueError from its constructors (a date such
# as 2001-13-45, an integer over 4,300 digits) and RecursionError (deeply nested brackets).
_YAML_ERRORS = (yaml.YAMLError, ValueError, RecursionError)


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except _YAML_ERRORS:
        return text


_SHORTHAND = {"estimator": "name", "sandbox": "name", "tree": "rule", "policy": "model"}


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides (values parsed as YAML scalars) to nested plain data."""
    sections = {f.name for f in dataclasses.fields(Config)}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. tree.k=4)")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        value = _parse_value(text)
        if len(parts) == 1 and parts[0] in sections:
            if parts[0] in _SHORTHAND:
                parts = [parts[0], _SHORTHAND[parts[0]]]
            else:
                raise ConfigError(
                    f"{key!r} is a section; set one of its keys, e.g. {key}.KEY=VALUE"
                )
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"cannot set {key!r}: {p!r} is not a section")
        node[parts[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file (if any), then the overrides; validated."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {str(p)!r} cannot be read as UTF-8 text: {e}") from None
        try:
            loaded = yaml.safe_load(text) or {}
        except _YAML_ERRORS as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
        data = loaded
    data = apply_overrides(data, overrides)
    cfg = _build(Config, data)
    _validate_names(cfg)
    _validate_combinations(cfg)
    return cfg


def _validate_names(cfg: Config) -> None:
    from bpo.branching import BRANCH_RULES
    from bpo.estimators import ESTIMATORS

    valid = [*ESTIMATORS.names(), "ppo"]  # ppo: GAE with a value head (bpo.learner)
    if cfg.estimator.name not in valid:
        raise ConfigError(
            f"estimator.name={cfg.estimator.name!r} is not valid; valid: {', '.join(sorted(valid))}"
        )
    if cfg.tree.rule not in BRANCH_RULES:
        raise ConfigError(
            f"tree.rule={cfg.tree.rule!r} is not valid; valid: {', '.join(BRANCH_RULES.names())}"
        )
    if cfg.policy.backend not in ("hf", "vllm"):
        raise ConfigError(f"policy.backend={cfg.policy.backend!r} is not valid; valid: hf, vllm")


def _validate_combinations(cfg: Config) -> None:
    """Settings that are valid alone but not together."""
    c, p = cfg.cluster, cfg.policy
    if p.backend == "vllm" and cfg.run.max_staleness and not c.inference_engines:
        raise ConfigError(
            "run.max_staleness > 0 with policy.backend=vllm needs cluster.inference_engines "
            "> 0 (vLLM engines as Ray actors); the in-process asynchronous sampler is a "
            "transformers copy (set cluster.inference_engines, run.max_staleness=0, or "
            "policy.backend=hf)"
        )
    if p.backend == "vllm" and c.inference_engines and p.lora_rank:
        raise ConfigError(
            "cluster.inference_engines with policy.backend=vllm syncs full weights; "
            "policy.lora_rank > 0 is synced to vLLM as an adapter only by the trainer's own "
            "engine (set cluster.inference_engines=0, policy.lora_rank=0, or policy.backend=hf)"
        )
