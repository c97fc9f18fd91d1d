"""What the rollout engine (:mod:`bpo.rollout.engine`) is given: its config, and the protocols
of the policy and the prompter it drives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bpo.rollout.budget import Budget

__all__ = ["ENTROPY_MODES", "PromptState", "Prompter", "RolloutConfig", "SamplerPolicy"]

ENTROPY_MODES = ("mean", "first", "greedy")


class PromptState(Protocol):
    ids: tuple[int, ...]
    """The whole context for the next action."""
    new_ids: tuple[int, ...]
    """Tokens appended after the action (all of ``ids`` after a start or a reset)."""
    reset: bool


class Prompter(Protocol):
    """Builds the policy's context at the token level, append-only
    (:class:`bpo.policy.prompts.PromptBuilder`)."""

    def start(
        self, instruction: str, observation: str, admissible: Sequence[str] | None
    ) -> PromptState: ...

    def extend(
        self,
        state: PromptState,
        action_ids: Sequence[int],
        observation: str,
        admissible: Sequence[str] | None,
    ) -> PromptState: ...


class SamplerPolicy(Protocol):
    """The part of :class:`bpo.policy.protocol.Policy` the engine uses."""

    def sample(self, contexts, n=1, params=None): ...  # -> list[list[TurnSample]]


@dataclass(frozen=True)
class RolloutConfig:
    root_width: int = 1
    """Children of the root: 1 = a single backbone (BPO default), N = an independent group."""
    max_steps: int = 30
    """Turns per rollout before it is truncated."""
    budget: Budget = field(default_factory=Budget)
    entropy: str = "first"
    """Turn entropy fed to the branch rule: the first action token's ("first", default) or the
    mean over the action's tokens ("mean"). The first token's entropy depends only on the state,
    so the branch decision is causal and the backbone's action an exact i.i.d. sibling of the
    forks. The mean also depends on the sampled action itself, which makes the decision look at
    the backbone's own action: the exact study measured a bias (z = 5.8) with "mean" and none
    with "first" (``bpo verify --engine-checks``). "greedy": the mean entropy along the greedy
    continuation from the state (a second, temperature-0 call on the cached context): a
    function of the state alone, so causal like "first", but it sees the decisions that come
    after an almost certain first token (``move`` | ``east``/``west``), at the cost of the probe's
    tokens, which count as generated tokens."""
    concurrency: int = 8
    """Trees grown at once (one sandbox each); their policy calls are batched together."""
    policy_version: int = 0
    fill_budget: bool = False
    """Expected-budget mode, branching rules: widen the root (more backbones, each branching
    under the rule) so that a tree's expected cost reaches the budget, as an independent group's
    does; ``root_width`` is then the least width. Without it a stingy rule leaves budget unspent
    and the tree is compared at less compute than the groups."""
    max_root_width: int = 64
    """Upper bound on the root's children when the budget decides them (groups and
    ``fill_budget``)."""
    max_retries: int = 2
    """Times a rollout hit by a fault (the sandbox raised, returned a malformed result, or
    could not restore) is started again from its snapshot (or from a reset) before it is
    dropped; see :meth:`RolloutEngine.run` for what a drop means for the estimator."""
    max_fault_frac: float = 0.25
    """A batch stops with :class:`RolloutError` when more than this share of its rollouts is
    dropped (judged at its end from 4 drops, or during it from 20): faults that common are a
    broken setup, not noise."""
    invalid_penalty: float = 0.0
    """Subtracted from a turn's reward when its action is invalid: the sample ran out of
    tokens before a stop token, or (where the sandbox lists admissible actions) the command is
    not one of them. GiGPO's ALFWorld and WebShop runs use 0.1. Without it, tokens the parser
    ignores cost nothing, and a policy can drift into never stopping (measured on the CPU demo:
    tokens per turn 3.2 -> 6.9 in 12 iterations)."""

    step_threads: int = 1
    """Sandbox steps in flight at once, across trees: 1 = one after another; more where a
    step waits on another process or machine (Ray sandbox actors, containers)."""

    def __post_init__(self) -> None:
        if self.step_threads < 1:
            raise ValueError(f"step_threads must be >= 1, got {self.step_threads}")
        if self.root_width < 1:
            raise ValueError(f"root_width must be >= 1, got {self.root_width}")
        if self.max_root_width < self.root_width and self.fill_budget:
            raise ValueError(
                f"max_root_width ({self.max_root_width}) must be >= root_width ({self.root_width})"
            )
        if self.entropy not in ENTROPY_MODES:
            raise ValueError(
                f"unknown entropy mode {self.entropy!r}; valid: {', '.join(ENTROPY_MODES)}"
            )
        if self.max_steps < 1 or self.concurrency < 1:
            raise ValueError("max_steps and concurrency must be >= 1")
        if self.max_retries < 0 or not 0.0 <= self.max_fault_frac <= 1.0:
            raise ValueError("max_retries must be >= 0 and max_fault_frac in [0, 1]")
