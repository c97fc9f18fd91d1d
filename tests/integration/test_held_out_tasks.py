"""Held-out tasks never overlap the training tasks: with ``sandbox.eval_split`` equal to
``sandbox.train_split`` they are the tasks listed after the training ones."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path

import pytest

from bpo.config import ConfigError, load_config
from bpo.sandbox import list_tasks
from bpo.train import Trainer

ROOT = Path(__file__).resolve().parents[2]


def _setup(tmp_path: Path, *overrides: str) -> Trainer:
    cfg = load_config(ROOT / "configs/toy.yaml", ["sft.episodes_per_task=0", *overrides])
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.setup()
    trainer.engine.close()
    trainer.metrics.close()
    return trainer


def test_eval_tasks_from_the_training_split_follow_the_training_tasks(tmp_path: Path) -> None:
    listed = list(list_tasks("toy", "train"))
    tr = _setup(tmp_path, "sandbox.eval_split=train", "sandbox.num_train_tasks=5",
                "sandbox.num_eval_tasks=3")  # fmt: skip
    assert tr.train_tasks == listed[:5]
    assert tr.eval_tasks == listed[5:8]
    other = _setup(tmp_path / "b", "sandbox.num_train_tasks=5", "sandbox.num_eval_tasks=3")
    assert other.eval_tasks == list(list_tasks("toy", "test"))[:3]  # another split: its first


def test_a_training_split_used_up_by_training_tasks_is_a_config_error(tmp_path: Path) -> None:
    n = len(list(list_tasks("toy", "train")))
    with pytest.raises(ConfigError, match=f"after the {n} training tasks"):
        _setup(tmp_path, "sandbox.eval_split=train", f"sandbox.num_train_tasks={n}")
