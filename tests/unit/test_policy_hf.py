"""HFPolicy exactness (sampled log-probs, cached vs from-scratch, batched vs unbatched, sdpa vs
eager), prefix-cache accounting, and the radix tree and sampling functions it is built on.

Tiny random-init float32 models (hidden 64, 2 layers, grouped-query attention), built offline.
"""

from __future__ import annotations

import os
from dataclasses import replace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
import torch

from bpo.policy import make_policy
from bpo.policy.check import PolicyCheckError, check_policy
from bpo.policy.hf import HFPolicy
from bpo.policy.models import init_model
from bpo.policy.prefix_cache import PrefixCache
from bpo.policy.protocol import Policy, SamplingParams, TurnSample
from bpo.policy.sampling import teacher_forced_logprobs, tempered_log_probs, truncate

TOL = 1e-5


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2": str(init_model(root / "qwen2", arch="qwen2", hidden=64, layers=2, heads=4)),
        "llama": str(
            init_model(root / "llama", arch="llama", hidden=64, layers=2, heads=4, tokenizer="bpe")
        ),
    }


def make(model_dirs: dict[str, str], arch: str = "qwen2", attn: str = "sdpa", **kw) -> HFPolicy:
    policy = make_policy("hf", model_dirs[arch], attn_implementation=attn, seed=0, **kw)
    assert isinstance(policy, HFPolicy)
    return policy


def chat(policy: HFPolicy, text: str) -> list[int]:
    msgs = [{"role": "system", "content": "Play."}, {"role": "user", "content": text}]
    out = policy.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"])


def obs_ids(policy: HFPolicy, text: str) -> list[int]:
    ids = policy.tokenizer(
        f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )["input_ids"]
    return list(ids)


def assert_teacher_forced(policy: HFPolicy, ctx: list[int], s: TurnSample, temp: float) -> None:
    ref = teacher_forced_logprobs(policy.model, ctx, s.action_ids, temp)
    got = torch.tensor(s.logprobs)
    assert (ref - got).abs().max().item() < TOL


def same(a: TurnSample, b: TurnSample) -> bool:
    close = np.allclose(a.logprobs, b.logprobs, atol=TOL, rtol=0)
    return a.action_ids == b.action_ids and close and a.finish_reason == b.finish_reason


P = SamplingParams(max_new_tokens=12, temperature=0.8, seed=7)


# ------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize(
    ("arch", "attn"), [("qwen2", "sdpa"), ("qwen2", "eager"), ("llama", "sdpa"), ("llama", "eager")]
)
def test_sampled_logprobs_equal_teacher_forced(model_dirs, arch, attn):
    policy = make(model_dirs, arch, attn)
    assert isinstance(policy, Policy)
    ctxs = [chat(policy, "You are in a kitchen."), chat(policy, "A long hallway. " * 6)]
    params = SamplingParams(max_new_tokens=10, temperature=0.7)
    out = policy.sample(ctxs, n=[3, 2], params=params)
    assert [len(g) for g in out] == [3, 2]
    for ctx, group in zip(ctxs, out, strict=True):
        for s in group:
            assert len(s.action_ids) == len(s.logprobs) == len(s.entropies) == 10
            assert s.finish_reason == "length"
            assert_teacher_forced(policy, ctx, s, 0.7)
            # entropy of pi_T at the first action position, recomputed from scratch
            with torch.no_grad():
                logits = policy.model(input_ids=torch.tensor([ctx])).logits[0, -1]
            lp = tempered_log_probs(logits, 0.7)
            assert abs(-(lp.exp() * lp).sum().item() - s.entropies[0]) < TOL


