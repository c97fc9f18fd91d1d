"""Measure HFPolicy: sampling throughput, and prefix-cache efficiency on a branching tree.

    python -m bpo.policy.bench --model DIR [--batch 1 16] [--new-tokens 64] [--tree]

Throughput: ``batch`` distinct random contexts of ``--context`` tokens, one sample each,
exactly ``--new-tokens`` tokens per sample (stop tokens off), tokens/s = generated tokens /
wall time of the ``sample`` call (prefill included), median of ``--repeats`` calls after one
warm-up; next to it, transformers' own ``generate`` on the same batch (left-padded, its
DynamicCache), as a reference. Tree: a synthetic K-ary tree of ``--turns`` turns (every
sample of turn t branches K ways at turn t+1, as BPO's siblings do); efficiency = tokens the
policy computed (prefill + decode) / unique tokens in the tree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence

import torch

from bpo.policy.hf import HFPolicy
from bpo.policy.protocol import SamplingParams


def throughput(
    policy: HFPolicy, batch: int, context: int, new_tokens: int, repeats: int, seed: int = 0
) -> dict[str, float]:
    """Tokens/s of ``policy.sample`` and of ``model.generate`` on the same contexts."""
    vocab = policy.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=())
    ours, ref = [], []
    for rep in range(repeats + 1):  # the first round warms up
        ctxs = torch.randint(3, vocab, (batch, context), generator=gen)
        policy.clear_cache()
        t = time.perf_counter()
        out = policy.sample(ctxs.tolist(), n=1, params=params)
        dt = time.perf_counter() - t
        assert all(len(g[0].action_ids) == new_tokens for g in out)
        t = time.perf_counter()
        with torch.no_grad():
            policy.model.generate(
                ctxs.to(policy.device),
                attention_mask=torch.ones_like(ctxs).to(policy.device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                top_k=0,
                pad_token_id=0,
            )
        dt_ref = time.perf_counter() - t
        if rep:
            ours.append(batch * new_tokens / dt)
            ref.append(batch * new_tokens / dt_ref)
    return {
        "tokens_per_s": statistics.median(ours),
        "generate_tokens_per_s": statistics.median(ref),
    }


def tree_efficiency(
    policy: HFPolicy, k: int = 4, turns: int = 3, root: int = 200, obs: int = 30,
    new_tokens: int = 16, seed: int = 0,
) -> dict[str, float]:  # fmt: skip
    """Computed / unique tokens on a synthetic K-ary tree (fresh cache)."""
    vocab = policy.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    policy.clear_cache()
    before = policy.stats()
    level = [torch.randint(3, vocab, (root,), generator=gen).tolist()]
    unique: set[tuple[int, ...]] = set()
    t = time.perf_counter()
    for _ in range(turns):
        out = policy.sample(level, n=k, params=params)
        nxt = []
        for ctx, group in zip(level, out, strict=True):
            for s in group:
                seq = ctx + list(s.action_ids)
                unique.update(tuple(seq[:i]) for i in range(1, len(seq) + 1))
                nxt.append(seq + torch.randint(3, vocab, (obs,), generator=gen).tolist())
        level = nxt
    wall = time.perf_counter() - t
    after = policy.stats()
    computed = after.computed_tokens - before.computed_tokens
    return {
        "unique_tokens": len(unique),
        "computed_tokens": computed,
        "efficiency": computed / len(unique),
        "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
        "padded_tokens": after.padded_tokens - before.padded_tokens,
        "samples": after.samples - before.samples,
        "wall_s": wall,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bpo.policy.bench", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--batch", type=int, nargs="*", default=[1, 16])
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tree", action="store_true", help="also measure the K=4, 3-turn tree")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    policy = HFPolicy(a.model, dtype=a.dtype, attn_implementation=a.attn, seed=0)
    name = os.path.basename(os.path.normpath(a.model))
    print(f"model={name} dtype={a.dtype} attn={a.attn} threads={torch.get_num_threads()}")
    for b in a.batch:
        r = throughput(policy, b, a.context, a.new_tokens, a.repeats)
        print(
            f"batch={b:3d} context={a.context} new={a.new_tokens}: "
            f"HFPolicy {r['tokens_per_s']:8.1f} tok/s   generate {r['generate_tokens_per_s']:8.1f} tok/s"
        )
    if a.tree:
        no_cache = HFPolicy(policy.model, policy.tokenizer, cache_budget_tokens=0, seed=0)
        for label, pol in (("prefix cache", policy), ("no cache", no_cache)):
            r = tree_efficiency(pol)
            print(
                f"tree K=4 turns=3 ({label}): computed/unique = {r['computed_tokens']}/"
                f"{r['unique_tokens']} = {r['efficiency']:.3f}, prefill {r['prefill_tokens']}, "
                f"padding {r['padded_tokens']}, {r['samples']} samples, {r['wall_s']:.2f} s"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
