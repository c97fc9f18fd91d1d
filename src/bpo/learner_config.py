"""The learner's configuration (``learner.*`` in a run config, :class:`bpo.config.Config`): the
optimizer, the clipped surrogate's terms, minibatching, packing and the data-parallel strategy of
:class:`bpo.learner.Learner`.
"""

from __future__ import annotations

from dataclasses import dataclass

from bpo.losses import AGGREGATIONS

__all__ = ["PARALLEL", "SCHEDULES", "LearnerConfig"]

PARALLEL = ("ddp", "fsdp")
SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LearnerConfig:
    lr: float = 1e-5
    """AdamW learning rate (tune per method on the same grid; DESIGN section 6)."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_updates: int = 0
    """Linear learning-rate warm-up over the first N policy updates. Adam's first steps move
    every parameter by about ``lr`` whatever its gradient's size; without a warm-up they can
    undo much of a warm start (measured on the CPU demo: k3 KL of 10 to the sampling policy
    within the first iteration at lr 5e-4)."""
    lr_schedule: str = "constant"
    """The learning rate after the warm-up: "constant", or decayed towards 0, reached just
    after the run's last policy update, "linear" (the default of transformers' Trainer, so of
    TRL) or "cosine". A decay makes the last updates small, so the policy a run ends with should
    depend less on its last few batches; on the CPU demo it did not raise held-out success
    (README)."""
    max_grad_norm: float = 1.0
    """Gradient clipping; the norm before clipping is logged every step."""
    clip_low: float = 0.2
    clip_high: float | None = None
    """Upper ratio clip; None = clip_low (DAPO's clip-higher uses e.g. 0.28)."""
    kl_coef: float = 0.0
    """k3 KL to the frozen initial policy (needs a reference model)."""
    entropy_coef: float = 0.0
    aggregation: str = "tree"
    """Loss aggregation, shared by every method in a comparison: tree, token_mean, sequence_mean."""
    epochs: int = 1
    minibatches: int = 1
    """Optimizer steps per iteration = epochs * minibatches (each one a "policy update")."""
    layout: str = "auto"
    """Prefix sharing: "forest" (packed tree mask), "paths" (independent rows) or "auto"."""
    max_row_tokens: int = 2048
    """Trees are packed together into one row up to this many tokens (and never wider than the
    largest tree), and rows are forwarded together up to this many (padded) tokens per forward
    pass."""
    temperature: float = 1.0
    """Sampling temperature: log-probs are computed from logits / temperature."""
    max_bad_steps: int = 5
    """Non-finite updates in a row before the run stops with an error."""
    value_coef: float = 0.5
    """PPO only: weight of the value head's squared error in the loss."""
    gamma: float = 1.0
    """PPO only: discount over turns for GAE."""
    gae_lambda: float = 0.95
    """PPO only: GAE's lambda (Schulman et al. 2016)."""
    parallel: str = "ddp"
    """Data-parallel strategy under torchrun (WORLD_SIZE > 1; ignored in one process): "ddp"
    (a full replica per rank, gradients all-reduced) or "fsdp" (the learner trains an FSDP2
    copy of the model: parameters, gradients and AdamW states sharded over the ranks; the same
    update; ``bpo.data_parallel``)."""

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"unknown aggregation {self.aggregation!r}; valid: {', '.join(AGGREGATIONS)}"
            )
        if self.layout not in ("auto", "forest", "paths"):
            raise ValueError(f"unknown layout {self.layout!r}; valid: auto, forest, paths")
        if self.parallel not in PARALLEL:
            raise ValueError(f"unknown parallel {self.parallel!r}; valid: {', '.join(PARALLEL)}")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(
                f"unknown lr_schedule {self.lr_schedule!r}; valid: {', '.join(SCHEDULES)}"
            )
        if self.warmup_updates < 0:
            raise ValueError(f"warmup_updates must be >= 0, got {self.warmup_updates}")
        if self.epochs < 1 or self.minibatches < 1:
            raise ValueError("epochs and minibatches must be >= 1")