def test_greedy_equals_transformers_generate(model_dirs):
    policy = make(model_dirs)
    ctx = chat(policy, "Go north.")
    s = policy.sample([ctx], params=SamplingParams(max_new_tokens=16, temperature=0))[0][0]
    ref = policy.model.generate(
        torch.tensor([ctx]), max_new_tokens=16, do_sample=False, eos_token_id=None
    )[0, len(ctx) :]
    assert list(s.action_ids) == ref.tolist()
    assert_teacher_forced(policy, ctx, s, 1.0)  # greedy reports log-probs of pi_1


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_continuation_from_cache_equals_from_scratch(model_dirs, attn):
    warm = make(model_dirs, attn=attn)
    ctx = chat(warm, "You see a locked chest.")
    first = warm.sample([ctx], n=2, params=P)[0]
    ctx2 = ctx + list(first[1].action_ids) + obs_ids(warm, "The chest is locked.")
    got = warm.sample([ctx2], n=3, params=P)[0]
    assert got[0].prefill_tokens < len(ctx2) - len(ctx)  # only the new tokens (+ last action)
    cold = make(model_dirs, attn=attn)
    ref = cold.sample([ctx2], n=3, params=P)[0]
    assert ref[0].prefill_tokens == len(ctx2)
    assert all(same(a, b) for a, b in zip(got, ref, strict=True))
    for s in got:
        assert_teacher_forced(warm, ctx2, s, P.temperature)


def test_fully_cached_context_needs_no_forward(model_dirs):
    policy = make(model_dirs)
    ctx = chat(policy, "Branch here.")
    backbone = policy.sample([ctx], n=1, params=P)[0][0]
    assert backbone.prefill_tokens == len(ctx)
    forks = policy.sample([ctx], n=3, params=P)[0]  # same seed: sample 0 repeats the backbone
    assert [s.prefill_tokens for s in forks] == [0, 0, 0]
    assert same(forks[0], backbone)
    assert len({s.action_ids for s in forks}) == 3


def test_batched_equals_unbatched_with_mixed_cache_states(model_dirs):
    policy = make(model_dirs)
    base = chat(policy, "The cellar is dark.")
    policy.sample([base], params=P)  # cache base (a prefix of two requests below)
    ctxs = [
        base + obs_ids(policy, "You light a lamp."),  # cached prefix + suffix
        chat(policy, "A different task entirely, with a longer first observation."),  # cold
        base,  # fully cached
        base[:-3],  # prefix of a cached sequence
        base + obs_ids(policy, "You light a lamp.") + obs_ids(policy, "It goes out."),  # shares
    ]
    batched = policy.sample(ctxs, n=[2, 1, 2, 1, 2], params=P)
    for ctx, group in zip(ctxs, batched, strict=True):
        alone = make(model_dirs).sample([ctx], n=len(group), params=P)[0]
        assert all(same(a, b) for a, b in zip(group, alone, strict=True))
        for s in group:
            assert_teacher_forced(policy, ctx, s, P.temperature)


def test_sdpa_equals_eager(model_dirs):
    ctxs = [chat(make(model_dirs), "North or south?"), chat(make(model_dirs), "Up.")]
    a = make(model_dirs, attn="sdpa").sample(ctxs, n=2, params=P)
    b = make(model_dirs, attn="eager").sample(ctxs, n=2, params=P)
    assert all(same(x, y) for ga, gb in zip(a, b, strict=True) for x, y in zip(ga, gb, strict=True))


def test_stop_tokens_end_a_sample_and_are_kept(model_dirs):
    policy = make(model_dirs)
    ctx = chat(policy, "Say something.")
    free = policy.sample([ctx], params=SamplingParams(max_new_tokens=12, temperature=0))[0][0]
    stop = free.action_ids[3]  # a token greedy decoding emits at step 3
    params = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(stop,))
    s = policy.sample([ctx], params=params)[0][0]
    first = free.action_ids.index(stop)
    assert s.action_ids == free.action_ids[: first + 1]
    assert s.finish_reason == "stop" and free.finish_reason == "length"
    assert policy.tokenizer.convert_tokens_to_ids("<|im_end|>") in policy.stop_token_ids


