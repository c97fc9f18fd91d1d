"""The learner: recompute action log-probs with shared prefixes computed once, and update the
policy with the tree-weighted clipped surrogate (DESIGN section 5).

Update phases (one call of :meth:`Learner.update` = one training iteration):

1. advantages and weights for every edge (``bpo.estimators``), then per-token loss weights for
   the configured aggregation, normalised over the whole minibatch (so that micro-batches can
   accumulate gradients and every method shares one effective step size);
2. packing: a token forest per minibatch (each shared prefix once) or independent rows,
   whichever :func:`bpo.packing.choose_layout` expects to be cheaper;
3. for each epoch and minibatch: forward, loss, backward per row chunk; gradient norm before
   clipping; a non-finite loss or gradient skips the step and never reaches the weights;
4. metrics under ``loss/`` and ``learner/``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bpo import estimators
from bpo.losses import AGGREGATIONS, policy_loss
from bpo.packing import Packed, choose_layout, pack_forest, pack_paths
from bpo.tree import Tree

__all__ = ["Learner", "LearnerConfig", "token_logprobs"]


@dataclass(frozen=True)
class LearnerConfig:
    lr: float = 1e-5
    """AdamW learning rate (tune per method on the same grid; DESIGN section 6)."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
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
    max_row_tokens: int = 4096
    """Trees are packed together into one row up to this many tokens."""
    temperature: float = 1.0
    """Sampling temperature: log-probs are computed from logits / temperature."""
    max_bad_steps: int = 5
    """Non-finite updates in a row before the run stops with an error."""

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"unknown aggregation {self.aggregation!r}; valid: {', '.join(AGGREGATIONS)}"
            )
        if self.layout not in ("auto", "forest", "paths"):
            raise ValueError(f"unknown layout {self.layout!r}; valid: auto, forest, paths")
        if self.epochs < 1 or self.minibatches < 1:
            raise ValueError("epochs and minibatches must be >= 1")


