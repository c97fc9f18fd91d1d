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
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["DataParallel"]


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
