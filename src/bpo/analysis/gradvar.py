"""The estimator-variance study at a fixed policy, on a real sandbox and model (DESIGN section 7).

For each method, B batches of rollouts are drawn from the *same* policy (no update between
them), and each batch's policy-gradient estimate is computed (``Learner.gradient``). Gradients
are compressed with a count sketch (a random hash bucket and sign per parameter; inner products
are preserved in expectation), which keeps the study cheap for large models. Reported per
method: the trace of the covariance of the batch gradient, that trace times the batch's cost
(generated tokens: the fair efficiency figure), the variance of the gradient norm, and the mean
cosine between each batch gradient and a reference direction: the mean over all batches of the
unbiased estimators (``bpo`` and ``rloo``), standing in for the true gradient, which is not
computable on a real sandbox.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["count_sketch", "gradient_study"]

UNBIASED = ("bpo", "rloo", "bpo_prior")


def count_sketch(g: torch.Tensor, dim: int = 4096, seed: int = 0) -> np.ndarray:
    """Project a flat gradient to ``dim`` dimensions with a fixed random hash and sign."""
    gen = torch.Generator().manual_seed(seed)
    bucket = torch.randint(0, dim, (g.numel(),), generator=gen)
    sign = torch.randint(0, 2, (g.numel(),), generator=gen).to(g.dtype) * 2 - 1
    out = torch.zeros(dim, dtype=torch.float64)
    out.index_add_(0, bucket, (g * sign).to(torch.float64))
    return out.numpy()


def gradient_study(
    methods: Sequence[str],
    sample_batch: Callable[[str, int], tuple[torch.Tensor, float]],
    batches: int,
    dim: int = 4096,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """``sample_batch(method, b) -> (flat gradient, cost of the batch)`` at a fixed policy."""
    sketches: dict[str, list[np.ndarray]] = {}
    norms: dict[str, list[float]] = {}
    costs: dict[str, list[float]] = {}
    for m in methods:
        for b in range(batches):
            g, cost = sample_batch(m, b)
            sketches.setdefault(m, []).append(count_sketch(g, dim, seed))
            norms.setdefault(m, []).append(float(g.norm()))
            costs.setdefault(m, []).append(float(cost))
    ref_pool = [s for m in methods if m in UNBIASED for s in sketches[m]] or [
        s for m in methods for s in sketches[m]
    ]
    ref = np.mean(ref_pool, axis=0)
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        x = np.stack(sketches[m])  # [B, dim]
        tr = float(np.var(x, axis=0, ddof=1).sum()) if len(x) > 1 else float("nan")
        cost = float(np.mean(costs[m]))
        cos = [float(v @ ref / (np.linalg.norm(v) * np.linalg.norm(ref) + 1e-30)) for v in x]
        out[m] = {
            "trace_cov": tr,
            "cost_tokens": cost,
            "trace_cov_x_cost": tr * cost,
            "grad_norm_var": float(np.var(norms[m], ddof=1)) if len(x) > 1 else float("nan"),
            "cos_to_reference": float(np.mean(cos)),
            "batches": len(x),
        }
    return out
