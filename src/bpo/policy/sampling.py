"""Token sampling from logits: temperature, top-k, top-p, per-row random streams.

Pure functions on tensors. The log-prob and entropy reported for a sampled token are those of
``pi_T = softmax(logits / T)`` before truncation (see :mod:`bpo.policy.protocol`).

Sampling is by inverse CDF with one uniform number per row, so a row's draw depends only on its
own logits and its own uniform: with per-row seeded generators the samples do not depend on
which other rows share the batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from bpo.policy.protocol import SamplingParams


class StepDraw(NamedTuple):
    """One decoding step for a batch of rows."""

    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32: log pi_T(token)
    entropies: torch.Tensor  # [B] float32: entropy of pi_T


def tempered_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` in float32; T = 0 (greedy) is scored at T = 1."""
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / t, dim=-1)


def truncate(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set log-probs outside the top-k / top-p set to -inf (the most likely token always stays)."""
    if top_k > 0 and top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k, dim=-1).values[..., -1:]  # [B, 1]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = torch.sort(logp, dim=-1, descending=True)  # [B, V]
        probs = sorted_lp.exp()
        mass_before = probs.cumsum(-1) - probs  # [B, V]: mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = logp.masked_fill(drop, float("-inf"))
    return logp


def draw(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> StepDraw:
    """Sample one token per row of ``logits`` ``[B, V]`` with uniforms ``[B]`` in [0, 1)."""
    logp = tempered_log_probs(logits, params.temperature)  # [B, V]
    entropy = -(logp.exp() * logp).nan_to_num().sum(-1)  # [B]
    if params.temperature == 0:
        tokens = logp.argmax(-1)
    else:
        probs = truncate(logp, params.top_k, params.top_p).exp()  # [B, V]
        cdf = probs.cumsum(-1)  # [B, V]
        target = (uniforms.to(cdf) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
        tokens = tokens.clamp_(max=logits.shape[-1] - 1)
    chosen = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B]
    return StepDraw(tokens, chosen, entropy)


def row_seed(seed: int, context: Sequence[int], index: int) -> int:
    """A 63-bit seed that depends on (seed, context ids, sample index) only."""
    h = hashlib.blake2b(digest_size=8)
    h.update(np.asarray([seed, index], dtype=np.int64).tobytes())
    h.update(np.asarray(context, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


class Uniforms:
    """Per-step uniform numbers for the active rows: from one shared generator, or (seeded
    sampling) from one generator per row so that a row's draws ignore the batch."""

    def __init__(self, shared: torch.Generator, row_seeds: Sequence[int] | None) -> None:
        self._shared = shared
        self._rows = None
        if row_seeds is not None:
            self._rows = [torch.Generator().manual_seed(s) for s in row_seeds]

    def next(self, rows: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Uniforms ``[len(rows)]`` for the given (original) row indices."""
        idx = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        if self._rows is None:
            return torch.rand(len(idx), generator=self._shared)
        return torch.cat([torch.rand(1, generator=self._rows[i]) for i in idx])


@torch.no_grad()
def teacher_forced_logprobs(
    model: torch.nn.Module,
    context: Sequence[int],
    action: Sequence[int],
    temperature: float = 1.0,
) -> torch.Tensor:
    """Reference: ``log pi_T(action_t | context, action_<t)`` by one full forward pass ``[T]``
    (what a learner recomputes; used to check sampled log-probs)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(context) + list(action)], device=device)
    logits = model(input_ids=ids).logits[0, len(context) - 1 : -1]  # [T, V]
    logp = tempered_log_probs(logits, temperature)
    return logp.gather(-1, torch.tensor(action, device=device).unsqueeze(-1)).squeeze(-1)
