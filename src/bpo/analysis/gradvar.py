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

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["count_sketch", "gradient_samples", "gradient_summary"]

UNBIASED = ("bpo", "rloo", "bpo_prior")


def count_sketch(g: torch.Tensor, dim: int = 4096, seed: int = 0) -> np.ndarray:
    """Project a flat gradient to ``dim`` dimensions with a fixed random hash and sign."""
    gen = torch.Generator().manual_seed(seed)
    bucket = torch.randint(0, dim, (g.numel(),), generator=gen)
    sign = torch.randint(0, 2, (g.numel(),), generator=gen).to(g.dtype) * 2 - 1
    out = torch.zeros(dim, dtype=torch.float64)
    out.index_add_(0, bucket, (g * sign).to(torch.float64))
    return out.numpy()


def gradient_samples(
    sample_batch: Callable[[int], tuple[torch.Tensor, float]],
    batches: int,
    dim: int = 4096,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """One method's part of the study: ``sample_batch(b) -> (flat gradient, cost of the
    batch)`` at a fixed policy, for b < ``batches``; each gradient kept as its count sketch
    (the same hash for every method: ``seed``). The parts of several methods may be drawn in
    separate processes and combined by :func:`gradient_summary`."""
    sketches, norms, costs = [], [], []
    for b in range(batches):
        g, cost = sample_batch(b)
        sketches.append(count_sketch(g, dim, seed))
        norms.append(float(g.norm()))
        costs.append(float(cost))
    return {"sketches": np.stack(sketches), "norms": np.asarray(norms), "costs": np.asarray(costs)}


def gradient_summary(samples: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, Any]]:
    """Per method (``samples``: method -> :func:`gradient_samples`' result): the trace of the
    covariance of the batch gradient, that trace times the mean batch cost, the variance of the
    gradient norm, and the mean cosine to the reference direction (the mean over every batch of
    the unbiased methods present, else of all methods)."""
    ref_pool = [x for m, d in samples.items() if m in UNBIASED for x in d["sketches"]] or [
        x for d in samples.values() for x in d["sketches"]
    ]
    ref = np.mean(ref_pool, axis=0)
    out: dict[str, dict[str, Any]] = {}
    for m, d in samples.items():
        x = d["sketches"]  # [B, dim]
        tr = float(np.var(x, axis=0, ddof=1).sum()) if len(x) > 1 else float("nan")
        cost = float(np.mean(d["costs"]))
        cos = [float(v @ ref / (np.linalg.norm(v) * np.linalg.norm(ref) + 1e-30)) for v in x]
        out[m] = {
            "trace_cov": tr,
            "cost_tokens": cost,
            "trace_cov_x_cost": tr * cost,
            "grad_norm_var": float(np.var(d["norms"], ddof=1)) if len(x) > 1 else float("nan"),
            "cos_to_reference": float(np.mean(cos)),
            "batches": len(x),
        }
    return out
