"""``scripts/gpu_check.sh`` end to end on the CPU: the machine lines, the run, the numbers it
prints and writes, and the check that its checkpoints hold CPU tensors.

With SmolLM2 the CPU smoke run (``DEVICE=cpu ITERATIONS=1``) takes about two minutes on two
cores, so the test gives ``MODEL=tiny`` (the same path, a random-init model of 0.5 M parameters:
about 15 s); the GPU run itself needs a GPU and is run by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bpo.config import ConfigError, load_config
from bpo.preflight import preflight

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
CONFIG = ROOT / "configs" / "gpu" / "check.yaml"


@pytest.mark.slow
def test_gpu_check_script_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "DEVICE": "cpu", "ITERATIONS": "1", "MODEL": "tiny",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    res = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    text = res.stdout + res.stderr
    assert res.returncode == 0, text
    for line in ("== machine", "nvidia-smi", "torch ", "device cpu, dtype float32, model tiny",
                 "rollout tokens/s:", "learner tokens/s:", "peak GPU memory:    n/a",
                 "checkpoint tensors: cpu (ok"):  # fmt: skip
        assert line in text, f"{line!r} missing from:\n{text}"
    numbers = json.loads((out / "gpu_check.json").read_text())
    assert numbers["iterations"] == 1
    assert numbers["rollout_tokens_per_s"] > 0 and numbers["learner_tokens_per_s"] > 0
    assert numbers["peak_gpu_memory_gb"] is None
    assert numbers["checkpoint_devices"] == ["cpu"]
    assert (out / "gpu_check.log").read_text().strip().endswith(f"run directory: {out / 'run'}")
    rerun = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    assert rerun.returncode == 2 and "exists; remove it" in rerun.stderr  # never overwritten


def test_gpu_check_config_loads_and_names_its_device() -> None:
    cfg = load_config(CONFIG)
    assert (cfg.policy.device, cfg.policy.backend, cfg.policy.model) == (
        "cuda", "hf", "smollm2-135m",
    )  # fmt: skip
    for device in ("cpu", "auto"):
        preflight(load_config(CONFIG, [f"policy.device={device}"]))
    with pytest.raises(ConfigError, match=r"policy\.device='tpu' is not valid"):
        preflight(load_config(CONFIG, ["policy.device=tpu"]))
