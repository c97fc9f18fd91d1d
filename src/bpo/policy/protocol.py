"""The policy contract: token ids in, sampled token ids (with their log-probs) out.

Rollout engines talk to a :class:`Policy`; the transformers implementation is
:class:`bpo.policy.hf.HFPolicy`. Contexts are token ids, never text: the tokens trained on are
exactly the tokens sampled (DESIGN section 2), and prompts are built append-only at the token
level by :mod:`bpo.policy.prompts`.

**Which distribution the log-probs and entropies refer to.** Both refer to
``pi_T = softmax(raw_logits / T)`` -- the model's distribution at the sampling temperature,
*before* any top-k / top-p truncation. That is the quantity the learner recomputes
(``log_softmax(logits / T)`` at the sampled token), so the PPO ratio is exactly 1 before the
first update. With the defaults (``top_k=0, top_p=1``) it is also exactly the distribution the
tokens were drawn from. With truncation on, tokens are drawn from the truncated distribution
but scored under ``pi_T``: the usual practice (it matches what the learner can recompute), and
a small off-policy mismatch that the clipped ratio absorbs. Greedy decoding (``temperature=0``)
reports log-probs and entropies of ``pi_1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one turn's action tokens."""

    max_new_tokens: int
    """Hard cap on generated tokens per sample (finish_reason "length" when reached)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax) decoding."""
    top_p: float = 1.0
    """Nucleus truncation (1.0 = off). Sampling-time only; see the module docstring."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off). Sampling-time only."""
    stop_token_ids: tuple[int, ...] | None = None
    """Tokens that end a sample (kept as the sample's last token). None = the policy's
    ``stop_token_ids`` (eos and the chat template's end-of-turn token)."""
    seed: int | None = None
    """None: draw from the policy's own random stream. An int: sample j of a context is a
    deterministic function of (seed, context ids, j), independent of batching and caching
    (for tests and reproducible evaluation). Two calls with the same seed on the same context
    give the same samples: never reuse a seed for siblings that must be independent."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")


@dataclass(frozen=True)
class TurnSample:
    """One sampled action (one policy decision), token-in/token-out."""

    action_ids: tuple[int, ...]
    """The sampled tokens, exactly as generated (a stop token, when hit, is the last one)."""
    logprobs: tuple[float, ...]
    """log pi_T(token | context, earlier tokens) for each sampled token (see module docstring)."""
    entropies: tuple[float, ...]
    """Entropy (nats) of pi_T at each generated position."""
    text: str
    """``action_ids`` decoded, special tokens skipped (for the sandbox; never re-tokenised)."""
    finish_reason: FinishReason
    """"stop" when a stop token was sampled, "length" when max_new_tokens was reached."""
    prefill_tokens: int
    """Context tokens computed for this sample's context in this call (0 when the whole context
    was cached). Siblings share one prefill: it is reported on the context's first sample and
    0 on the others, so summing over all returned samples gives the call's prefill compute."""

    @property
    def num_tokens(self) -> int:
        return len(self.action_ids)

    @property
    def mean_entropy(self) -> float:
        """Mean per-token entropy: the default turn entropy of the branch rules."""
        return sum(self.entropies) / len(self.entropies) if self.entropies else 0.0


@dataclass(frozen=True)
class PolicyStats:
    """Cumulative compute counters of a policy (since construction)."""

    calls: int
    """``sample`` calls."""
    requests: int
    """Contexts submitted (a context with n samples counts once)."""
    samples: int
    """Samples returned."""
    generated_tokens: int
    """Tokens sampled."""
    prefill_tokens: int
    """Context tokens computed by forward passes outside decoding (after cache reuse)."""
    decode_tokens: int
    """Tokens fed through the model while decoding (each sample's tokens but its last)."""
    padded_tokens: int
    """Positions computed only as padding (shorter suffixes in a prefill batch, finished
    samples kept in a decode batch until it is compacted): real compute, no useful token."""
    cache_hit_tokens: int
    """Context tokens reused from the prefix cache instead of being computed."""
    cache_hits: int
    """Requests that reused a cached prefix of at least one token."""
    cached_tokens: int
    """Tokens currently held by the prefix cache."""
    evicted_tokens: int
    """Tokens dropped from the prefix cache by the budget (LRU)."""

    @property
    def computed_tokens(self) -> int:
        """Useful token positions run through the model: prefill + decode (padding excluded)."""
        return self.prefill_tokens + self.decode_tokens


@runtime_checkable
class Policy(Protocol):
    """What rollout engines sample from."""

    tokenizer: Any
    """A transformers tokenizer (for prompts and for decoding actions)."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Default stop tokens: eos and the chat template's end-of-turn token."""
        ...

    def sample(
        self,
        contexts: Sequence[Sequence[int]],
        n: int | Sequence[int] = 1,
        params: SamplingParams | None = None,
    ) -> list[list[TurnSample]]:
        """For each context, ``n`` (or ``n[i]``) i.i.d. samples; ``result[i][j]`` is sample j of
        context i. The siblings of a context share one prefill."""
        ...

    def release(self, contexts: Sequence[Sequence[int]]) -> None:
        """Drop cached state for these contexts and everything cached after them."""
        ...

    def clear_cache(self) -> None:
        """Drop all cached state (required after the weights change, if not automatic)."""
        ...

    def stats(self) -> PolicyStats: ...


def check_requests(
    contexts: Sequence[Sequence[int]],
    n: int | Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_positions: int,
    where: str = "the model's",
    fix: str = "",
) -> tuple[list[tuple[int, ...]], list[int]]:
    """The arguments of :meth:`Policy.sample` normalised (contexts as int tuples, one ``n`` per
    context) and checked, for every backend alike; errors name the problem and the fix."""
    ctxs = [tuple(int(t) for t in c) for c in contexts]
    ns = [int(n)] * len(ctxs) if isinstance(n, int) else [int(k) for k in n]
    if len(ns) != len(ctxs):
        raise ValueError(f"n has {len(ns)} entries for {len(ctxs)} contexts")
    if any(k < 0 for k in ns):
        raise ValueError(f"n must be >= 0, got {ns}")
    for c in ctxs:
        if not c:
            raise ValueError("empty context: a context needs at least one token")
        if len(c) + params.max_new_tokens > max_positions:
            raise ValueError(
                f"context of {len(c)} tokens + max_new_tokens={params.max_new_tokens} exceeds "
                f"{where} {max_positions} positions; lower the prompt builder's "
                f"max_context_tokens{fix}"
            )
        if min(c) < 0 or max(c) >= vocab_size:
            raise ValueError(f"context has token ids outside the vocabulary [0, {vocab_size})")
    return ctxs, ns
