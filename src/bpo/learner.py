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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bpo import estimators
from bpo.data_parallel import (
    DataParallel,
    full_optimizer_state,
    gather_shards,
    load_full_optimizer_state,
    load_shards,
)
from bpo.losses import AGGREGATIONS, policy_loss
from bpo.packing import Packed, attention_pair_cost, choose_layout, pack_forest, pack_paths
from bpo.tree import Tree

__all__ = ["Learner", "LearnerConfig", "model_device", "row_chunks", "token_logprobs"]

PARALLEL = ("ddp", "fsdp")


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
        if self.warmup_updates < 0:
            raise ValueError(f"warmup_updates must be >= 0, got {self.warmup_updates}")
        if self.epochs < 1 or self.minibatches < 1:
            raise ValueError("epochs and minibatches must be >= 1")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's (first) parameter: where its inputs must be made."""
    return next(model.parameters()).device


def token_logprobs(
    model: torch.nn.Module,
    packed: Packed,
    rows: slice | None = None,
    temperature: float = 1.0,
    hidden: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Log-probs and entropies of the action tokens in ``rows`` of a packed batch.

    Returns ``(logp [A], entropy [A], index [A])`` where ``index`` selects those tokens in
    ``packed.actions`` (entries of other rows are not computed). When ``hidden`` is a list, the
    last layer's hidden states at each selected token's predictor position are appended to it
    (``[A, H]``: the state a value head reads). Everything is computed on ``model``'s device
    (the packed inputs are moved there when they were made elsewhere).
    """
    dev = model_device(model)
    rows = rows or slice(0, packed.num_rows)
    r0 = rows.start or 0
    a = packed.actions
    sel = np.flatnonzero((a.row >= r0) & (a.row < rows.stop))
    # logits only at the positions that predict an action token (``logits_to_keep``, the same
    # positions for every row of the chunk): the vocabulary projection of every context token
    # would cost [rows, L, V] memory, 400 MB per 2048-token row at a 49k vocabulary
    keep = np.unique(a.pred[sel])
    mask = packed.attention_mask
    out = model(
        input_ids=packed.input_ids[rows].to(dev),
        position_ids=packed.position_ids[rows].to(dev),
        attention_mask=None if mask is None else mask[rows].to(dev),
        use_cache=False,
        output_hidden_states=hidden is not None,
        logits_to_keep=torch.as_tensor(keep, device=dev),
    )
    logits = out.logits  # [r, P, V]
    row = torch.as_tensor(a.row[sel] - r0, device=dev)  # [A]
    col = torch.as_tensor(np.searchsorted(keep, a.pred[sel]), device=dev)  # [A]
    picked = logits[row, col]  # [A, V]
    if hidden is not None:
        pred = torch.as_tensor(a.pred[sel], device=dev)  # [A]
        hidden.append(out.hidden_states[-1][row, pred])  # [A, H]
    logprobs_all = torch.log_softmax(picked.float() / temperature, dim=-1)  # [A, V]
    tok = torch.as_tensor(a.token[sel], device=dev)  # [A]
    logp = logprobs_all.gather(-1, tok[:, None]).squeeze(-1)  # [A]
    entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)  # [A]
    return logp, entropy, sel


def row_chunks(packed: Packed, max_tokens: int) -> list[slice]:
    """Consecutive row ranges whose padded size (rows x width) stays within ``max_tokens``
    (at least one row each): independent rows are forwarded as a batch."""
    width = int(packed.input_ids.shape[1])
    per = max(1, max_tokens // max(width, 1))
    return [slice(r, min(r + per, packed.num_rows)) for r in range(0, packed.num_rows, per)]


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
    ) -> None:
        """``critic=True`` adds a value head (a zero-initialised linear layer on the last hidden
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

    def _gae_terms(
        self, trees: Sequence[Tree], packed: Packed
    ) -> tuple[list[estimators.EdgeAdvantages], list[np.ndarray]]:
        """PPO: the value head's V(s) at every acting state (no grad), then GAE over turns.
        Returns (advantage and tree weight per edge, return targets per node) per tree.

        Computed with ``full_model`` (the weights of the sharded copy at this point): a forward
        through an FSDP model is a collective, and ranks have different numbers of chunks."""
        values = [np.zeros(len(t)) for t in trees]
        a = packed.actions
        with torch.no_grad():
            for rows in row_chunks(packed, self.config.max_row_tokens):
                hid: list[torch.Tensor] = []
                _, _, sel = token_logprobs(self.full_model, packed, rows, hidden=hid)
                v = self.full_model.value_head(hid[0]).squeeze(-1).float().cpu().numpy()  # [A]
                for k, s_ in enumerate(sel):
                    t, node = packed.edges[a.edge[s_]]
                    values[t][trees[t].nodes[node].parent] = v[k]  # same for every token of e
        terms, targets = [], []
        for t, tree in enumerate(trees):
            adv, ret = estimators.gae(
                tree.parents(), tree.rewards(), values[t],
                gamma=self.config.gamma, lam=self.config.gae_lambda,
            )  # fmt: skip
            w = estimators.compute("bpo", tree.parents(), tree.rewards()).weight
            terms.append(estimators.EdgeAdvantages(adv, w))
            targets.append(ret)
        return terms, targets

    def _token_terms(
        self,
        packed: Packed | None,
        trees: Sequence[Tree],
        terms: list[estimators.EdgeAdvantages],
        targets: list[np.ndarray] | None = None,
        num_trees: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per action token: advantage, loss weight (normalised for the aggregation), old logp;
        with value targets, also the return target and value-loss weight of each edge's first
        token (the token whose predictor position is the acting state). The normalisers are
        those of the whole minibatch (``num_trees`` trees, sums over ranks); ``packed`` is None
        on a rank without trees. ``n_tok`` is the minibatch's action-token count."""
        num_trees = len(trees) if num_trees is None else num_trees
        edge = packed.actions.edge if packed is not None else np.zeros(0, dtype=np.int64)
        adv = np.empty(len(edge))
        w = np.empty(len(edge))
        old = np.empty(len(edge))
        ret = np.zeros(len(edge))
        first = np.zeros(len(edge))
        n_tok = np.zeros(len(packed.edges) if packed is not None else 0)
        np.add.at(n_tok, edge, 1)
        offsets: dict[int, int] = {}
        packed_edges = packed.edges if packed is not None else []
        for k, e in enumerate(edge):
            t, node = packed_edges[e]
            j = offsets.get(e, 0)
            offsets[e] = j + 1
            adv[k] = terms[t].advantage[node]
            w[k] = terms[t].weight[node]
            old[k] = trees[t].nodes[node].turn.logprobs[j]  # type: ignore[union-attr]
            if targets is not None and j == 0:
                ret[k] = targets[t][node]
                first[k] = 1.0
        totals = np.array([w.sum(), first.sum(), len(edge)])  # [3]
        if self.dp is not None:
            totals = self.dp.sum(totals)
        mode = self.config.aggregation
        if mode == "tree":
            w = w / num_trees
        elif mode == "token_mean":
            w = w / max(totals[0], 1e-30)
        else:  # sequence_mean
            w = w / n_tok[edge] / num_trees
        f, dev = torch.float32, self.device
        return {
            "n_tok": torch.tensor(totals[2], device=dev),
            "adv": torch.tensor(adv, dtype=f, device=dev),  # [A]
            "w": torch.tensor(w, dtype=f, device=dev),  # [A]
            "old": torch.tensor(old, dtype=f, device=dev),  # [A]
            "ret": torch.tensor(ret, dtype=f, device=dev),  # [A]
            "vw": torch.tensor(first / max(totals[1], 1.0), dtype=f, device=dev),  # [A]
        }

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
        for _ in range(cfg.epochs):
            for packed, tt in batches:
                for k, v in self._step(packed, tt).items():
                    logs.setdefault(k, []).append(v)
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
            if ppo:
                sub_terms, targets = (
                    self._gae_terms(sub, packed) if packed is not None else ([], [])
                )
            else:
                sub_terms = self._edge_terms(sub, estimator, estimator_options)
            for i, term in zip(idx, sub_terms, strict=True):
                terms[i] = term
            tt = self._token_terms(packed, sub, sub_terms, targets, num_trees=len(chunk))
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

    def _idle_pass(self) -> None:
        """FSDP lockstep: a forward and backward of zero loss through the sharded model, for a
        rank with fewer row chunks than another in this minibatch (or none). It uses every
        parameter a real pass uses (the value head too), so that every rank reduce-scatters
        the same set of gradients; they add zero."""
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)  # [1, 1]
        out = self.model(
            input_ids=ids, use_cache=False, output_hidden_states=self.critic, logits_to_keep=1
        )
        loss = out.logits.float().sum()
        if self.critic:
            loss = loss + self.model.value_head(out.hidden_states[-1]).float().sum()
        (loss * 0.0).backward()

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
                with torch.no_grad():
                    ref, _, _ = token_logprobs(self.ref_model, packed, rows, cfg.temperature)
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
            self._idle_pass()
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
            scale = min(1.0, (self.updates + 1) / cfg.warmup_updates) if cfg.warmup_updates else 1
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.lr * scale
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
