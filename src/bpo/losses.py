"""Policy losses (DESIGN section 5): token-level clipped surrogate with per-token weights, KL to a
reference policy (k3), entropy bonus, and three aggregation modes.

All functions are pure tensor functions over *action tokens*: callers pass per-token tensors of
one shape (``[B, T]`` padded, or ``[N]`` packed) with ``mask`` marking action tokens (observation
tokens and padding are 0). Per-token ``weights`` carry the tree weight w(e) of the token's edge.

Aggregation modes (one must be used for every method in a comparison; DESIGN section 6):

* ``tree`` (default): ``sum_tokens w * loss / num_trees``. For independent groups of N episodes
  (w = 1/N) this is each episode's token sum averaged over the group, then over tasks.
* ``token_mean``: ``sum w * loss / sum w`` over action tokens (DAPO's token-level mean when the
  weights are uniform).
* ``sequence_mean``: each edge's token mean, then ``sum_e w(e) * mean_e / num_trees`` (GRPO's
  original sample-level mean when w = 1/N).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["AGGREGATIONS", "LossOutput", "aggregate", "kl_k3", "policy_loss"]

AGGREGATIONS = ("tree", "token_mean", "sequence_mean")


class LossOutput(NamedTuple):
    loss: torch.Tensor  # [] total: pg + kl_coef * kl - entropy_coef * entropy
    pg_loss: torch.Tensor  # [] clipped surrogate, aggregated
    kl: torch.Tensor  # [] k3 KL to the reference, aggregated (0 without a reference)
    entropy: torch.Tensor  # [] mean entropy, aggregated (0 without entropies)
    clip_frac: torch.Tensor  # [] fraction of action tokens whose ratio was clipped
    ratio_mean: torch.Tensor  # [] mean importance ratio over action tokens
    approx_kl_old: torch.Tensor  # [] mean k3 KL between sampling and current policy


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(r) - r - 1, r = ref - logp."""
    r = ref_logp - logp
    return r.exp() - r - 1.0


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    mode: str = "tree",
    *,
    num_trees: int | None = None,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` to a scalar under an aggregation mode (see the module doc).

    ``segment_ids`` (same shape, int64) names each token's edge; needed for ``sequence_mean``.
    ``num_trees`` is the number of trees (tasks) in the batch; needed for ``tree`` and
    ``sequence_mean``.
    """
    m = mask.to(values.dtype)
    w = weights.to(values.dtype) * m
    if mode == "token_mean":
        return (values * w).sum() / w.sum().clamp_min(torch.finfo(values.dtype).tiny)
    if num_trees is None or num_trees < 1:
        raise ValueError(f"aggregation {mode!r} needs num_trees >= 1, got {num_trees}")
    if mode == "tree":
        return (values * w).sum() / num_trees
    if mode == "sequence_mean":
        if segment_ids is None:
            raise ValueError(
                "aggregation 'sequence_mean' needs segment_ids (the edge of each token)"
            )
        seg = segment_ids.reshape(-1)
        flat_m = m.reshape(-1)
        n_seg = int(seg.max().item()) + 1 if seg.numel() else 0
        counts = torch.zeros(n_seg, dtype=values.dtype, device=values.device)
        counts.index_add_(0, seg, flat_m)  # [S] action tokens per edge
        per_token = (values * w).reshape(-1) / counts.clamp_min(1.0)[seg]
        return per_token.sum() / num_trees
    raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    aggregation: str = "tree",
    num_trees: int | None = None,
    segment_ids: torch.Tensor | None = None,
) -> LossOutput:
    """PPO-clip surrogate over action tokens (Schulman et al. 2017), with per-token tree weights.

    ``clip_high`` defaults to ``clip_low`` (DAPO's "clip-higher" uses a larger upper bound; Yu et
    al. 2025). ``dual_clip`` bounds the loss of negative-advantage tokens by ``dual_clip * |A|``
    (Ye et al. 2020). All per-token tensors share one shape, e.g. ``[B, T]``.
    """
    if not (logp.shape == old_logp.shape == advantages.shape == mask.shape):
        raise ValueError(
            f"shape mismatch: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, "
            f"advantages {tuple(advantages.shape)}, mask {tuple(mask.shape)}"
        )
    if weights is None:
        weights = torch.ones_like(logp)
    hi = clip_low if clip_high is None else clip_high
    m = mask.to(logp.dtype)
    log_ratio = (logp - old_logp) * m  # masked tokens get ratio 1
    ratio = log_ratio.exp()  # [B, T]
    surr1 = -advantages * ratio
    surr2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + hi)
    pg = torch.maximum(surr1, surr2)  # [B, T]
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * dual_clip), pg)

    def agg(x: torch.Tensor) -> torch.Tensor:
        return aggregate(
            x, mask, weights, aggregation, num_trees=num_trees, segment_ids=segment_ids
        )

    pg_loss = agg(pg)
    zero = pg_loss.new_zeros(())
    kl = agg(kl_k3(logp, ref_logp)) if ref_logp is not None else zero
    ent = agg(entropy) if entropy is not None else zero
    loss = pg_loss + kl_coef * kl - entropy_coef * ent
    with torch.no_grad():
        n = m.sum().clamp_min(1.0)
        clipped = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + hi)).to(m.dtype) * m
        clip_frac = clipped.sum() / n
        ratio_mean = (ratio * m).sum() / n
        approx_kl = (kl_k3(logp, old_logp) * m).sum() / n
    return LossOutput(loss, pg_loss, kl, ent, clip_frac, ratio_mean, approx_kl)
