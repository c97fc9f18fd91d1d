"""``policy.lora_rank``: bpo train fine-tunes peft LoRA adapters only. The base weights do not
move, every adapter does, checkpoints hold the adapters alone, and a run resumes from them."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bpo.config import ConfigError, load_config
from bpo.train import Trainer

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "run.iterations=2", "run.tasks_per_iteration=2", "sandbox.num_train_tasks=4",
    "sandbox.num_eval_tasks=2", "sft.epochs=1", "budget.amount=60", "run.max_steps=4",
    "policy.lora_rank=4", "learner.lr=0.01", "learner.entropy_coef=0.01",
]  # fmt: skip


def test_lora_trains_the_adapters_only(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs/toy.yaml", ARGS)
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.log = lambda _msg: None
    summary = trainer.run()
    assert summary["iterations"] == 2
    base = load_file(str(tmp_path / "run/init-model/model.safetensors"))
    model = trainer.bundle.model
    state = {k: v for k, v in model.state_dict().items()}
    lora = {k: v for k, v in state.items() if "lora_" in k}
    assert lora, "no adapter in the model"
    # peft names the base weights base_model.model.<name>.base_layer.weight (adapted layers)
    for name, w in base.items():
        key = "base_model.model." + name
        if key not in state:
            module, leaf = key.rsplit(".", 1)
            key = f"{module}.base_layer.{leaf}"
        assert torch.equal(state[key], w), f"{name} moved"
    for key, v in lora.items():
        if "lora_B" in key:  # B starts at zero: it must have learnt something
            assert v.abs().sum() > 0, key
    ckpt = load_file(str(tmp_path / "run/checkpoints/iter-000002/model.safetensors"))
    assert set(ckpt) == {k for k, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in k for k in ckpt)


def test_lora_targets_that_the_model_lacks_are_named() -> None:
    cfg = load_config(ROOT / "configs/toy.yaml", [*ARGS, "policy.lora_targets=[c_attn]"])
    with pytest.raises(ConfigError, match=r"policy.lora_targets=\['c_attn'\].*no module named"):
        Trainer(cfg, Path("/tmp/bpo-never-written"), write=False).setup()
