"""Run configuration: one frozen dataclass per concern, YAML files, dotted command-line overrides.

    bpo train                                   # the default CPU demo config
    bpo train --config configs/alfworld.yaml tree.k=4 estimator=rloo learner.lr=3e-5

Some sections accept a bare value for their main field: ``estimator=rloo`` sets
``estimator.name``, ``sandbox=alfworld`` sets ``sandbox.name``, ``tree=every`` sets
``tree.rule`` and ``policy=PATH`` sets ``policy.model``. Unknown keys, wrong types and invalid values fail at load time with a
message that names the key and lists the valid choices.

The sections' dataclasses are in :mod:`bpo.config_schema` and re-exported here: import them,
:func:`load_config` and :class:`ConfigError` from this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

# the schema, re-exported (ROUTINGS, PLACEMENTS and LearnerConfig too: they were importable from
# here before the schema had a module of its own)
from bpo.config_schema import PLACEMENTS as PLACEMENTS
from bpo.config_schema import ROUTINGS as ROUTINGS
from bpo.config_schema import (
    BudgetConfig,
    ClusterConfig,
    Config,
    ConfigError,
    EstimatorConfig,
    EvalConfig,
    PolicyConfig,
    RunConfig,
    SandboxConfig,
    SFTConfig,
    TreeConfig,
)
from bpo.learner_config import LearnerConfig as LearnerConfig

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
