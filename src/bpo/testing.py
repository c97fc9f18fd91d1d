"""Small real objects for tests: a tiny random-init causal LM and random rollout trees.

Shared by the learner's tests and the data-parallel equivalence test (one definition, so that
both check the learner on the same kind of input)."""

from __future__ import annotations

import numpy as np
import torch

from bpo.tree import Tree, Turn

__all__ = ["random_tree", "tiny_causal_lm"]


def tiny_causal_lm(
    arch: str = "qwen2", attn: str = "sdpa", seed: int = 0, vocab: int = 64
) -> torch.nn.Module:
    """A 2-layer, 32-wide Qwen2 or Llama with random weights (``torch.manual_seed(seed)``)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kw))
    model.config._attn_implementation = attn
    return model.float()


def random_tree(
    rng: np.random.Generator,
    prefix: int = 12,
    k: int = 3,
    depth: int = 2,
    reset_at: int | None = None,
    vocab: int = 64,
) -> Tree:
    """A tree of ``depth`` levels: the first node of each level has ``k`` children (every node
    of a level before the last does), random token ids below ``vocab``, random rewards and
    log-probs; ``reset_at``: the level whose children start a new context."""
    t = Tree("t")
    t.add_root(rng.integers(1, vocab, prefix).tolist())
    frontier = [0]
    for level in range(depth):
        nxt = []
        for u in frontier:
            for _ in range(k if level < depth - 1 or u == frontier[0] else 1):
                n_act = int(rng.integers(1, 5))
                act = rng.integers(1, vocab, n_act).tolist()
                turn = Turn(
                    tuple(act),
                    tuple(float(-x) for x in rng.random(n_act)),
                    (0.5,) * n_act,
                    "a",
                    float(rng.random()),
                    terminated=level == depth - 1,
                )
                obs = [] if level == depth - 1 else rng.integers(1, vocab, 3).tolist()
                c = t.add_child(u, turn, obs, context_reset=(reset_at == level and bool(obs)))
                nxt.append(c)
        frontier = nxt
    return t
