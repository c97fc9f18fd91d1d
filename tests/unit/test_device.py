"""``policy.device``: its values resolve or fail naming the key; the model goes where it says;
and every tensor the learner, the packing, the transformers policy and the warm start make is
made on a device they name (the model's), never on torch's default device.

No GPU is needed: the last check records, for each tensor constructor called from those modules,
whether it was given a device. On a GPU a constructor without one makes a CPU tensor that then
meets CUDA ones (the failure this guards against); on the CPU it would pass unnoticed.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import bpo
from bpo import agent
from bpo.agent import Agent, Demo, resolve_device
from bpo.checkpoint import _to_cpu, load_checkpoint, save_checkpoint
from bpo.config import ConfigError, load_config
from bpo.learner import Learner, LearnerConfig, model_device
from bpo.policy.hf import HFPolicy
from bpo.policy.models import init_model
from bpo.policy.prompts import PromptBuilder
from bpo.policy.protocol import SamplingParams
from bpo.preflight import preflight
from bpo.tree import Tree, Turn

CHECKED = ("agent.py", "learner.py", "logprobs.py", "token_terms.py", "data_parallel.py",
           "packing.py", "losses.py",
           "policy/hf.py", "policy/batching.py", "policy/prefix_cache.py")  # fmt: skip
ROOT = Path(bpo.__file__).resolve().parent
CONSTRUCTORS = {
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty,
    torch.arange, torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye,
    torch.scalar_tensor,
}  # fmt: skip
GPU = torch.cuda.is_available()


class DeviceBookkeeping(TorchFunctionMode):
    """Records every tensor constructor called directly from the ``CHECKED`` modules, and those
    of them that name no device (so would make a tensor on torch's default device)."""

    def __init__(self) -> None:
        super().__init__()
        self.files = {str(ROOT / m) for m in CHECKED}
        self.seen: Counter[str] = Counter()
        self.implicit: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in CONSTRUCTORS:
            caller = sys._getframe(1)
            path = caller.f_code.co_filename
            if path in self.files:
                where = f"{Path(path).relative_to(ROOT)}:{caller.f_lineno} torch.{func.__name__}"
                self.seen[str(Path(path).relative_to(ROOT))] += 1
                if kwargs.get("device") is None:
                    self.implicit.append(where)
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "m", hidden=64, layers=2, heads=4)


def _trees(rng: np.random.Generator, vocab: int, n: int = 2) -> list[Tree]:
    """Small trees: a prompt, a first turn forked twice, the first fork's turn forked twice."""
    out = []
    for i in range(n):
        t = Tree(f"t{i}")
        t.add_root(rng.integers(1, vocab, 10).tolist())
        for parent in (0, 0, 1, 1):
            last = parent == 1
            act = rng.integers(1, vocab, 3).tolist()
            turn = Turn(tuple(act), tuple(float(-x) for x in rng.random(3)), (0.5,) * 3, "a",
                        float(rng.random()), terminated=last)  # fmt: skip
            t.add_child(parent, turn, [] if last else rng.integers(1, vocab, 4).tolist())
        out.append(t)
    return out


# -- policy.device -----------------------------------------------------------------------------


def test_auto_and_cpu_resolve_here():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if GPU else "cpu")


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "cpu:1", "CUDA", "mps", "", "cuda:-1"])
def test_unknown_devices_fail_naming_the_key_and_the_choices(name):
    with pytest.raises(ConfigError, match=r"policy\.device=.*valid: auto, cpu, cuda, cuda:N"):
        resolve_device(name)


@pytest.mark.skipif(GPU, reason="checks the message for a machine without a GPU")
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_fails_in_preflight_with_the_fix(name):
    cfg = load_config(None, [f"policy.device={name}"])
    with pytest.raises(ConfigError, match=r"policy\.device='cuda.*no CUDA GPU.*policy\.device=cpu"):
        preflight(cfg)
    preflight(load_config(None, ["policy.device=cpu"]))  # the fix passes