def token_logprobs(
    model: torch.nn.Module, packed: Packed, rows: slice | None = None, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Log-probs and entropies of the action tokens in ``rows`` of a packed batch.

    Returns ``(logp [A], entropy [A], index [A])`` where ``index`` selects those tokens in
    ``packed.actions`` (entries of other rows are not computed).
    """
    rows = rows or slice(0, packed.num_rows)
    r0 = rows.start or 0
    a = packed.actions
    sel = np.flatnonzero((a.row >= r0) & (a.row < rows.stop))
    out = model(
        input_ids=packed.input_ids[rows],
        position_ids=packed.position_ids[rows],
        attention_mask=packed.attention_mask[rows],
        use_cache=False,
    )
    logits = out.logits  # [r, L, V]
    picked = logits[torch.from_numpy(a.row[sel] - r0), torch.from_numpy(a.pred[sel])]  # [A, V]
    logprobs_all = torch.log_softmax(picked.float() / temperature, dim=-1)  # [A, V]
    tok = torch.from_numpy(a.token[sel])
    logp = logprobs_all.gather(-1, tok[:, None]).squeeze(-1)  # [A]
    entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)  # [A]
    return logp, entropy, sel


class NonFiniteError(RuntimeError):
    """Too many non-finite updates in a row."""


class Learner:
    """Owns the trainable model, its optimizer and (optionally) a frozen reference model."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: LearnerConfig,
        ref_model: torch.nn.Module | None = None,
        pad_id: int = 0,
    ) -> None:
        if config.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model (ref_model)")
        self.model = model
        self.ref_model = ref_model
        self.config = config
        self.pad_id = pad_id
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        self.optimizer = torch.optim.AdamW(
            params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.updates = 0
        self.bad_in_a_row = 0

    # -- phase 1 -----------------------------------------------------------------------------
    def _edge_terms(
        self, trees: Sequence[Tree], estimator: str, options: dict[str, Any]
    ) -> list[estimators.EdgeAdvantages]:
        out = []
        for tree in trees:
            fps = tree.fingerprints() if estimator == "gigpo" else None
            out.append(
                estimators.compute(
                    estimator, tree.parents(), tree.rewards(), fingerprints=fps, **options
                )
            )
        return out

    def _token_terms(
        self, packed: Packed, trees: Sequence[Tree], terms: list[estimators.EdgeAdvantages]
    ) -> dict[str, torch.Tensor]:
        """Per action token: advantage, loss weight (normalised for the aggregation), old logp."""
        a = packed.actions
        adv = np.empty(len(a.token))
        w = np.empty(len(a.token))
        old = np.empty(len(a.token))
        n_tok = np.zeros(len(packed.edges))
        np.add.at(n_tok, a.edge, 1)
        offsets: dict[int, int] = {}
        for k, e in enumerate(a.edge):
            t, node = packed.edges[e]
            j = offsets.get(e, 0)
            offsets[e] = j + 1
            adv[k] = terms[t].advantage[node]
            w[k] = terms[t].weight[node]
            old[k] = trees[t].nodes[node].turn.logprobs[j]  # type: ignore[union-attr]
        mode = self.config.aggregation
        if mode == "tree":
            w = w / len(trees)
        elif mode == "token_mean":
            w = w / max(w.sum(), 1e-30)
        else:  # sequence_mean
            w = w / n_tok[a.edge] / len(trees)
        f = torch.float32
        return {
            "adv": torch.tensor(adv, dtype=f),
            "w": torch.tensor(w, dtype=f),
            "old": torch.tensor(old, dtype=f),
        }

    # -- phases 2-4 ----------------------------------------------------------------------------
    def pack(self, trees: Sequence[Tree]) -> Packed:
        layout = self.config.layout
        if layout == "auto":
            layout = choose_layout(trees)
        if layout == "forest":
            return pack_forest(trees, pad_id=self.pad_id, max_row_tokens=self.config.max_row_tokens)
        return pack_paths(trees, pad_id=self.pad_id)

    def update(
        self, trees: Sequence[Tree], estimator: str = "bpo", **estimator_options: Any
    ) -> dict[str, float]:
        """One iteration: ``epochs * minibatches`` optimizer steps on these trees."""
        cfg = self.config
        t_start = time.perf_counter()
        terms = self._edge_terms(trees, estimator, estimator_options)
        chunks = [list(c) for c in np.array_split(np.arange(len(trees)), cfg.minibatches) if len(c)]
        batches = []
        for idx in chunks:
            sub = [trees[i] for i in idx]
            packed = self.pack(sub)
            batches.append((packed, self._token_terms(packed, sub, [terms[i] for i in idx])))
        logs: dict[str, list[float]] = {}
        self.model.train()
        for _ in range(cfg.epochs):
            for packed, tt in batches:
                for k, v in self._step(packed, tt).items():
                    logs.setdefault(k, []).append(v)
        adv_all = np.concatenate([t.advantage[1:] for t in terms]) if terms else np.zeros(0)
        metrics = {k: float(np.mean(v)) for k, v in logs.items()}
        metrics["learner/grad_norm_max"] = float(np.max(logs.get("learner/grad_norm", [0.0])))
        metrics.update(
            {
                "learner/updates": float(self.updates),
                "learner/seconds": time.perf_counter() - t_start,
                "learner/computed_tokens": float(sum(p.computed_tokens for p, _ in batches)),
                "learner/action_tokens": float(sum(len(p.actions.token) for p, _ in batches)),
                "loss/adv_mean": float(adv_all.mean()) if len(adv_all) else 0.0,
                "loss/adv_abs_mean": float(np.abs(adv_all).mean()) if len(adv_all) else 0.0,
                "loss/adv_zero_frac": float(np.mean(adv_all == 0)) if len(adv_all) else 0.0,
            }
        )
        return metrics

    def _step(self, packed: Packed, tt: dict[str, torch.Tensor]) -> dict[str, float]:
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        sums = {"loss/total": 0.0, "loss/pg": 0.0, "loss/kl": 0.0, "loss/entropy": 0.0}
        clip_n = ratio_s = kl_old = 0.0
        n_tok = max(len(packed.actions.token), 1)
        for r in range(packed.num_rows):
            rows = slice(r, r + 1)
            logp, ent, sel = token_logprobs(self.model, packed, rows, cfg.temperature)
            if len(sel) == 0:
                continue
            idx = torch.from_numpy(sel)
            ref = None
            if self.ref_model is not None and cfg.kl_coef > 0:
                with torch.no_grad():
                    ref, _, _ = token_logprobs(self.ref_model, packed, rows, cfg.temperature)
            out = policy_loss(
                logp, tt["old"][idx], tt["adv"][idx], torch.ones_like(logp), tt["w"][idx],
                clip_low=cfg.clip_low, clip_high=cfg.clip_high, ref_logp=ref,
                kl_coef=cfg.kl_coef, entropy=ent, entropy_coef=cfg.entropy_coef,
                aggregation="tree", num_trees=1,
            )  # fmt: skip
            out.loss.backward()
            sums["loss/total"] += out.loss.item()
            sums["loss/pg"] += out.pg_loss.item()
            sums["loss/kl"] += out.kl.item()
            sums["loss/entropy"] += out.entropy.item()
            frac = len(sel) / n_tok
            clip_n += out.clip_frac.item() * frac
            ratio_s += out.ratio_mean.item() * frac
            kl_old += out.approx_kl_old.item() * frac
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        finite = math.isfinite(norm) and math.isfinite(sums["loss/total"])
        if finite:
            self.optimizer.step()
            self.updates += 1
            self.bad_in_a_row = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.bad_in_a_row += 1
            if self.bad_in_a_row >= cfg.max_bad_steps:
                raise NonFiniteError(
                    f"{self.bad_in_a_row} non-finite updates in a row (loss "
                    f"{sums['loss/total']}, grad norm {norm}) after {self.updates} updates; "
                    "lower the learning rate or check the rewards"
                )
        return {
            **sums,
            "learner/grad_norm": norm,
            "learner/skipped_nonfinite": float(not finite),
            "learner/clip_frac": clip_n,
            "learner/ratio_mean": ratio_s,
            "learner/approx_kl_old": kl_old,
        }
