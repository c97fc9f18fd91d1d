"""``check_policy``: an executable check of the :class:`~bpo.policy.protocol.Policy` contract.

Run it over every policy backend (CI does, for ``HFPolicy`` under sdpa and eager attention).
Each failure names the property and its likely cause. What it checks, through the protocol
only (no access to the model):

1. shapes: ``result[i]`` has ``n[i]`` samples; ids, log-probs and entropies align;
2. values: log-probs <= 0, entropies >= 0, all finite; finish_reason is "stop" exactly when
   the last token is a stop token, else the sample has ``max_new_tokens`` tokens;
3. reproducibility: a seed gives the same samples batched or alone, cached or not;
4. accounting: the prefill reported on the samples adds up to the ``stats()`` delta, and a
   context sampled again is served from the cache (prefill 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bpo.policy.protocol import Policy, SamplingParams, TurnSample


class PolicyCheckError(AssertionError):
    """A policy broke its contract; the message says which property and the likely cause."""


def _fail(what: str, cause: str) -> None:
    raise PolicyCheckError(f"{what} -- likely cause: {cause}")


def _same(a: TurnSample, b: TurnSample, tol: float) -> bool:
    return a.action_ids == b.action_ids and all(
        abs(x - y) <= tol for x, y in zip(a.logprobs, b.logprobs, strict=True)
    )


def check_policy(
    policy: Policy,
    contexts: Sequence[Sequence[int]] | None = None,
    max_new_tokens: int = 8,
    tol: float = 1e-4,
) -> None:
    """Raise :class:`PolicyCheckError` if ``policy`` breaks the contract. ``contexts`` default
    to three short chat prompts built with the policy's tokenizer."""
    tok = policy.tokenizer
    if contexts is None:
        contexts = [
            tok(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
            for text in ("Go north.", "You see a key and a door.", "Open it.")
        ]
    ctxs = [list(c) for c in contexts]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=1234)
    stops = set(policy.stop_token_ids)
    policy.clear_cache()
    before = policy.stats()
    ns = [2, 1, 3][: len(ctxs)] + [1] * max(0, len(ctxs) - 3)
    out = policy.sample(ctxs, n=ns, params=params)
    # 1-2. shapes and values
    if [len(g) for g in out] != ns:
        _fail(f"sample returned {[len(g) for g in out]} samples for n={ns}", "n ignored")
    for group in out:
        for s in group:
            k = len(s.action_ids)
            if not (1 <= k <= max_new_tokens and len(s.logprobs) == len(s.entropies) == k):
                _fail(f"sample has {k} ids, {len(s.logprobs)} log-probs", "misaligned records")
            if not all(math.isfinite(x) and x <= 1e-6 for x in s.logprobs):
                _fail(f"log-probs {s.logprobs} not finite and <= 0", "scores, not log-probs")
            if not all(math.isfinite(x) and x >= -1e-6 for x in s.entropies):
                _fail(f"entropies {s.entropies} not finite and >= 0", "entropy sign or NaN")
            stopped = s.action_ids[-1] in stops
            if s.finish_reason != ("stop" if stopped else "length") or (
                not stopped and k != max_new_tokens
            ):
                _fail(f"finish_reason {s.finish_reason!r} for {k} tokens", "stop handling")
    # 4. accounting
    after = policy.stats()
    reported = sum(s.prefill_tokens for g in out for s in g)
    if reported != after.prefill_tokens - before.prefill_tokens:
        _fail(
            f"samples report {reported} prefill tokens, stats() counted "
            f"{after.prefill_tokens - before.prefill_tokens}",
            "prefill attributed to several siblings, or not reported",
        )
    again = policy.sample([ctxs[0]], n=ns[0], params=params)[0]
    if any(s.prefill_tokens for s in again):
        _fail("a context sampled twice was prefilled again", "the prefix cache missed it")
    # 3. reproducibility: batched == alone == cached == fresh
    if not all(_same(a, b, tol) for a, b in zip(again, out[0], strict=True)):
        _fail("same seed, same context, different samples (cached)", "cache not exact")
    for ctx, group in zip(ctxs, out, strict=True):
        policy.clear_cache()
        alone = policy.sample([ctx], n=len(group), params=params)[0]
        if not all(_same(a, b, tol) for a, b in zip(alone, group, strict=True)):
            _fail("a seeded sample differs batched and alone", "batching (masks/positions)")
    ext = ctxs[0] + list(out[0][0].action_ids) + ctxs[-1]
    warm = policy.sample([ext], n=2, params=params)[0]  # ctxs[0]'s samples are cached
    policy.clear_cache()
    cold = policy.sample([ext], n=2, params=params)[0]
    if not all(_same(a, b, tol) for a, b in zip(warm, cold, strict=True)):
        _fail("an extension sampled over a cached prefix differs from scratch", "cache reuse")
    if not warm[0].prefill_tokens < cold[0].prefill_tokens == len(ext):
        _fail(
            f"prefill {warm[0].prefill_tokens} over a cached prefix vs {cold[0].prefill_tokens} "
            f"from scratch for {len(ext)} tokens",
            "no prefix reuse across turns",
        )