def test_a_gpu_index_beyond_the_visible_ones_fails(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    assert resolve_device("auto") == torch.device("cuda")
    with pytest.raises(ConfigError, match=r"policy\.device='cuda:2'.*2 GPU\(s\).*cuda:1"):
        resolve_device("cuda:2")


def test_build_puts_the_model_and_its_policy_on_the_device(model_dir, tmp_path):
    cfg = load_config(None, [f"policy.model={model_dir}", "policy.device=cpu",
                             "sft.episodes_per_task=0"])  # fmt: skip
    a = agent.build(cfg, tmp_path, env_factory=None, train_tasks=[], need_demos=False)  # type: ignore[arg-type]
    assert model_device(a.model) == torch.device("cpu")
    assert a.policy.device == torch.device("cpu")


# -- every tensor on the model's device ----------------------------------------------------------


def test_learner_policy_and_warm_start_name_the_device_of_every_tensor(model_dir):
    """Learner updates (forest and paths layouts, KL reference, PPO's value head, the gradient
    probe), sampling with prefix-cache hits and forks, and the warm start: every constructor
    called from the checked modules names its device, and what reaches the model lives there."""
    rng = np.random.default_rng(0)
    policy = HFPolicy(model_dir, seed=0)
    model = policy.model
    vocab = model.config.vocab_size
    ref = HFPolicy(model_dir).model.requires_grad_(False)
    dev = model_device(model)
    book = DeviceBookkeeping()
    with book:
        # 1. sampling: a batch, then forks of a fully cached context (cache hits)
        ctx = [rng.integers(1, vocab, 12).tolist(), rng.integers(1, vocab, 7).tolist()]
        params = SamplingParams(max_new_tokens=4, temperature=1.0)
        first = policy.sample(ctx, n=2, params=params)
        again = policy.sample(ctx[:1], n=3, params=params)
        assert len(first) == 2 and len(again[0]) == 3
        assert policy.stats().cache_hit_tokens > 0
        # 2. the learner, both layouts, with a KL reference
        trees = _trees(rng, vocab, 2)
        for layout in ("forest", "paths"):
            learner = Learner(model, LearnerConfig(lr=1e-3, kl_coef=0.1, layout=layout,
                                                   minibatches=2), ref_model=ref)  # fmt: skip
            m = learner.update(trees, "bpo")
            assert all(isinstance(v, float) for v in m.values())
            assert np.isfinite(m["loss/total"]) and m["time/learner_tokens_per_s"] > 0
            batches, _ = learner._prepare(trees, "bpo", {}, 1)
            for packed, tt in batches:
                assert packed is not None
                for x in (packed.input_ids, packed.position_ids, packed.attention_mask):
                    assert x is None or x.device == dev
                assert (packed.attention_mask is None) == (layout == "paths")
                assert {t.device for t in tt.values()} == {dev}
        assert learner.gradient(trees).device == dev
        # 3. PPO's value head
        critic = Learner(model, LearnerConfig(lr=1e-3), critic=True)
        assert model.value_head.weight.device == dev
        assert np.isfinite(critic.update(trees, "ppo")["loss/value"])
        del model.value_head
        # 4. the warm start on an expert demo
        tok = policy.tokenizer
        bundle = Agent(model, tok, policy, PromptBuilder(tok), 8, False, policy.stop_token_ids[0])
        bundle.demos = [Demo("t", "Find the coin.", ("A room.", "Another room.", "Done."),
                             (None, None, None), ("go east", "take coin"), (0.0, 1.0), True)]  # fmt: skip
        sft = bundle.warm_start(load_config(None, ["sft.epochs=1"]).sft)
        assert np.isfinite(sft["sft/final_nll"])
    implicit = sorted(set(book.implicit))
    assert implicit == [], f"tensor constructors without a device: {implicit}"
    for module in (
        "learner.py",
        "logprobs.py",
        "token_terms.py",
        "packing.py",
        "policy/batching.py",
    ):
        assert book.seen[module] > 0, f"no constructor seen from {module}: the check is blind"


def test_checkpoints_hold_cpu_tensors_and_cpu_state_is_saved_as_given(tmp_path):
    state = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": {"c": torch.arange(3)}}
    assert _to_cpu(state) is state  # nothing to move: the very object (the same bytes) is saved
    path = save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, {"state": {}}, state)
    loaded = load_checkpoint(path)
    assert loaded.weights["w"].device == torch.device("cpu")
    assert torch.equal(loaded.state["b"]["c"], torch.arange(3))
