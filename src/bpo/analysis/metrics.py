"""Statistics of per-batch gradient estimates against the exact gradient."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = ["GradientStats", "event_counts", "gradient_stats"]


class GradientStats(NamedTuple):
    bias_max_abs_z: float
    """Largest |mean - exact| / stderr over the gradient coordinates (inf: zero variance and
    a non-zero difference)."""
    bias_coords: int
    """Coordinates tested (those with a non-zero variance or a non-zero difference)."""
    bias_p_bonferroni: float
    """Bonferroni p-value of bias_max_abs_z over bias_coords (small = a detected bias)."""
    scale: float
    """mean <g_hat, g> / |g|^2: 1 for an unbiased estimator; GRPO's std normalisation moves it."""
    scale_z: float
    """(scale - 1) / its standard error."""
    trace_cov: float
    """Trace of the covariance of the per-batch gradient estimate."""
    mse: float
    """Mean of |g_hat - g|^2 (trace_cov + squared bias, up to sampling noise)."""
    grad_norm_var: float
    """Variance of |g_hat| over batches (the figure papers quote)."""
    grad_norm_mean: float
    cos_to_true: float
    """Mean cosine between the batch gradient and the exact gradient."""
    cos_stderr: float
    batches: int


def _normal_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def gradient_stats(
    g_hat: np.ndarray, g: np.ndarray, testable: np.ndarray | None = None
) -> GradientStats:
    """``g_hat``: [B, D] per-batch estimates; ``g``: [D] exact gradient.

    ``testable`` ([D] bool) restricts the bias z-test to coordinates where the normal
    approximation of the batch mean is sound (see :func:`event_counts`); by default all.
    """
    nb = g_hat.shape[0]
    if nb < 2:
        raise ValueError("need at least two batches for variances")
    mean = g_hat.mean(axis=0)  # [D]
    var = g_hat.var(axis=0, ddof=1)  # [D]
    diff = mean - g
    tol = 1e-12 * max(1.0, float(np.abs(g).max()))
    se = np.sqrt(var / nb)
    tested = (se > 0) | (np.abs(diff) > tol)
    if testable is not None:
        tested &= testable
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(se > 0, np.abs(diff) / se, np.where(np.abs(diff) > tol, np.inf, 0.0))
    zmax = float(z[tested].max()) if tested.any() else 0.0
    coords = int(tested.sum())
    p = min(1.0, coords * 2 * _normal_sf(zmax)) if coords else 1.0
    gg = float(g @ g)
    dots = g_hat @ g  # [B]
    scale = float(dots.mean() / gg) if gg > 0 else float("nan")
    scale_se = float(dots.std(ddof=1) / math.sqrt(nb) / gg) if gg > 0 else float("nan")
    scale_z = (scale - 1.0) / scale_se if scale_se > 0 else float("nan")
    norms = np.linalg.norm(g_hat, axis=1)  # [B]
    gn = math.sqrt(gg)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = np.where(norms > 0, dots / (norms * gn), 0.0) if gn > 0 else np.zeros(nb)
    return GradientStats(
        bias_max_abs_z=zmax,
        bias_coords=coords,
        bias_p_bonferroni=float(p),
        scale=scale,
        scale_z=float(scale_z),
        trace_cov=float(var.sum()),
        mse=float(((g_hat - g) ** 2).sum(axis=1).mean()),
        grad_norm_var=float(norms.var(ddof=1)),
        grad_norm_mean=float(norms.mean()),
        cos_to_true=float(cos.mean()),
        cos_stderr=float(cos.std(ddof=1) / math.sqrt(nb)),
        batches=nb,
    )


def event_counts(
    batch: np.ndarray,
    param: np.ndarray,
    action: np.ndarray,
    num_batches: int,
    shape: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray]:
    """Per gradient coordinate (p, b): the number of batches in which some edge acted from a
    state of logit row p with action b, and with another action. Both must be large for the
    batch mean of that coordinate to be near-normal (rare actions make it skewed: a z-test on
    a coordinate whose rare action was seen in a handful of batches is meaningless).

    ``batch``, ``param``, ``action``: [E] per edge; returns two [P * A] int arrays.
    """
    p_n, a_n = shape
    key = (batch * p_n + param) * a_n + action
    present = np.zeros(num_batches * p_n * a_n, dtype=bool)
    present[key] = True
    pres = present.reshape(num_batches, p_n, a_n)
    other = (pres.sum(axis=2, keepdims=True) - pres) > 0
    return pres.sum(axis=0).ravel(), other.sum(axis=0).ravel()
