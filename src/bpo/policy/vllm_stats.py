"""The logits processor behind ``VLLMPolicy``'s log-probs and entropies of pi_T
(``softmax(raw_logits / T)`` before top-k / top-p): vLLM returns the sampled token's raw logit
``z`` (``logprobs_mode="raw_logits"``) but no full distributions, so this processor, which sees
every row's raw float32 logits before sampling, records ``logZ_T = logsumexp(z / T)`` and the
entropy of pi_T at each step; then ``log pi_T(x) = z_x / T - logZ_T`` (:mod:`bpo.policy.vllm`).
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

__all__ = ["GREEDY_EPS", "STATS_KEY", "TemperedStats"]

STATS_KEY = "bpo_key"
"""``SamplingParams.extra_args`` key naming a request for :class:`TemperedStats`."""
GREEDY_EPS = 1e-5
"""vLLM treats temperatures below this as greedy."""


class TemperedStats(LogitsProcessor):
    """Records, for every sampled position of every keyed request, ``logsumexp(z / T)`` and the
    entropy of ``softmax(z / T)`` from the raw logits ``z``; leaves the logits unchanged.

    Registered as not argmax-invariant so that vLLM applies it to greedy requests too, before
    penalties and temperature. A row's position is the length of its output so far: a partial
    prefill chunk (whose sample vLLM discards) is overwritten by the real step."""

    def __init__(self, vllm_config: object, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[str, float, list[int]]] = {}  # batch row -> (key, T, output)
        self.records: dict[str, dict[int, tuple[float, float]]] = {}  # key -> pos -> (logZ, H)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params, _prompt, output):  # vLLM callback
            extra = params.extra_args or {}
            if STATS_KEY not in extra:
                return None
            t = params.temperature if params.temperature >= GREEDY_EPS else 1.0
            return extra[STATS_KEY], float(t), output

        process_dict_updates(self.rows, batch_update, new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        idx = sorted(self.rows)
        temps = torch.tensor([self.rows[i][1] for i in idx], dtype=torch.float32)
        rows = logits if idx == list(range(logits.shape[0])) else logits[idx]
        y = rows.float() / temps[:, None]  # [B, V]: z / T
        top = y.amax(-1, keepdim=True)  # [B, 1]
        y -= top  # <= 0
        e = torch.exp(y)  # [B, V]
        total = e.sum(-1)  # [B], >= 1
        log_total = total.log()
        log_z = top[:, 0] + log_total  # [B]
        # H = log_total - E[y]: both terms >= 0, no cancellation; exp(-inf) * -inf -> 0
        entropy = log_total - (e * y).nan_to_num_(0.0).sum(-1) / total  # [B]
        for i, lz, h in zip(idx, log_z.tolist(), entropy.tolist(), strict=True):
            key, _, output = self.rows[i]
            self.records.setdefault(key, {})[len(output)] = (lz, h)
        return logits
