"""``HFPolicy``: batched sampling from any local transformers causal LM, with automatic prefix
caching across turns and siblings.

How a ``sample`` call runs (phases marked in the code):

1. **Dedupe and share.** Identical contexts become one request. Distinct contexts of the call
   that share an uncached prefix (the system prompt of a fresh batch of tasks, say) get that
   prefix computed once first, by a recursive prefill-only pass.
2. **Match.** Each request looks up its longest cached prefix in the radix tree
   (:mod:`bpo.policy.prefix_cache`). A fully cached context that has its next-token logits
   stored needs no forward pass at all; otherwise only the uncached suffix is computed.
3. **Prefill.** Requests are batched in one KV buffer, each row's context right-aligned so that
   all contexts end at the same column W: the cached prefix KV is copied in, the uncached
   suffixes are run as a batch (rows sorted by suffix length and split into chunks that keep
   padding small), writing their keys/values straight into their columns. Attention masks
   (additive float, 4D) and position ids are built per row, so rows with different cached
   lengths and different context lengths are exact. Each context (with its next-token logits)
   is inserted into the prefix cache.
4. **Expand.** Each request's row is repeated to its ``n`` samples (one memory copy per sample;
   the context is computed once).
5. **Decode.** All samples decode in lockstep, one column per step. A finished sample's KV
   (context + all action tokens but the last, which was never fed) is inserted into the prefix
   cache; finished rows are dropped from the batch once a quarter of it has finished.

Prefix reuse is exact: the KV of a token depends only on the tokens before it and its absolute
position, which the policy gives explicitly. The cache belongs to the current weights: it is
dropped automatically when any parameter is modified in place (an optimizer step,
``load_state_dict``), detected through the tensors' version counters.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import numpy as np
import torch

from bpo.policy.batching import BatchRunner, Request, SampleRow
from bpo.policy.prefix_cache import PrefixCache, common_prefix_length
from bpo.policy.protocol import PolicyStats, SamplingParams, TurnSample, check_requests

DEFAULT_PARAMS = SamplingParams(max_new_tokens=64)
_COUNTERS = ("calls", "requests", "samples", "generated", "hit_tokens", "hits")
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
"""Chat end-of-turn tokens added to the default stop tokens when the vocabulary has them."""


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    valid = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in valid:
        raise ValueError(f"unknown dtype {dtype!r}; valid dtypes: {', '.join(valid)}")
    return valid[dtype]


class HFPolicy:
    """A :class:`bpo.policy.protocol.Policy` over a transformers causal LM.

    ``model`` is a local model directory (Qwen2, Llama, SmolLM, ...) or an already loaded
    ``PreTrainedModel`` (then ``tokenizer`` is required; the learner may train that same module).
    It samples on the model's device (``device`` only places a model loaded from a directory);
    the prefix cache keeps its KV and logits there. The sampling generator stays on the CPU, so
    that a seed draws the same uniforms on any device.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | torch.nn.Module,
        tokenizer: object | None = None,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        attn_implementation: str = "sdpa",
        cache_budget_tokens: int = 32768,
        max_batch_tokens: int = 4096,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(model, (str, os.PathLike)):
            path = os.fspath(model)
            if not os.path.isdir(path):
                raise FileNotFoundError(
                    f"no model directory at {path!r}; make one with 'bpo init-model DIR' or "
                    "'bpo fetch-model smollm2-135m'"
                )
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=_dtype(dtype), attn_implementation=attn_implementation
            ).to(device)
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
        elif tokenizer is None:
            raise ValueError("HFPolicy(model_object) needs tokenizer=...")
        config = model.config
        layer_types = getattr(config, "layer_types", None) or ()
        if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
            raise NotImplementedError(
                "sliding-window attention is not supported by HFPolicy's prefix cache; "
                "disable it in the config (use_sliding_window=False)"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_positions = int(getattr(config, "max_position_embeddings", 1 << 30))
        self._stop = tuple(stop_token_ids) if stop_token_ids is not None else self._default_stops()
        pad = self._stop[0] if self._stop else 0  # any valid id: padding is masked
        self._runner = BatchRunner(model, pad_id=pad, max_batch_tokens=max_batch_tokens)
        self._cache = PrefixCache(cache_budget_tokens)
        self._gen = torch.Generator()
        self._gen.manual_seed(seed if seed is not None else int(torch.randint(1 << 62, ()).item()))
        self._version = self._weights_version()
        self._counts = dict.fromkeys(_COUNTERS, 0)

    # ------------------------------------------------------------------ public API

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop

    def sample(
        self,
        contexts: Sequence[Sequence[int]],
        n: int | Sequence[int] = 1,
        params: SamplingParams | None = None,
    ) -> list[list[TurnSample]]:
        """``n`` (or ``n[i]``) samples for each context; ``result[i][j]`` is sample j of
        context i. ``n = 0`` only computes and caches the context."""
        params = params or DEFAULT_PARAMS
        ctxs, ns = check_requests(
            contexts, n, params,
            vocab_size=self.model.config.vocab_size, max_positions=self.max_positions,
        )  # fmt: skip
        if self._weights_version() != self._version:
            self.clear_cache()
        self._counts["calls"] += 1
        self._counts["requests"] += len(ctxs)
        # 1. dedupe identical contexts (their samples are drawn together, indices continue)
        index: dict[tuple[int, ...], int] = {}
        for c in ctxs:
            index.setdefault(c, len(index))
        uniq = list(index)
        totals = [0] * len(uniq)
        for c, k in zip(ctxs, ns, strict=True):
            totals[index[c]] += k
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                rows, prefill = self._run(uniq, totals, params)
        finally:
            self.model.train(training)
        out: list[list[TurnSample]] = []
        taken = [0] * len(uniq)
        for c, k in zip(ctxs, ns, strict=True):
            u = index[c]
            mine = rows[u][taken[u] : taken[u] + k]
            # the context was computed once: report it on its first returned sample
            out.append([self._record(r, prefill[u] if r.index == 0 else 0) for r in mine])
            taken[u] += k
        return out

    def release(self, contexts: Sequence[Sequence[int]]) -> None:
        """Drop the cached KV of these contexts and of everything cached after them."""
        for c in contexts:
            self._cache.release(c)

    def clear_cache(self) -> None:
        """Drop the whole prefix cache."""
        self._cache.clear()
        self._version = self._weights_version()

    def stats(self) -> PolicyStats:
        c = self._counts
        return PolicyStats(
            calls=c["calls"],
            requests=c["requests"],
            samples=c["samples"],
            generated_tokens=c["generated"],
            prefill_tokens=self._runner.prefill_tokens,
            decode_tokens=self._runner.decode_tokens,
            padded_tokens=self._runner.padded_tokens,
            cache_hit_tokens=c["hit_tokens"],
            cache_hits=c["hits"],
            cached_tokens=self._cache.size,
            evicted_tokens=self._cache.evicted,
        )

    # ------------------------------------------------------------------ one pass

    def _run(
        self, ctxs: list[tuple[int, ...]], ns: list[int], params: SamplingParams
    ) -> tuple[list[list[SampleRow]], list[int]]:
        """Sample ``ns[i]`` rows for each distinct context; returns rows and prefill counts."""
        # 1. shared uncached prefixes first
        shared = self._share_prefixes(ctxs)
        # 2. match
        reqs = [self._match(c, k) for c, k in zip(ctxs, ns, strict=True)]
        for i, extra in shared.items():
            reqs[i].prefill += extra
        # 3. prefill, and cache each context with its next-token logits
        pre = self._runner.prefill(reqs)
        for k, r in enumerate(pre.order):
            req = reqs[r]
            if req.logits is None:  # (else it was fully cached already)
                span = pre.kv[:, :, k, :, pre.width - len(req.ctx) : pre.width]
                self._cache.insert(req.ctx, span, {len(req.ctx): pre.first[r]})
        rows = [[SampleRow(r, j) for j in range(req.n)] for r, req in enumerate(reqs)]
        # 4-5. expand to the samples and decode; cache every finished sample
        if sum(ns):
            stops = self._stop if params.stop_token_ids is None else params.stop_token_ids
            self._runner.decode(
                reqs, rows, pre, params, stops, self._gen,
                lambda _row, seq, kv: self._cache.insert(seq, kv),
            )  # fmt: skip
        return rows, [req.prefill for req in reqs]

    def _share_prefixes(self, ctxs: list[tuple[int, ...]]) -> dict[int, int]:
        """Compute, once, the uncached prefixes that several contexts share; returns the
        prefill tokens spent, attributed to the first context (in call order) that needed each."""
        if len(ctxs) < 2:
            return {}
        arrays = [np.asarray(c, dtype=np.int64) for c in ctxs]
        order = sorted(range(len(ctxs)), key=lambda i: ctxs[i])
        share = [0] * len(ctxs)
        # the longest prefix a context shares with any other is with a sorted neighbour
        for a, b in itertools.pairwise(order):
            m = common_prefix_length(arrays[a], arrays[b])
            share[a], share[b] = max(share[a], m), max(share[b], m)
        wanted: dict[tuple[int, ...], int] = {}
        for i, c in enumerate(ctxs):
            s = share[i]
            if s >= 2 and s > self._cache.match(c[:s], with_kv=False).length + 1:
                wanted.setdefault(c[:s], i)
        if not wanted:
            return {}
        _, spent = self._run(list(wanted), [0] * len(wanted), DEFAULT_PARAMS)
        out: dict[int, int] = {}
        for (_, i), tokens in zip(wanted.items(), spent, strict=True):
            out[i] = out.get(i, 0) + tokens
        return out

    def _match(self, ctx: tuple[int, ...], n: int) -> Request:
        m = self._cache.match(ctx)
        kv, cached, logits = m.kv, m.length, m.logits
        if cached == len(ctx) and logits is None:  # need the last position's logits: recompute it
            cached -= 1
            kv = kv[:, :, :, :cached] if cached else None
        if cached:
            self._counts["hits"] += 1
            self._counts["hit_tokens"] += cached
        return Request(ctx, n, cached, kv, logits)

    # ------------------------------------------------------------------ helpers

    def _record(self, row: SampleRow, prefill: int) -> TurnSample:
        self._counts["samples"] += 1
        self._counts["generated"] += len(row.tokens)
        return TurnSample(
            action_ids=tuple(row.tokens),
            logprobs=tuple(row.logprobs),
            entropies=tuple(row.entropies),
            text=self.tokenizer.decode(row.tokens, skip_special_tokens=True),
            finish_reason=row.finish,  # type: ignore[arg-type]
            prefill_tokens=prefill,
        )

    def _default_stops(self) -> tuple[int, ...]:
        ids: list[int] = []
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for e in [eos, getattr(self.tokenizer, "eos_token_id", None)]:
            ids += [e] if isinstance(e, int) else list(e or [])
        vocab = self.tokenizer.get_vocab()
        ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
        out = tuple(dict.fromkeys(int(i) for i in ids))
        if not out:
            raise ValueError("the model has no eos token; pass stop_token_ids=...")
        return out

    def _weights_version(self) -> int:
        return sum(p._version for p in self.model.parameters())
