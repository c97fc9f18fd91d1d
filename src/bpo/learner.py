"""The learner: recompute action log-probs with shared prefixes computed once, and update the
policy with the tree-weighted clipped surrogate (DESIGN section 5).

Update phases (one call of :meth:`Learner.update` = one training iteration):

1. advantages and weights for every edge (``bpo.estimators``), then per-token loss weights for
   the configured aggregation, normalised over the whole minibatch (so that micro-batches can
   accumulate gradients and every method shares one effective step size; ``bpo.token_terms``);
2. packing: a token forest per minibatch (each shared prefix once) or independent rows,
   whichever :func:`bpo.packing.choose_layout` expects to be cheaper;
3. for each epoch and minibatch: forward, loss, backward per row chunk; gradient norm before
   clipping; a non-finite loss or gradient skips the step and never reaches the weights;
4. metrics under ``loss/`` and ``learner/`` (plus ``time/learner_tokens_per_s`` and, on a GPU,
   ``memory/peak_gb``).

Device: every tensor is made on the model's device (:func:`model_device`): packed batches,
per-token terms, indices, the value head; losses and metrics come back as Python floats. Only
NumPy arrays (advantages, packing plans) live on the host.

Data parallelism (``bpo.data_parallel``): every rank builds the same ``Learner`` with a
``DataParallel`` and calls ``update`` with the same trees; each rank trains on its shard of each
minibatch (trees ``i % world == rank``), with the loss normalised over the whole minibatch and the
gradients summed over ranks before clipping, so that every rank takes the single-process step::

    # torchrun --nproc-per-node 2 my_script.py
    dp = DataParallel.from_env()  # None when WORLD_SIZE is unset or 1: the single-process path
    learner = Learner(model, LearnerConfig(...), data_parallel=dp)
    metrics = learner.update(trees)  # the same trees on every rank; metrics are global

With ``LearnerConfig.parallel = "fsdp"`` the learner trains an FSDP2-sharded copy of the model
instead of the replica itself (parameters, gradients and AdamW states sharded; the same update;
the whole model, which samples, takes the new weights after every update). ``bpo train`` under
torchrun builds the learner this way (``learner.parallel=fsdp``).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from bpo import estimators
from bpo.data_parallel import (
    DataParallel,
    full_optimizer_state,
    gather_shards,
    idle_pass,
    load_full_optimizer_state,
    load_shards,
)
from bpo.learner_config import PARALLEL, LearnerConfig
from bpo.logprobs import model_device, row_chunks, token_logprobs
from bpo.losses import policy_loss
from bpo.packing import Packed, attention_pair_cost, choose_layout, pack_forest, pack_paths
from bpo.token_terms import edge_terms, gae_terms, token_terms
from bpo.tree import Tree

# re-exported from where they live: LearnerConfig and PARALLEL (bpo.learner_config), model_device,
# row_chunks and token_logprobs (bpo.logprobs)
__all__ = [
    "PARALLEL",
    "Learner",
    "LearnerConfig",
    "NonFiniteError",
    "model_device",
    "row_chunks",
    "token_logprobs",
]


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
        critic: bool = False,
        data_parallel: DataParallel | None = None,
        total_updates: int | None = None,
    ) -> None:
        """``total_updates``: the run's policy updates in all, just after which
        ``config.lr_schedule`` reaches 0 (needed unless the schedule is constant).
        ``critic=True`` adds a value head (a zero-initialised linear layer on the last hidden
        state at each turn's context end, registered on the model as ``value_head`` so that it is
        checkpointed with it) for PPO. ``data_parallel`` shards every minibatch over its ranks
        (module docstring); the models are first broadcast from its rank 0.

        With ``config.parallel == "fsdp"`` (and ``data_parallel``), ``model`` stays whole and
        keeps sampling: the learner trains an FSDP-sharded copy of it (``self.model``), takes
        ``model``'s trainable weights at the start of every update (a warm start or a resumed
        checkpoint may have changed them) and writes the new ones back at the end."""
        if config.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model (ref_model)")
        self.device = model_device(model)
        # attention masks in the model's dtype: transformers casts them to it anyway (the same
        # log-probs), and a bfloat16 mask takes half the device memory of a float32 one
        self.mask_dtype = next(model.parameters()).dtype
        if critic and not hasattr(model, "value_head"):
            # made on the CPU (its init draws from the CPU random stream, as on a CPU run)
            head = torch.nn.Linear(model.config.hidden_size, 1)
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
            param = next(model.parameters())
            model.add_module("value_head", head.to(device=param.device, dtype=param.dtype))
        self.dp = data_parallel
        if data_parallel is not None:
            data_parallel.broadcast_module(model)
            if ref_model is not None:
                data_parallel.broadcast_module(ref_model)
        self.critic = critic
        self.full_model = model
        """The whole model, on every rank: the one the caller passed in (sampling reads it)."""
        self.fsdp = data_parallel is not None and config.parallel == "fsdp"
        self.model = data_parallel.fully_shard(copy.deepcopy(model)) if self.fsdp else model
        """The model the optimizer trains: ``full_model`` itself, or its FSDP-sharded copy."""
        self.ref_model = ref_model
        self.config = config
        self.pad_id = pad_id
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        if self.fsdp:  # the whole model's parameter for each sharded one, in the same order
            full = dict(model.named_parameters())
            self._full_params = [
                full[n] for n, p in self.model.named_parameters() if p.requires_grad
            ]
        self.optimizer = torch.optim.AdamW(
            params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.updates = 0
        self.total_updates = total_updates
        self.bad_in_a_row = 0
        self._ref_logp: dict[tuple[int, int], torch.Tensor] | None = None
        """The reference's log-probs per (batch, row chunk), kept during one update()."""

    def lr_now(self) -> float:
        """The learning rate of the next update (number ``self.updates``, from 0): a linear
        warm-up over ``warmup_updates``, then ``lr_schedule`` over the rest of
        ``total_updates``. Written here rather than taken from transformers' schedulers: a
        pure function of the update count, which checkpoints already hold, so a resumed run
        needs no scheduler state; and the warm-up's first update is not at lr 0."""
        cfg = self.config
        u = self.updates
        if u < cfg.warmup_updates:
            return cfg.lr * (u + 1) / cfg.warmup_updates
        if cfg.lr_schedule == "constant":
            return cfg.lr
        if self.total_updates is None:
            raise ValueError(
                f"lr_schedule {cfg.lr_schedule!r} needs the run's length: pass "
                "Learner(total_updates=...) (bpo train does), or use lr_schedule='constant'"
            )
        span = max(1, self.total_updates - cfg.warmup_updates)
        done = min(1.0, (u - cfg.warmup_updates) / span)
        if cfg.lr_schedule == "linear":
            return cfg.lr * (1.0 - done)
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * done))

    # -- phases 2-4 ----------------------------------------------------------------------------
    def pack(self, trees: Sequence[Tree]) -> Packed:
        layout = self.config.layout
        if layout == "auto":
            cost = attention_pair_cost(self.model.config)
            layout = choose_layout(trees, cost, self.config.max_row_tokens)
        if layout == "forest":
            return pack_forest(
                trees, pad_id=self.pad_id, max_row_tokens=self.config.max_row_tokens,
                dtype=self.mask_dtype, device=self.device,
            )  # fmt: skip
        return pack_paths(trees, pad_id=self.pad_id, dtype=self.mask_dtype, device=self.device)

    def update(
        self, trees: Sequence[Tree], estimator: str = "bpo", **estimator_options: Any
    ) -> dict[str, float]:
        """One iteration: ``epochs * minibatches`` optimizer steps on these trees."""
        cfg = self.config
        t_start = time.perf_counter()
        if self.fsdp:  # between updates the whole model's weights are the truth
            load_shards(self._params(), self._full_params)
        batches, terms = self._prepare(trees, estimator, estimator_options, cfg.minibatches)
        logs: dict[str, list[float]] = {}
        self.model.train()
        self._ref_logp = {}  # the batches live until the end of update(): their ids are stable
        try:
            for _ in range(cfg.epochs):
                for packed, tt in batches:
                    for k, v in self._step(packed, tt).items():
                        logs.setdefault(k, []).append(v)
        finally:
            self._ref_logp = None
        if self.fsdp:
            gather_shards(self._params(), self._full_params)
        adv_all = np.concatenate([np.zeros(0)] + [t.advantage[1:] for t in terms if t is not None])
        tokens = [p.computed_tokens for p, _ in batches if p is not None]
        counts = np.array(
            [
                sum(tokens),
                sum(len(p.actions.token) for p, _ in batches if p is not None),
                adv_all.sum(),
                np.abs(adv_all).sum(),
                np.sum(adv_all == 0),
                len(adv_all),
            ]
        )  # [6]
        if self.dp is not None:
            counts = self.dp.sum(counts)
        n_adv = max(counts[5], 1.0)
        seconds = time.perf_counter() - t_start
        metrics = {k: float(np.mean(v)) for k, v in logs.items()}
        metrics["learner/lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["learner/grad_norm_max"] = float(np.max(logs.get("learner/grad_norm", [0.0])))
        metrics.update(
            {
                "learner/updates": float(self.updates),
                "learner/seconds": seconds,
                "learner/computed_tokens": float(counts[0]),
                "learner/action_tokens": float(counts[1]),
                "loss/adv_mean": float(counts[2] / n_adv),
                "loss/adv_abs_mean": float(counts[3] / n_adv),
                "loss/adv_zero_frac": float(counts[4] / n_adv),
                # tokens through forward and backward (each epoch's pass counts) per second of
                # the whole update; a timing, so under time/ (not compared across resumes)
                "time/learner_tokens_per_s": float(counts[0]) * cfg.epochs / max(seconds, 1e-9),
            }
        )
        if self.device.type == "cuda":  # peak since the process started: rollouts included
            metrics["memory/peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics

    def gradient(
        self, trees: Sequence[Tree], estimator: str = "bpo", **estimator_options: Any
    ) -> torch.Tensor:
        """The policy-gradient estimate of one batch (all trainable parameters, flattened),
        without an optimizer step: for estimator-variance studies at a fixed policy."""
        if self.fsdp:
            load_shards(self._params(), self._full_params)
        batches, _ = self._prepare(trees, estimator, estimator_options, 1)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        for packed, tt in batches:
            self._accumulate(packed, tt)
        params = self._params()
        if self.dp is not None and not self.fsdp:
            self.dp.sum_grads(params)
        grads = [p.grad for p in params]
        if self.fsdp:  # sharded DTensors: the whole gradient on every rank
            grads = [g.full_tensor() if g is not None else None for g in grads]
        whole = [
            g if g is not None else torch.zeros(p.shape, dtype=p.dtype, device=self.device)
            for p, g in zip(params, grads, strict=True)
        ]  # p.shape: the whole parameter's, also of a DTensor
        flat = torch.cat([g.reshape(-1) for g in whole])
        self.optimizer.zero_grad(set_to_none=True)
        return flat.detach()

    def _prepare(
        self,
        trees: Sequence[Tree],
        estimator: str,
        estimator_options: dict[str, Any],
        minibatches: int,
    ) -> tuple[
        list[tuple[Packed | None, dict[str, torch.Tensor]]], list[estimators.EdgeAdvantages]
    ]:
        """Phases 1-2: advantages, packing and per-token terms of each minibatch (of this
        rank's shard of it under data parallelism: packed is None where the shard is empty;
        the terms of other ranks' trees are None)."""
        cfg = self.config
        ppo = estimator == "ppo"
        if ppo and not self.critic:
            raise ValueError(
                "estimator 'ppo' needs a value head: build the Learner with critic=True"
            )
        if ppo and estimator_options:
            raise TypeError(
                f"estimator 'ppo' takes no options (got {sorted(estimator_options)}); "
                "set learner.gamma / learner.gae_lambda"
            )
        chunks = [list(c) for c in np.array_split(np.arange(len(trees)), minibatches) if len(c)]
        terms: list[estimators.EdgeAdvantages] = [None] * len(trees)  # type: ignore[list-item]
        batches = []
        for chunk in chunks:
            idx = [chunk[k] for k in self.dp.shard(len(chunk))] if self.dp else chunk
            sub = [trees[i] for i in idx]
            packed = self.pack(sub) if sub else None
            targets = None
            if ppo and packed is not None:
                sub_terms, targets = gae_terms(
                    self.full_model, sub, packed, max_row_tokens=cfg.max_row_tokens,
                    gamma=cfg.gamma, lam=cfg.gae_lambda,
                )  # fmt: skip
            elif ppo:
                sub_terms, targets = [], []
            else:
                sub_terms = edge_terms(sub, estimator, estimator_options)
            for i, term in zip(idx, sub_terms, strict=True):
                terms[i] = term
            tt = token_terms(
                packed, sub, sub_terms, aggregation=cfg.aggregation, device=self.device,
                dp=self.dp, targets=targets, num_trees=len(chunk),
            )  # fmt: skip
            batches.append((packed, tt))
        passes = [len(self._chunks(p)) if p is not None else 0 for p, _ in batches]
        if self.fsdp:  # FSDP's all-gathers and reduce-scatters are collectives: every rank runs
            # as many forward/backward passes as the rank with the most row chunks
            passes = self.dp.max(passes).tolist()
        for (_, tt), n in zip(batches, passes, strict=True):
            tt["passes"] = torch.tensor(int(n), device=self.device)
        return batches, terms

    def _params(self) -> list[torch.nn.Parameter]:
        """The optimizer's parameters (of ``self.model``), in its order."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _chunks(self, packed: Packed) -> list[slice]:
        """The row chunks of a packed minibatch that hold action tokens (one without any would
        add nothing to the loss)."""
        row = packed.actions.row
        chunks = row_chunks(packed, self.config.max_row_tokens)
        return [c for c in chunks if np.any((row >= c.start) & (row < c.stop))]

    def _accumulate(self, packed: Packed | None, tt: dict[str, torch.Tensor]) -> dict[str, float]:
        """Forward and backward of the loss over a packed minibatch (gradients accumulate);
        the sums are this rank's shares under data parallelism."""
        cfg = self.config
        sums = {"loss/total": 0.0, "loss/pg": 0.0, "loss/kl": 0.0, "loss/entropy": 0.0}
        if self.critic:
            sums["loss/value"] = 0.0
        clip_n = ratio_s = kl_old = 0.0
        n_tok = max(float(tt["n_tok"]), 1.0)
        chunks = self._chunks(packed) if packed is not None else []
        for rows in chunks:
            hid: list[torch.Tensor] | None = [] if self.critic else None
            logp, ent, sel = token_logprobs(self.model, packed, rows, cfg.temperature, hid)
            idx = torch.as_tensor(sel, device=self.device)  # [A]
            ref = None
            if self.ref_model is not None and cfg.kl_coef > 0:
                # the frozen reference's log-probs are the same in every epoch: computed once
                key = (id(packed), rows.start)
                ref = None if self._ref_logp is None else self._ref_logp.get(key)
                if ref is None:
                    with torch.no_grad():
                        ref, _, _ = token_logprobs(self.ref_model, packed, rows, cfg.temperature)
                    if self._ref_logp is not None:
                        self._ref_logp[key] = ref
            out = policy_loss(
                logp, tt["old"][idx], tt["adv"][idx], torch.ones_like(logp), tt["w"][idx],
                clip_low=cfg.clip_low, clip_high=cfg.clip_high, ref_logp=ref,
                kl_coef=cfg.kl_coef, entropy=ent, entropy_coef=cfg.entropy_coef,
                aggregation="tree", num_trees=1,
            )  # fmt: skip
            loss = out.loss
            if hid is not None:
                v = self.model.value_head(hid[0]).squeeze(-1).float()  # [A]
                vloss = 0.5 * (tt["vw"][idx] * (v - tt["ret"][idx]) ** 2).sum()
                loss = loss + cfg.value_coef * vloss
                sums["loss/value"] += vloss.item()
            loss.backward()
            sums["loss/total"] += loss.item()
            sums["loss/pg"] += out.pg_loss.item()
            sums["loss/kl"] += out.kl.item()
            sums["loss/entropy"] += out.entropy.item()
            frac = len(sel) / n_tok
            clip_n += out.clip_frac.item() * frac
            ratio_s += out.ratio_mean.item() * frac
            kl_old += out.approx_kl_old.item() * frac
        for _ in range(int(tt["passes"]) - len(chunks)):
            idle_pass(self.model, self.pad_id, self.device, value_head=self.critic)
        return {
            **sums,
            "learner/clip_frac": clip_n,
            "learner/ratio_mean": ratio_s,
            "learner/approx_kl_old": kl_old,
        }

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state for a checkpoint, in ``optimizer.state_dict()``'s layout
        whatever the strategy. Under FSDP a collective (every rank calls it) whose result is
        whole, on the CPU, on rank 0 only (``{}`` elsewhere)."""
        if self.fsdp:
            return full_optimizer_state(self.model, self.optimizer)
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Load :meth:`optimizer_state`'s result (of a run with or without FSDP); under FSDP
        every rank calls it with the whole state and keeps its shard."""
        if self.fsdp:
            load_full_optimizer_state(self.model, self.optimizer, state)
        else:
            self.optimizer.load_state_dict(state)

    def _step(self, packed: Packed | None, tt: dict[str, torch.Tensor]) -> dict[str, float]:
        """Phase 3: one optimizer step; a non-finite loss or gradient never reaches the weights.
        Under data parallelism the gradients and loss sums are summed over ranks first (by FSDP's
        reduce-scatter, into each rank's shard, under fsdp), so that every rank clips, checks
        and steps on the same numbers."""
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        sums = self._accumulate(packed, tt)
        params = self._params()
        if self.dp is not None and not self.fsdp:
            self.dp.sum_grads(params)
        norm_t = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        # FSDP: a DTensor, the norm of the whole gradient (the shards' norms all-reduced)
        norm = float(norm_t.full_tensor() if hasattr(norm_t, "full_tensor") else norm_t)
        finite = math.isfinite(norm)
        if self.dp is not None:  # the norm's flag travels with the loss sums: one decision
            totals = self.dp.sum([*sums.values(), float(not finite)]).tolist()
            sums = dict(zip(sums, totals[:-1], strict=True))
            finite = totals[-1] == 0
        finite = finite and math.isfinite(sums["loss/total"])
        if finite:
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_now()
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
        }
