"""``bpo train`` end to end with the vLLM backend (``policy.backend=vllm``): the engine samples,
the learner trains the transformers copy, and the weights reach the engine after every update,
as full weights or as a LoRA adapter, or to a vLLM engine in a Ray actor. Runs where vLLM is installed (``make test-vllm``);
skipped with the reason elsewhere, failed with ``BPO_REQUIRE_VLLM=1``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("BPO_REQUIRE_VLLM") == "1":
        pytest.fail("BPO_REQUIRE_VLLM=1 but vllm is not installed (make setup-vllm)", pytrace=False)
    pytest.skip("vllm is not installed (make setup-vllm)", allow_module_level=True)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
ARGS = [
    "--config", "configs/toy.yaml", "policy.backend=vllm", "run.iterations=2",
    "run.tasks_per_iteration=2", "sandbox.num_train_tasks=4", "sandbox.num_eval_tasks=2",
    "sft.epochs=1", "budget.amount=80", "run.max_steps=4", "learner.lr=0.01",
    "learner.entropy_coef=0.01",
]  # fmt: skip


# the rollouts sampled by a vLLM engine in a Ray actor, one update ahead of the learner
RAY = ["cluster.address=local", "cluster.inference_engines=1", "run.max_staleness=1"]


@pytest.mark.parametrize(
    "extra", [[], ["policy.lora_rank=4"], RAY], ids=["full-weights", "lora", "ray-engine"]
)
def test_bpo_train_with_the_vllm_backend(tmp_path: Path, extra: list[str]) -> None:
    out = tmp_path / "run"
    # a Ray of its own goes without the per-user auth token (tests/integration/test_cluster.py)
    env = {**ENV, "RAY_AUTH_MODE": "disabled"} if extra == RAY else ENV
    done = subprocess.run(
        [sys.executable, "-m", "bpo.cli", "train", "--out", str(out), *ARGS, *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "held-out success: before" in done.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert all(r["learner/grad_norm"] > 0 for r in rows)
    assert all(r["compute/generated_tokens"] > 0 for r in rows)
    if extra == RAY:  # sampled in the engine actor, with the weights one update behind
        info = json.loads((out / "cluster.json").read_text())
        assert [e["pid"] for e in info["engines"]] != [info["trainer"]["pid"]]
        assert [r["async/staleness"] for r in rows] == [0, 1]
        assert all(r["time/weight_sync_s"] > 0 for r in rows)
    elif extra:  # the engine loaded the newest adapter; older ones were removed
        assert [p.name for p in (out / "lora-sync").iterdir()] == ["v4"]  # build, SFT, 2 updates
