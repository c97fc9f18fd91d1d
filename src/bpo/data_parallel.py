"""Data parallelism for the learner: which trees a rank trains on, and the sums that make its
update equal the single-process update on the whole batch.

Each rank holds a full replica of the model (DDP-style; parameters are broadcast from rank 0 at
start) and the whole batch of trees. Per minibatch (the same ``np.array_split`` of the trees on
every rank), a rank packs and forwards only its shard, tree ``i`` for ``i % world == rank``.
Round-robin needs no sizes, is deterministic from the tree order alone, and keeps shards within
one tree of each other in count; a rank may get no tree when a minibatch has fewer trees than
ranks, and still takes part in every collective.

Normalisation is global: the counts that divide the loss (trees, token weight sums, value-target
counts of the minibatch) are those of the whole minibatch, so each rank's loss is its share of a
sum, and the all-reduced SUM of the ranks' gradients (the sum DDP's averaging computes, times the
world size) is the single-process gradient. Clipping, the non-finite check and the optimizer step
then run on identical gradients on every rank, so the replicas stay equal.

The gradients are all-reduced explicitly after accumulation instead of by wrapping the model in
``torch.nn.parallel.DistributedDataParallel``: DDP's hooks need every rank to run the same number
of synchronised backward passes through the wrapper's ``forward``, while here the number of row
chunks differs between ranks (and is zero on a rank without trees), and the value head is applied
outside the model's forward.

FSDP (``learner.parallel=fsdp``, torch's FSDP2 ``fully_shard``): the learner trains a sharded
copy of the model (:meth:`DataParallel.fully_shard`: each decoder layer and the root; parameters,
gradients and AdamW states split over the ranks), and the update is the same one: the sharding
of trees and the global normalisers are unchanged, and FSDP's reduce-scatter sums the ranks'
gradients (a SUM, not FSDP's default average) into each rank's shard, so ``sum_grads`` does not
run. Its all-gathers and reduce-scatters are collectives issued by each forward and backward, so
every rank runs as many passes per minibatch as the rank with the most row chunks; the others
add idle passes of zero loss. Clipping takes the norm of the whole gradient across the shards.
The whole model stays on every rank for sampling (rollouts need all of it, and the replicas of
the DDP path are kept as they are): the learner copies its weights into the shards before each
update (local, no communication; a warm start or a resumed checkpoint may have changed them)
and gathers the new ones back after it. So FSDP here saves the memory of the gradients and of
AdamW's two moments (3x the parameters, divided by the world size) at the cost of one extra
sharded parameter copy; it does not shard the parameters that sample. Checkpoints hold the
optimizer state whole, gathered onto rank 0, in ``optimizer.state_dict()``'s layout, so a run
resumes with either strategy from the other's checkpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "DataParallel",
    "full_optimizer_state",
    "gather_shards",
    "idle_pass",
    "load_full_optimizer_state",
    "load_shards",
]


@dataclass(frozen=True)
class DataParallel:
    """A process group the learner shards its batches over."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = None
    """None = the default group (``dist.init_process_group``)."""

    @classmethod
    def from_env(cls, backend: str | None = None) -> DataParallel | None:
        """From torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT):
        initialises the default group when needed; None when WORLD_SIZE is unset or 1."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        if not dist.is_initialized():
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
        return cls.from_group()

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None) -> DataParallel:
        """From an initialised process group (None = the default group)."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def close(self, *, clean: bool = True) -> None:
        """End the default group (``from_env``'s) before the process exits. Without it, rank 0's
        exit closes the rendezvous store under the other ranks' gloo threads, which then abort
        at interpreter exit ("terminate called without an active exception", SIGABRT; 3 exits in
        20 in a two-rank reproduction, 0 in 30 with this). ``clean``: every rank got here (wait
        for all first); False after an error, when another rank may never arrive."""
        if self.group is not None or not dist.is_initialized():
            return  # a caller's own group: theirs to end
        if clean:
            dist.barrier()
        dist.destroy_process_group()

    def shard(self, n: int) -> list[int]:
        """This rank's items of ``n``: ``i % world == rank``."""
        return list(range(self.rank, n, self.world))

    def sum(self, values: np.ndarray | list[float]) -> np.ndarray:
        """Element-wise sum over ranks, in float64."""
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"  # NCCL: GPU only
        t = torch.tensor(np.asarray(values, dtype=np.float64), device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t.cpu().numpy()

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Replace every gradient by its sum over ranks, one flat all-reduce per dtype. A
        parameter without a gradient on a rank counts as zero there, and keeps no gradient
        (None, which AdamW skips) only when it has none on every rank, as in one process."""
        has = self.sum([p.grad is not None for p in params])  # [P]
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p, n in zip(params, has, strict=True):
            if n == 0:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            offset = 0
            for p in group:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n

    def gather(self, items: list) -> list:
        """Every rank's items, in rank order, on every rank (any picklable objects)."""
        parts: list = [None] * self.world
        dist.all_gather_object(parts, items, group=self.group)
        return [x for part in parts for x in part]

    def max(self, values: np.ndarray | list[float]) -> np.ndarray:
        """Element-wise maximum over ranks, in float64."""
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor(np.asarray(values, dtype=np.float64), device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.cpu().numpy()

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on any (e.g. a Ctrl-C one rank received)."""
        return bool(self.sum([float(flag)])[0] > 0)

    def check_equal(self, module: torch.nn.Module) -> None:
        """Fail loudly when the replicas of ``module`` drifted apart (a rank that skipped an
        update, a nondeterministic kernel): compares a checksum of the parameters."""
        with torch.no_grad():
            local = float(sum(p.double().sum() for p in module.parameters()))
        sums = self.gather([local])
        if max(sums) - min(sums) > 1e-6 * max(1.0, abs(sums[0])):
            raise RuntimeError(f"data-parallel replicas diverged: parameter sums {sums}")

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank (as DDP does at construction)."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=src, group=self.group)

    # -- FSDP (learner.parallel=fsdp) ----------------------------------------------------------
    def fully_shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model``, sharded in place with FSDP2 over the ranks: each decoder layer (the classes
        a transformers model names in ``_no_split_modules``, the unit accelerate shards too) and
        the root, parameters as DTensors sharded on dim 0.

        Gradients are reduce-scattered as plain SUMs: FSDP averages over ranks by default, but
        each rank's loss here is its share of a global sum (module docstring). A divide factor
        of 1 alone would make FSDP use ``PREMUL_SUM(1)``, which gloo lacks; forcing sum-only
        collectives with a factor of 1 gives ``ReduceOp.SUM`` and no division on gloo and NCCL
        alike (scaling the loss by the world size instead would round differently from DDP)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        mesh = DeviceMesh.from_group(self.group or dist.group.WORLD, device)
        layers = {n for m in model.modules() for n in getattr(m, "_no_split_modules", None) or ()}
        for m in list(model.modules()):
            if type(m).__name__ in layers:
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(1.0)
        return model


def load_shards(sharded: list[torch.Tensor], full: list[torch.Tensor]) -> None:
    """Each rank's shard of every full tensor into the matching FSDP parameter: a local copy,
    no communication (every rank holds the same full tensors)."""
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        for s, f in zip(sharded, full, strict=True):
            s.copy_(distribute_tensor(f.detach(), s.device_mesh, s.placements, src_data_rank=None))


def gather_shards(sharded: list[torch.Tensor], full: list[torch.Tensor]) -> None:
    """The whole of every FSDP parameter into the matching full tensor, on every rank (one
    all-gather per parameter, in the same order on every rank)."""
    with torch.no_grad():
        for s, f in zip(sharded, full, strict=True):
            f.copy_(s.full_tensor())


def idle_pass(
    model: torch.nn.Module, pad_id: int, device: torch.device, value_head: bool = False
) -> None:
    """FSDP lockstep: a forward and backward of zero loss through the sharded model, for a
    rank with fewer row chunks than another in this minibatch (or none). It uses every
    parameter a real pass of the learner uses (its ``value_head`` too, when ``value_head``),
    so that every rank reduce-scatters the same set of gradients; they add zero."""
    ids = torch.full((1, 1), pad_id, dtype=torch.long, device=device)  # [1, 1]
    out = model(input_ids=ids, use_cache=False, output_hidden_states=value_head, logits_to_keep=1)
    loss = out.logits.float().sum()
    if value_head:
        loss = loss + model.value_head(out.hidden_states[-1]).float().sum()
    (loss * 0.0).backward()


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters, in its order (the indices of its state dict)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def full_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The optimizer state of an FSDP model, whole, on CPU and in ``optimizer.state_dict()``'s
    layout (parameters by index), so that an FSDP checkpoint loads without FSDP and back. A
    collective: every rank calls it; rank 0 gets the state, the others ``{}``.

    Before the first step it is ``optimizer.state_dict()`` on every rank: the state is empty
    (on every rank alike), and ``get_optimizer_state_dict`` would fill it by a step of zero
    gradients at lr 0, which counts a step and so changes AdamW's bias correction of every
    later one (the parameters after the first update then differ by ~0.26 lr)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if not optimizer.state:
        return optimizer.state_dict()
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    by_name = get_optimizer_state_dict(model, optimizer, options=opts)
    if not by_name:
        return {}
    index = {n: i for i, n in enumerate(_param_names(model, optimizer))}
    return {
        "state": {index[n]: s for n, s in by_name["state"].items()},
        "param_groups": [
            {**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]
        ],
    }


def load_full_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load a whole optimizer state (``optimizer.state_dict()``'s layout, as written by
    :func:`full_optimizer_state` or by a run without FSDP) into the optimizer of an FSDP model;
    every rank calls it with the same state and keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not state["state"]:  # before the first step: nothing to shard, and no step to count
        optimizer.load_state_dict(state)
        return
    names = _param_names(model, optimizer)
    by_name = {
        "state": {names[i]: s for i, s in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }
    opts = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, by_name, options=opts)
    # it first fills the state by a zero step (see full_optimizer_state): a parameter without
    # state in the checkpoint (never stepped) keeps none, as with ``optimizer.load_state_dict``;
    # and it turns tuples (AdamW's betas) into lists: the groups' settings as given
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for name, p in zip(names, params, strict=True):
        if name not in by_name["state"]:
            optimizer.state.pop(p, None)
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
