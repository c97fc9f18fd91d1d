"""Batched prefill and lockstep decoding over one KV buffer (the engine behind ``HFPolicy``).

Layout of a batch (see :mod:`bpo.policy.kv_buffer`): every request's context is right-aligned
so that all contexts end at the same column W; column 0 is scratch. A request's cached prefix KV
is copied into its first columns, its uncached suffix is computed in place. Decoding appends
column W + t at step t for every row. Because each row gets its own attention mask (its own
columns, causal) and its own position ids (0 .. len - 1, whatever its column), rows with
different context lengths and different cached lengths are computed exactly as alone.

Device: the buffer, masks, ids and logits live on the model's device; each batch's ids and
positions are planned on the host and copied once. The only host tensors are the sampling
uniforms, drawn from CPU generators so that a seed gives the same draws on any device.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from bpo.policy.kv_buffer import WritePlan, attention_bias, buffer_cache
from bpo.policy.protocol import SamplingParams
from bpo.policy.sampling import Uniforms, draw, row_seed


@dataclass
class Request:
    """One distinct context of a ``sample`` call."""

    ctx: tuple[int, ...]
    n: int
    cached: int
    """Context tokens whose KV comes from the prefix cache."""
    kv: torch.Tensor | None
    """``[L, 2, H, cached, D]`` cached prefix KV (dropped once copied into the batch)."""
    logits: torch.Tensor | None
    """``[V]`` next-token logits when the whole context was cached (no forward needed)."""
    prefill: int = 0
    """Context tokens computed for this request (including shared-prefix passes)."""

    @property
    def suffix(self) -> int:
        return len(self.ctx) - self.cached


@dataclass
class SampleRow:
    """One sample being decoded."""

    request: int
    index: int
    """Sample index within its request."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    finish: str = ""


class Prefilled(NamedTuple):
    kv: torch.Tensor  # [L, 2, R, H, W, D]
    order: list[int]  # buffer row k holds request order[k]
    width: int  # W: every context ends at column W (exclusive)
    first: list[torch.Tensor]  # per request: [V] next-token logits after its context


OnFinish = Callable[[SampleRow, tuple[int, ...], torch.Tensor], None]
"""Called when a sample ends with (row, the ids whose KV exists, their KV ``[L, 2, H, n, D]``)."""