def test_sampling_frequencies_follow_the_tempered_distribution(model_dirs):
    policy = make(model_dirs)
    ctx = chat(policy, "Pick.")
    with torch.no_grad():
        probs = tempered_log_probs(policy.model(input_ids=torch.tensor([ctx])).logits[0, -1], 0.15)
    probs = probs.exp()
    n = 3000
    out = policy.sample([ctx], n=n, params=SamplingParams(max_new_tokens=1, temperature=0.15))[0]
    counts = np.bincount([s.action_ids[0] for s in out], minlength=len(probs))
    freq, p = counts / n, probs.numpy()
    assert p.max() < 0.99  # the check is not trivial
    assert np.all(np.abs(freq - p) < 5 * np.sqrt(p * (1 - p) / n) + 2e-3)
    top5 = set(torch.topk(probs, 5).indices.tolist())
    k5 = policy.sample([ctx], n=200, params=SamplingParams(1, temperature=3.0, top_k=5))[0]
    assert {s.action_ids[0] for s in k5} <= top5
    k1 = policy.sample([ctx], n=20, params=SamplingParams(1, temperature=3.0, top_k=1))[0]
    assert {s.action_ids[0] for s in k1} == {int(probs.argmax())}


# ------------------------------------------------------------------------------ accounting


def test_three_turn_tree_computes_each_unique_token_about_once(model_dirs):
    policy = make(model_dirs)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    level = [chat(policy, "Root observation of the task. " * 3)]
    unique: set[tuple[int, ...]] = set()  # every prefix of every sequence = unique tree tokens
    reported = 0
    for turn in range(3):
        out = policy.sample(level, n=4, params=params)
        nxt = []
        for ctx, group in zip(level, out, strict=True):
            for j, s in enumerate(group):
                seq = ctx + list(s.action_ids)
                unique.update(tuple(seq[:i]) for i in range(1, len(seq) + 1))
                reported += s.prefill_tokens
                nxt.append(seq + obs_ids(policy, f"turn {turn} branch {j}"))
        level = nxt
    st = policy.stats()
    assert st.samples == 4 + 16 + 64 and st.prefill_tokens == reported
    assert st.computed_tokens / len(unique) <= 1.05
    assert st.computed_tokens / len(unique) >= 0.95


def test_shared_uncached_prefix_is_computed_once(model_dirs):
    policy = make(model_dirs)
    base = chat(policy, "A shared system prompt and a long shared instruction. " * 3)
    ctxs = [base + obs_ids(policy, f"task {i}") for i in range(4)]
    out = policy.sample(ctxs, n=1, params=P)
    unique = len({tuple(c[:i]) for c in ctxs for i in range(1, len(c) + 1)})
    assert unique < sum(len(c) for c in ctxs) - 3 * len(base)
    assert sum(g[0].prefill_tokens for g in out) == policy.stats().prefill_tokens == unique
    for ctx, g in zip(ctxs, out, strict=True):
        assert_teacher_forced(policy, ctx, g[0], P.temperature)


def test_budget_eviction_release_and_weight_updates(model_dirs):
    policy = make(model_dirs, cache_budget_tokens=120)
    ctxs = [chat(policy, f"Task number {i}.") for i in range(4)]
    for c in ctxs:
        policy.sample([c], params=P)
        assert policy.stats().cached_tokens <= 120
    assert policy.stats().evicted_tokens > 0
    s = policy.sample([ctxs[0]], params=P)[0][0]  # its tail was evicted: recomputed, exact
    assert 1 < s.prefill_tokens < len(ctxs[0])  # the shared system prompt stayed cached
    assert same(s, make(model_dirs).sample([ctxs[0]], params=P)[0][0])
    assert policy.sample([ctxs[0]], params=P)[0][0].prefill_tokens == 0  # now cached
    policy.release([ctxs[0]])  # drops what only ctxs[0] used; the shared prefix stays
    assert policy.sample([ctxs[0]], params=P)[0][0].prefill_tokens == s.prefill_tokens
    policy.clear_cache()
    assert policy.stats().cached_tokens == 0
    policy.sample([ctxs[1]], params=P)
    with torch.no_grad():  # an optimizer step modifies parameters in place
        policy.model.model.norm.weight.mul_(1.5)
    s = policy.sample([ctxs[1]], params=P)[0][0]
    assert s.prefill_tokens == len(ctxs[1])  # the stale cache was dropped
    assert_teacher_forced(policy, ctxs[1], s, P.temperature)


