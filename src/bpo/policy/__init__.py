"""Policies: token-in/token-out sampling (``HFPolicy`` in :mod:`bpo.policy.hf`), agent prompts
built append-only through the chat template, action parsing, and offline models.

Importing this package does not import torch; ``from bpo.policy.hf import HFPolicy`` or
``make_policy("hf", model_dir)`` does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from bpo.policy.parsing import ParsedAction, parse_action
from bpo.policy.prompts import PromptBuilder, PromptState
from bpo.policy.protocol import Policy, PolicyStats, SamplingParams, TurnSample
from bpo.registry import Registry

POLICIES: Registry[Callable[..., Policy]] = Registry("policy")
"""Policy backends by name: ``factory(model, **options) -> Policy``."""


@POLICIES.register("hf")
def _hf(model: str | os.PathLike[str] | Any, **options: Any) -> Policy:
    """Transformers, with prefix caching (options: see ``HFPolicy``)."""
    from bpo.policy.hf import HFPolicy

    return HFPolicy(model, **options)


@POLICIES.register("vllm")
def _vllm(model: str | os.PathLike[str] | Any, **options: Any) -> Policy:
    """vLLM in-process: prefix caching, weight sync (options: see ``VLLMPolicy``; needs the
    ``bpo[vllm]`` extra, installed by ``make setup-vllm``)."""
    from bpo.policy.vllm import VLLMPolicy

    return VLLMPolicy(model, **options)


def make_policy(name: str, model: str | os.PathLike[str] | Any, **options: Any) -> Policy:
    """Build the policy backend ``name`` (e.g. "hf") over ``model`` (a directory or module)."""
    return POLICIES.get(name)(model, **options)


__all__ = [
    "POLICIES",
    "ParsedAction",
    "Policy",
    "PolicyStats",
    "PromptBuilder",
    "PromptState",
    "SamplingParams",
    "TurnSample",
    "make_policy",
    "parse_action",
]