class BatchRunner:
    """Runs prefill and decode passes of a transformers causal LM over a KV buffer."""

    def __init__(self, model: torch.nn.Module, pad_id: int, max_batch_tokens: int) -> None:
        self.model = model
        # transformers renamed ``past_key_values`` to ``cache`` (5.2x warns; 5.40 drops the
        # old name); older versions know only the old one
        self.cache_kw = cache_keyword(model)
        self.pad_id = pad_id
        self.max_batch_tokens = max_batch_tokens
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = model.config
        heads = cfg.num_attention_heads
        self._shape = (
            cfg.num_hidden_layers,
            getattr(cfg, "num_key_value_heads", None) or heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        )
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.padded_tokens = 0

    # ------------------------------------------------------------------ prefill

    def prefill(self, reqs: list[Request]) -> Prefilled:
        """Copy cached prefixes into a new batch buffer and compute the uncached suffixes in
        chunks of similar length (requests needing prefill first, longest suffix first)."""
        layers, n_kv, head_dim = self._shape
        width = 1 + max(len(r.ctx) for r in reqs)
        order = sorted(range(len(reqs)), key=lambda r: -reqs[r].suffix)
        kv = torch.zeros(
            (layers, 2, len(reqs), n_kv, width, head_dim), dtype=self.dtype, device=self.device
        )
        first: list[torch.Tensor] = [torch.empty(0, device=self.device)] * len(reqs)
        for k, r in enumerate(order):
            req = reqs[r]
            if req.cached:
                start = width - len(req.ctx)
                kv[:, :, k, :, start : start + req.cached] = req.kv
            req.kv = None
            if req.logits is not None:
                first[r] = req.logits
        k0, busy = 0, sum(1 for r in reqs if r.suffix)
        while k0 < busy:
            k1 = self._chunk_end(reqs, order, k0, busy)
            logits = self._prefill_chunk(reqs, order[k0:k1], kv[:, :, k0:k1], width)
            for i, r in enumerate(order[k0:k1]):
                first[r] = logits[i]
                reqs[r].prefill += reqs[r].suffix
                self.prefill_tokens += reqs[r].suffix
            k0 = k1
        return Prefilled(kv, order, width, first)

    def _chunk_end(self, reqs: list[Request], order: list[int], k0: int, busy: int) -> int:
        """A chunk stops before its padding would exceed a quarter of its real tokens, or its
        size ``max_batch_tokens`` (rows are sorted by suffix length, longest first)."""
        longest, real, k1 = reqs[order[k0]].suffix, 0, k0
        while k1 < busy:
            s = reqs[order[k1]].suffix
            padded = (k1 - k0 + 1) * longest
            if k1 > k0 and (padded > self.max_batch_tokens or padded > 1.25 * (real + s)):
                break
            real, k1 = real + s, k1 + 1
        return k1

    def _prefill_chunk(
        self, reqs: list[Request], rows: list[int], kv: torch.Tensor, width: int
    ) -> torch.Tensor:
        """Run the suffixes of ``rows`` (buffer slice ``kv``) as one left-padded batch whose
        keys/values are scattered to each row's columns; returns last-position logits [R, V]."""
        dev, span = self.device, reqs[rows[0]].suffix
        ids_h = np.full((len(rows), span), self.pad_id, dtype=np.int64)  # host plan, copied once
        pos_h = np.zeros((len(rows), span), dtype=np.int64)
        real_h = np.zeros((len(rows), span), dtype=bool)
        start_h = np.empty(len(rows), dtype=np.int64)
        for i, r in enumerate(rows):
            req = reqs[r]
            s = req.suffix
            ids_h[i, span - s :] = req.ctx[req.cached :]
            pos_h[i, span - s :] = np.arange(req.cached, len(req.ctx))
            real_h[i, span - s :] = True
            start_h[i] = width - len(req.ctx)
        ids = torch.as_tensor(ids_h, device=dev)  # [R, S]
        pos = torch.as_tensor(pos_h, device=dev)  # [R, S]
        real = torch.as_tensor(real_h, device=dev)  # [R, S]
        start = torch.as_tensor(start_h, device=dev)  # [R]
        cols = torch.arange(width - span, width, device=dev).expand(len(rows), span)  # [R, S]
        keys = torch.arange(width, device=dev)  # [W]
        # own context, causal; padding queries attend to the scratch column only
        allowed = (keys >= start[:, None, None]) & (keys <= cols[:, :, None]) & real[:, :, None]
        allowed |= ~real[:, :, None] & (keys == 0)  # [R, S, W]
        plan = WritePlan()
        plan.index = torch.where(real, cols, 0)[:, None, :, None]  # [R, 1, S, 1]
        plan.width = width
        out = self.model(
            input_ids=ids,
            attention_mask=attention_bias(allowed, self.dtype),  # [R, 1, S, W]
            position_ids=pos,
            **{self.cache_kw: buffer_cache(kv, plan)},
            use_cache=True,
            logits_to_keep=1,
        )
        self.padded_tokens += int((~real).sum())
        return out.logits[:, -1].float()  # [R, V]

    # ------------------------------------------------------------------ decode

    def decode(
        self,
        reqs: list[Request],
        rows: list[list[SampleRow]],
        pre: Prefilled,
        params: SamplingParams,
        stops: tuple[int, ...],
        generator: torch.Generator,
        on_finish: OnFinish,
    ) -> None:
        """Expand each request's buffer row to its samples (one copy each; the context was
        computed once) and decode all samples in lockstep; finished rows are dropped from the
        batch once a quarter of it has finished."""
        dev, width = self.device, pre.width
        flat = [row for group in rows for row in group]  # sample rows, grouped by request
        slot = {r: k for k, r in enumerate(pre.order)}
        shape = list(pre.kv.shape)
        shape[2], shape[4] = len(flat), width + params.max_new_tokens - 1
        kv = torch.zeros(shape, dtype=self.dtype, device=dev)  # [L, 2, B, H, C, D]
        b = 0
        for r, group in enumerate(rows):
            if group:
                kv[:, :, b : b + len(group), :, :width] = pre.kv[:, :, slot[r] : slot[r] + 1]
            b += len(group)
        seeds = None
        if params.seed is not None:
            seeds = [row_seed(params.seed, reqs[x.request].ctx, x.index) for x in flat]
        uniforms = Uniforms(generator, seeds)
        stop_ids = torch.tensor(stops, dtype=torch.long, device=dev)
        lengths = torch.tensor([len(reqs[x.request].ctx) for x in flat], device=dev)  # [B]
        live = torch.arange(len(flat), device=dev)  # buffer row -> index in flat
        done = torch.zeros(len(flat), dtype=torch.bool, device=dev)  # [B]
        logits = torch.stack([pre.first[x.request] for x in flat]).to(dev)  # [B, V]
        plan, fed = WritePlan(), 0  # fed: tokens of each live sample already run
        while True:
            # sample one token for every unfinished row
            need = (~done).nonzero().squeeze(-1)
            u = torch.zeros(len(live), device="cpu")  # uniforms come from CPU generators
            if params.temperature > 0 and len(need):
                u[need.cpu()] = uniforms.next(live[need].cpu())
            step = draw(logits, params, u.to(dev))
            toks, lps, ents = step.tokens.tolist(), step.logprobs.tolist(), step.entropies.tolist()
            where = live.tolist()
            for i in need.tolist():
                row = flat[where[i]]
                row.tokens.append(toks[i])
                row.logprobs.append(lps[i])
                row.entropies.append(ents[i])
            # finish rows: hand over their KV (context + all sampled tokens but the last)
            ended = ~done & (torch.isin(step.tokens, stop_ids) | (fed + 1 >= params.max_new_tokens))
            for i in ended.nonzero().squeeze(-1).tolist():
                row = flat[where[i]]
                row.finish = "stop" if row.tokens[-1] in stops else "length"
                ctx = reqs[row.request].ctx
                seq = ctx + tuple(row.tokens[:fed])
                on_finish(row, seq, kv[:, :, i, :, width - len(ctx) : width + fed])
                self.decode_tokens += fed
            done |= ended
            if bool(done.all()):
                return
            if 4 * int(done.sum()) >= len(live):  # compact: drop finished rows
                keep = (~done).nonzero().squeeze(-1)
                kv, live, lengths, done = kv[:, :, keep], live[keep], lengths[keep], done[keep]
                step = step._replace(tokens=step.tokens[keep])
            # run the sampled tokens: column width + fed, position len + fed
            col = width + fed
            plan.col, plan.width = col, col + 1
            allowed = (
                torch.arange(col + 1, device=dev)[None, None, :] >= (width - lengths)[:, None, None]
            )  # [B, 1, col + 1]
            out = self.model(
                input_ids=torch.where(done, self.pad_id, step.tokens)[:, None],  # [B, 1]
                attention_mask=attention_bias(allowed, self.dtype),  # [B, 1, 1, col + 1]
                position_ids=(lengths + fed)[:, None],
                **{self.cache_kw: buffer_cache(kv, plan)},
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1].float()  # [B, V]
            self.padded_tokens += int(done.sum())
            fed += 1


def cache_keyword(model: torch.nn.Module) -> str:
    """The name under which ``model.forward`` takes a KV cache in this transformers version
    (a peft wrapper passes keywords through to its base model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in params else "past_key_values"
