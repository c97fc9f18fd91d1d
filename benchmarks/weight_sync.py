"""Weight sync from the learner to the vLLM engine after an update: full weights
(``VLLMPolicy.update_weights``) against a LoRA adapter (peft ``save_pretrained`` +
``VLLMPolicy.update_lora``), as ``bpo train`` does them (bpo.agent.Agent.sync_policy).

    OMP_WAIT_POLICY=PASSIVE .venv-vllm/bin/python benchmarks/weight_sync.py [--smollm] [--repeats 5]

Runs in the vLLM venv (``make setup-vllm``). Prints one markdown row per (model, method): the
median and minimum seconds of ``--repeats`` syncs after one warm-up, and the bytes moved.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smollm", action="store_true", help="SmolLM2-135M (else a tiny Qwen2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rank", type=int, default=8)
    a = ap.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from bpo.policy.models import fetch_model, init_model
    from bpo.policy.vllm import VLLMPolicy

    work = Path(tempfile.mkdtemp(prefix="bpo-sync-"))
    if a.smollm:
        path, label = fetch_model("smollm2-135m"), "SmolLM2-135M"
    else:
        path = init_model(work / "tiny", hidden=128, layers=2, heads=2, seed=0)
        label = "tiny qwen2 (h128, 2 layers)"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules=targets, task_type="CAUSAL_LM"),
    )
    lora_bytes = sum(
        p.numel() * p.element_size() for n, p in peft_model.named_parameters() if "lora_" in n
    )
    print("| model | method | bytes | median s | min s |\n|---|---|---|---|---|")
    with VLLMPolicy(path, seed=0, enable_lora=True, max_lora_rank=max(8, a.rank)) as policy:
        for method in ("full weights", f"LoRA r={a.rank}"):
            times = []
            for i in range(a.repeats + 1):
                t0 = time.perf_counter()
                if method == "full weights":
                    policy.update_weights(model.state_dict())
                else:
                    out = work / f"adapter-{i}"
                    peft_model.save_pretrained(str(out))
                    policy.update_lora(out)
                if i:  # the first is a warm-up
                    times.append(time.perf_counter() - t0)
            size = full_bytes if method == "full weights" else lora_bytes
            print(f"| {label} | {method} | {size / 2**20:.1f} MiB | "
                  f"{statistics.median(times):.3f} | {min(times):.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
