"""Offline tokenizers for tiny test models: byte-level, or a BPE trained on a corpus.

Both are ``tokenizers``-library tokenizers wrapped as transformers fast tokenizers, with the
ChatML special tokens and chat template, so prompts are built exactly as with a real chat model
(Qwen2 / SmolLM2 use ChatML too). Nothing is downloaded.

* ``byte``: ByT5-like: one token per byte (GPT-2's byte-to-unicode alphabet, no merges), plus the
  special tokens; 259 tokens in all. Any text round-trips.
* ``bpe``: a byte-level BPE trained with ``tokenizers`` on the given texts (for example the
  environment's observations), sized by ``vocab_size``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END)
"""Ids 0, 1, 2 in every tiny tokenizer."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The ChatML template (as used by Qwen2 and SmolLM2), without a default system prompt."""

TOKENIZER_KINDS = ("byte", "bpe")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: 3 special tokens + 256 byte tokens, no merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    return _wrap(core)


def bpe_tokenizer(corpus: Iterable[str], vocab_size: int = 2000) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``corpus`` (deterministic for a given corpus and size)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it needs at least "
            f"{len(alphabet) + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    core.train_from_iterator(iter(corpus), trainer=trainer)
    return _wrap(core)


def make_tokenizer(
    kind: str, corpus: Iterable[str] | None = None, vocab_size: int = 2000
) -> PreTrainedTokenizerFast:
    """``kind`` is "byte" or "bpe"; a BPE without a corpus is trained on :func:`default_corpus`."""
    if kind == "byte":
        return byte_tokenizer()
    if kind == "bpe":
        return bpe_tokenizer(default_corpus() if corpus is None else corpus, vocab_size)
    raise ValueError(f"unknown tokenizer kind {kind!r}; valid kinds: {', '.join(TOKENIZER_KINDS)}")


def _wrap(core: Tokenizer) -> PreTrainedTokenizerFast:
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=EOS,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START, EOS],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


_ROOMS = ("kitchen", "cellar", "garden", "attic", "hallway", "bedroom", "pantry", "study")
_OBJECTS = ("key", "apple", "lamp", "book", "knife", "coin", "box", "chest", "door", "table")
_VERBS = ("take", "open", "close", "drop", "examine", "unlock", "eat", "put", "go")
_DIRECTIONS = ("north", "south", "east", "west", "up", "down")


def default_corpus() -> Iterator[str]:
    """A small, deterministic text-adventure corpus (about 2,000 lines) for training a BPE
    when no environment text is given."""
    for room, obj, verb, direction in itertools.product(_ROOMS, _OBJECTS, _VERBS[:5], _DIRECTIONS):
        yield (
            f"You are in the {room}. You see a {obj} here. Exits lead {direction}.\n"
            f"> {verb} {obj}\nYou {verb} the {obj}. Nothing happens.\n"
            f"Your task is to find the {obj} and go {direction}. Valid actions: {verb} {obj}, "
            f"go {direction}, look, inventory."
        )