def test_invalid_requests_name_the_problem(model_dirs):
    policy = make(model_dirs)
    with pytest.raises(ValueError, match="empty context"):
        policy.sample([[]], params=P)
    with pytest.raises(ValueError, match="max_context_tokens"):
        policy.sample([[5] * 4090], params=SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="entries"):
        policy.sample([[5], [6]], n=[1], params=P)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(4, top_p=0)
    with pytest.raises(FileNotFoundError, match="init-model"):
        HFPolicy("/nonexistent/model")


# ------------------------------------------------------------------------------ building blocks


def kv_of(ids: list[int]) -> torch.Tensor:
    """A fake KV payload whose values encode (position, token): [1, 2, 1, n, 2]."""
    t = torch.tensor([[float(i), float(x)] for i, x in enumerate(ids)])
    return t[None, None, None].expand(1, 2, 1, len(ids), 2).clone()


def test_radix_tree_match_split_logits_and_lru():
    cache = PrefixCache(budget_tokens=10)
    cache.insert([1, 2, 3, 4], kv_of([1, 2, 3, 4]), {2: torch.tensor([0.5])})
    cache.insert([1, 2, 5], kv_of([1, 2, 5]))
    assert cache.size == 5 and cache.num_nodes() == 3  # [1,2] -> [3,4], [5]
    m = cache.match([1, 2, 3, 9])
    assert m.length == 3 and m.logits is None
    assert torch.equal(m.kv, kv_of([1, 2, 3]))
    m = cache.match([1, 2])
    assert m.length == 2 and m.logits is not None and m.logits.item() == 0.5
    assert cache.match([1, 2, 5, 6]).kv[0, 0, 0, 2, 1].item() == 5.0
    cache.match([1, 2, 3, 4])  # [1,2,5] is now the least recently used leaf
    cache.insert([7, 8, 9, 10, 11], kv_of([7, 8, 9, 10, 11]))  # 10 tokens: fits
    cache.insert([7, 8, 9, 10, 11, 12], kv_of([7, 8, 9, 10, 11, 12]))  # 11 > 10: evict LRU
    assert cache.size <= 10 and cache.match([1, 2, 5]).length == 2
    cache.release([7, 8])
    assert cache.match([7]).length == 0 and cache.match([1, 2, 3, 4]).length == 4
    cache.clear()
    assert cache.size == 0 and cache.match([1]).length == 0


def test_truncate_top_k_and_top_p_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = truncate(logp, top_k=0, top_p=0.8).isfinite()  # 0.5 + 0.3 reach 0.8
    assert kept.tolist() == [[True, True, False, False]]
    kept = truncate(logp, top_k=0, top_p=0.81).isfinite()
    assert kept.tolist() == [[True, True, True, False]]
    kept = truncate(logp, top_k=1, top_p=1.0).isfinite()
    assert kept.tolist() == [[True, False, False, False]]


# ------------------------------------------------------------------------------ contract checker


@pytest.mark.parametrize(("arch", "attn"), [("qwen2", "sdpa"), ("llama", "eager")])
def test_check_policy_passes(model_dirs, arch, attn):
    check_policy(make(model_dirs, arch, attn))


class SiblingsEachReportThePrefill:
    """A deliberately broken policy: every sibling claims the shared context's prefill."""

    def __init__(self, inner: HFPolicy) -> None:
        self.inner, self.tokenizer, self.stop_token_ids = (
            inner,
            inner.tokenizer,
            inner.stop_token_ids,
        )
        self.release, self.clear_cache, self.stats = inner.release, inner.clear_cache, inner.stats

    def sample(self, contexts, n=1, params=None):
        out = self.inner.sample(contexts, n, params)
        return [[replace(s, prefill_tokens=g[0].prefill_tokens) for s in g] for g in out]


def test_check_policy_names_a_broken_property(model_dirs):
    with pytest.raises(PolicyCheckError, match="prefill attributed to several siblings"):
        check_policy(SiblingsEachReportThePrefill(make(model_dirs)))
