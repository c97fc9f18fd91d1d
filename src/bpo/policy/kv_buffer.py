"""A preallocated KV buffer that transformers models write into, driven by the policy.

``HFPolicy`` lays out a batch's KV itself (which columns hold which row's tokens) and builds
the attention masks and position ids to match. The model only needs to write the new keys and
values to the columns the policy chose and to attend over the buffer's first ``width`` columns;
:class:`BufferLayer` does exactly that, behind transformers' ``Cache`` interface. Nothing is
concatenated per step (``DynamicCache`` re-copies the whole cache at every token).

Buffer layout: one tensor ``[L, 2, B, H_kv, C, D]`` (layers, key/value, rows, kv heads,
columns, head dim). Column 0 is a scratch column that padding tokens write to and nothing real
attends to.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class WritePlan:
    """Where the next forward pass writes its keys/values, and how many columns it attends to."""

    def __init__(self) -> None:
        self.index: torch.Tensor | None = None
        """``[B, 1, S, 1]`` int64 target columns for the S new tokens of each row (scatter), or
        None to write the S new tokens of every row at columns ``[col, col + S)``."""
        self.col = 0
        self.width = 0
        """Columns attended to (the returned keys/values are ``buffer[..., :width, :]``)."""


class BufferLayer(DynamicLayer):
    """One layer's view of the KV buffer (a ``transformers`` cache layer)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, plan: WritePlan) -> None:
        super().__init__()
        self.buf_k, self.buf_v = keys, values  # [B, H, C, D] views
        self.plan = plan
        self.dtype, self.device = keys.dtype, keys.device
        self.keys, self.values = keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.plan
        if plan.index is None:
            s = key_states.shape[2]
            self.buf_k[:, :, plan.col : plan.col + s] = key_states
            self.buf_v[:, :, plan.col : plan.col + s] = value_states
        else:
            idx = plan.index.expand_as(key_states)  # [B, H, S, D]
            self.buf_k.scatter_(2, idx, key_states)
            self.buf_v.scatter_(2, idx, value_states)
        return self.buf_k[:, :, : plan.width], self.buf_v[:, :, : plan.width]

    def get_seq_length(self) -> int:
        return self.plan.width

    def get_max_length(self) -> int:
        return self.buf_k.shape[2]


def buffer_cache(kv: torch.Tensor, plan: WritePlan) -> Cache:
    """A transformers ``Cache`` over ``kv`` ``[L, 2, B, H, C, D]`` (or a row slice of it)."""
    return Cache(layers=[BufferLayer(kv[i, 0], kv[i, 1], plan) for i in range(kv.shape[0])])


def attention_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask ``[B, 1, Q, K]`` from a boolean ``[B, Q, K]``: 0 where allowed, the
    dtype's minimum elsewhere (a boolean 4D mask is silently wrong under eager attention, and
    -inf would turn fully masked padding rows into NaN)."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)
