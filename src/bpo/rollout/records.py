"""What the rollout engine (:mod:`bpo.rollout.engine`) keeps while it grows a tree: the tree
and its sandbox, the forks queued at its branch nodes, where the next action is sampled from,
and the rollout in flight (what a fault undoes)."""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

from bpo.branching import BranchPoint
from bpo.rollout.budget import Compute
from bpo.rollout.config import PromptState
from bpo.sandbox.protocol import Observation, Sandbox, Snapshot
from bpo.tree import Tree


@dataclass
class _Pending:
    node: int
    snapshot: Snapshot
    forks_left: int
    depth: int


@dataclass
class _Cursor:
    node: int
    depth: int
    observation: Observation
    fork_start: bool
    """True when the next sample is a fork's action at an existing branch node."""


@dataclass
class _Rollout:
    """The rollout in flight: where it started and what the tree held then, so that a fault
    can undo it and start it again."""

    start: int
    """The node it acts from first."""
    nodes: int
    """Nodes in the tree when it started (it owns the later ones)."""
    pending: int
    backbone: int
    """Lengths of the tree's branch queue and ablation list when it started."""
    snapshot: Snapshot | None
    """Where it restarts from (None: the root backbone, restarted by a reset)."""
    owns_snapshot: bool
    """The snapshot's last fork: release it when this rollout is over."""
    depth: int
    fork_start: bool
    branches: int = 0
    """The tree's branch count when it started."""
    attempts: int = 0


@dataclass
class _TreeRun:
    """One task's tree in progress, with its sandbox."""

    tree: Tree
    sandbox: Sandbox
    compute: Compute = field(default_factory=Compute)
    pending: deque[_Pending] = field(default_factory=deque)
    cursor: _Cursor | None = None
    branches: int = 0
    wanted: int = 0
    """Rollouts the branch rule asked for (run, or refused by the budget)."""
    root_width: int = 1
    current: _Rollout | None = None
    broken: bool = False
    """The sandbox failed to restore or reset: no further rollout can start in it."""
    dirty: bool = False
    """A release failed: the sandbox is replaced when the tree is done."""
    restarted: bool = False
    """Started over in a fresh sandbox after a broken one left it no complete rollout."""
    started: float = field(default_factory=time.perf_counter)
    backbone: list[tuple[BranchPoint, Snapshot, int]] = field(default_factory=list)
    prompts: dict[int, PromptState] = field(default_factory=dict)
    """The prompt state at each non-terminal node (the context its actions were sampled from)."""
    rng: random.Random | None = None
    """Rounds the budget's fractional rollout counts (:func:`_round`); seeded by the tree's
    seed, so it is independent of the samples and reproducible."""
