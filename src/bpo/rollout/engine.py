"""The rollout engine: grows one tree per task (DESIGN section 3), many tasks at once.

One engine serves every method so that they are compared under one harness:

* BPO: ``root_width`` backbones (1 or more) from the task's initial state; at every decision a
  causal branch rule decides whether the state becomes a branch node with K children; if so
  the sandbox is snapshotted *before* the backbone's action is applied and K - 1 forks are
  queued; each fork later restores the snapshot, samples a fresh action i.i.d. from the same
  context and rolls out to termination (forks may branch again if the rule allows).
* Independent groups (GRPO, RLOO, GiGPO, PPO): ``rule = none`` and ``root_width = N``, i.e. a
  root with N children and no other branch node.

Each tree runs in one sandbox (native snapshots are valid only in the instance that made them),
so its rollouts run one after another; concurrency comes from many tasks in flight, whose
policy calls are batched together. The per-task :class:`~bpo.rollout.budget.Budget` decides,
causally, how many children the root (group size) and each branch node get, so that every
method spends the same expected cost in the chosen unit (see ``bpo.rollout.budget``).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bpo.branching import BranchPoint, BranchRule
from bpo.rollout.budget import Budget, Compute, CostModel
from bpo.sandbox.protocol import Observation, Sandbox, Snapshot
from bpo.tree import Tree, Turn

__all__ = ["ENTROPY_MODES", "Prompter", "RolloutConfig", "RolloutEngine"]

ENTROPY_MODES = ("mean", "first")


class PromptState(Protocol):
    ids: tuple[int, ...]
    """The whole context for the next action."""
    new_ids: tuple[int, ...]
    """Tokens appended after the action (all of ``ids`` after a start or a reset)."""
    reset: bool


class Prompter(Protocol):
    """Builds the policy's context at the token level, append-only
    (:class:`bpo.policy.prompts.PromptBuilder`)."""

    def start(
        self, instruction: str, observation: str, admissible: Sequence[str] | None
    ) -> PromptState: ...

    def extend(
        self,
        state: PromptState,
        action_ids: Sequence[int],
        observation: str,
        admissible: Sequence[str] | None,
    ) -> PromptState: ...


class SamplerPolicy(Protocol):
    """The part of :class:`bpo.policy.protocol.Policy` the engine uses."""

    def sample(self, contexts, n=1, params=None): ...  # -> list[list[TurnSample]]


@dataclass(frozen=True)
class RolloutConfig:
    root_width: int = 1
    """Children of the root: 1 = a single backbone (BPO default), N = an independent group."""
    max_steps: int = 30
    """Turns per rollout before it is truncated."""
    budget: Budget = field(default_factory=Budget)
    entropy: str = "first"
    """Turn entropy fed to the branch rule: the first action token's ("first", default) or the
    mean over the action's tokens ("mean"). The first token's entropy depends only on the state,
    so the branch decision is causal and the backbone's action an exact i.i.d. sibling of the
    forks. The mean also depends on the sampled action itself, which makes the decision look at
    the backbone's own action: the exact study measured a bias (z = 5.8) with "mean" and none
    with "first" (``bpo verify --engine-checks``)."""
    concurrency: int = 8
    """Trees grown at once (one sandbox each); their policy calls are batched together."""
    policy_version: int = 0
    fill_budget: bool = False
    """Expected-budget mode, branching rules: widen the root (more backbones, each branching
    under the rule) so that a tree's expected cost reaches the budget, as an independent group's
    does; ``root_width`` is then the least width. Without it a stingy rule leaves budget unspent
    and the tree is compared at less compute than the groups."""
    max_root_width: int = 64
    """Upper bound on the root's children when the budget decides them (groups and
    ``fill_budget``)."""
    invalid_penalty: float = 0.0
    """Subtracted from a turn's reward when its action is invalid: the sample ran out of
    tokens before a stop token, or (where the sandbox lists admissible actions) the command is
    not one of them. GiGPO's ALFWorld and WebShop runs use 0.1. Without it, tokens the parser
    ignores cost nothing, and a policy can drift into never stopping (measured on the CPU demo:
    tokens per turn 3.2 -> 6.9 in 12 iterations)."""

    def __post_init__(self) -> None:
        if self.root_width < 1:
            raise ValueError(f"root_width must be >= 1, got {self.root_width}")
        if self.max_root_width < self.root_width and self.fill_budget:
            raise ValueError(
                f"max_root_width ({self.max_root_width}) must be >= root_width ({self.root_width})"
            )
        if self.entropy not in ENTROPY_MODES:
            raise ValueError(f"unknown entropy mode {self.entropy!r}; valid: mean, first")
        if self.max_steps < 1 or self.concurrency < 1:
            raise ValueError("max_steps and concurrency must be >= 1")


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
    started: float = field(default_factory=time.perf_counter)
    backbone: list[tuple[BranchPoint, Snapshot, int]] = field(default_factory=list)
    prompts: dict[int, PromptState] = field(default_factory=dict)
    """The prompt state at each non-terminal node (the context its actions were sampled from)."""


class RolloutEngine:
    """Grows rollout trees for a batch of tasks with a policy, a prompter and a branch rule."""

    def __init__(
        self,
        policy: SamplerPolicy,
        prompter: Prompter,
        parse_action: Callable[[str, Sequence[str] | None], str],
        rule: BranchRule,
        sandbox_factory: Callable[[], Sandbox],
        config: RolloutConfig,
        sampling: object | None = None,
    ) -> None:
        self.policy = policy
        self.prompter = prompter
        self.parse_action = parse_action
        self.rule = rule
        self.config = config
        self.sampling = sampling
        self._factory = sandbox_factory
        self._sandboxes: list[Sandbox] = []
        self.costs = CostModel(config.max_steps, int(getattr(sampling, "max_new_tokens", 32)))

    # -- public --------------------------------------------------------------------------
    def run(self, tasks: Sequence[tuple[str, int]]) -> list[Tree]:
        """Grow one tree per ``(task, seed)``; returns them in task order."""
        todo = deque(enumerate(tasks))
        free = self._ensure_sandboxes(min(self.config.concurrency, len(tasks)))
        live: dict[int, _TreeRun] = {}
        done: dict[int, Tree] = {}
        try:
            while todo or live:
                while todo and free:
                    i, (task, seed) = todo.popleft()
                    live[i] = self._start(task, seed, free.pop())
                ready = [i for i, r in live.items() if r.cursor is not None]
                if ready:
                    self._turn([live[i] for i in ready])
                for i in list(live):
                    run = live[i]
                    if run.cursor is None and not self._next_rollout(run):
                        done[i] = self._finish(run)
                        free.append(run.sandbox)
                        del live[i]
        except BaseException:
            # an error (a dead engine, say) aborts the batch; there are no retries yet, so the
            # trees in flight are dropped and must give back their snapshots, or the sandboxes
            # (reused by the next run) would hold them for good
            for run in live.values():
                self._abandon(run)
            raise
        self.rule.end_iteration()
        self.costs.end_iteration()
        return [done[i] for i in range(len(tasks))]

    def close(self) -> None:
        for sb in self._sandboxes:
            sb.close()
        self._sandboxes = []

    # -- phases ----------------------------------------------------------------------------
    def _ensure_sandboxes(self, n: int) -> list[Sandbox]:
        while len(self._sandboxes) < n:
            self._sandboxes.append(self._factory())
        return list(self._sandboxes[:n])

    def _start(self, task: str, seed: int, sandbox: Sandbox) -> _TreeRun:
        t0 = time.perf_counter()
        obs = sandbox.reset(task, seed)
        run = _TreeRun(Tree(task, seed), sandbox)
        run.compute.sandbox_seconds += time.perf_counter() - t0
        state = self.prompter.start(obs.instruction, obs.text, obs.admissible)
        run.tree.add_root(state.ids, obs.text, sandbox.fingerprint())
        run.prompts[0] = state
        width = self._root_width()
        run.root_width = width
        run.wanted = width
        if width >= 2:
            run.tree.nodes[0].branch_k = width
            run.pending.append(_Pending(0, self._snapshot(run), width - 1, 0))
            run.branches += 1
        run.cursor = _Cursor(0, 0, obs, fork_start=width >= 2)
        run.compute.episodes += 1
        return run

    def _root_width(self) -> int:
        """Children of the root, fixed before any of them is sampled, from the costs of other,
        finished trees (causal). In the expected-budget mode an independent group (a rule that
        never branches) gets as many episodes as the budget buys at the expected episode cost
        (at least ``min_rollouts``, at most ``root_width``); with ``fill_budget`` a branching
        tree gets as many backbones as the budget buys at the expected cost of a backbone with
        the forks its rule asks for (at least ``root_width``, at most ``max_root_width``)."""
        cfg, b = self.config, self.config.budget
        if b.mode != "expected":
            return cfg.root_width
        if getattr(self.rule, "k", 2) == 1:
            if cfg.root_width < 2:
                return cfg.root_width
            n = int(b.amount // max(self.costs.rollout_cost(b.unit, 0), 1e-9))
            return max(b.min_rollouts, min(cfg.root_width, n))
        per_child = self.costs.root_child_cost(b.unit) if cfg.fill_budget else None
        if per_child is None:
            return cfg.root_width
        n = int(b.amount // max(per_child, 1e-9))
        return max(cfg.root_width, min(cfg.max_root_width, n))

    def _reserved(self, run: _TreeRun) -> float:
        """Expected cost still to come from queued forks and the rollout in flight (expected
        mode; the hard mode reserves nothing)."""
        if self.config.budget.mode != "expected":
            return 0.0
        unit = self.config.budget.unit
        tree = run.tree
        total = sum(
            p.forks_left * self.costs.rollout_cost(unit, tree.nodes[p.node].step)
            for p in run.pending
        )
        if run.cursor is not None:
            total += self.costs.rollout_cost(unit, tree.nodes[run.cursor.node].step)
        return total

    def _cap(self, run: _TreeRun, k: int, step: int) -> int:
        """Largest K <= k whose K - 1 forks fit in the budget left (expected mode); the budget
        never cuts what is already queued, so K is fixed before any child is sampled."""
        b = self.config.budget
        if b.mode != "expected" or k < 2:
            return k
        avail = b.amount - b.used(run.compute) - self._reserved(run)
        fork = max(self.costs.rollout_cost(b.unit, step), 1e-9)
        return min(k, 1 + int(max(avail, 0.0) // fork))

    def _turn(self, runs: list[_TreeRun]) -> None:
        """1. batch the policy over every tree's cursor; 2. branch decision; 3. step sandboxes."""
        contexts = [list(r.prompts[r.cursor.node].ids) for r in runs]  # type: ignore[union-attr]
        t0 = time.perf_counter()
        samples = self.policy.sample(contexts, 1, self.sampling)
        dt = (time.perf_counter() - t0) / len(runs)
        for run, ctx, (s,) in zip(runs, contexts, samples, strict=True):
            run.compute.policy_seconds += dt
            run.compute.generated_tokens += len(s.action_ids)
            run.compute.prefill_tokens += int(getattr(s, "prefill_tokens", len(ctx)))
            run.compute.context_tokens += len(ctx)
            self._apply(run, s)

    def _apply(self, run: _TreeRun, s) -> None:
        cur = run.cursor
        assert cur is not None
        tree, node = run.tree, run.tree.nodes[cur.node]
        ent = _turn_entropy(s.entropies, self.config.entropy)
        if node.entropy is None:
            node.entropy = ent
        if not cur.fork_start:
            self._decide(run, cur, ent)
        admissible = cur.observation.admissible
        action = self.parse_action(s.text, admissible)
        t0 = time.perf_counter()
        res = run.sandbox.step(action)
        run.compute.sandbox_seconds += time.perf_counter() - t0
        run.compute.sandbox_steps += 1
        cfg = self.config
        penalty = 0.0
        if s.finish_reason == "length" or (admissible and action not in admissible):
            run.compute.invalid_actions += 1
            penalty = cfg.invalid_penalty
        truncated = res.truncated or (node.step + 1 >= cfg.max_steps and not res.terminated)
        b = cfg.budget
        if (
            b.mode == "hard"
            and b.truncate
            and b.used(run.compute) >= b.amount
            and run.compute.episodes >= b.min_rollouts
        ):
            truncated = truncated or not res.terminated
        turn = Turn(
            tuple(s.action_ids), tuple(s.logprobs), tuple(s.entropies), action,
            float(res.reward) - penalty, bool(res.terminated), bool(truncated),
            cfg.policy_version, penalty,
        )  # fmt: skip
        done = turn.terminated or turn.truncated
        state = None
        if not done:
            state = self.prompter.extend(
                run.prompts[cur.node],
                s.action_ids,
                res.observation.text,
                res.observation.admissible,
            )
        child = tree.add_child(
            cur.node, turn, state.new_ids if state else (), res.observation.text,
            run.sandbox.fingerprint(), context_reset=bool(state and state.reset),
        )  # fmt: skip
        if state is not None:
            run.prompts[child] = state
        if done:
            run.compute.leaves += 1
            run.cursor = None
        else:
            run.cursor = _Cursor(child, cur.depth, res.observation, fork_start=False)

    def _decide(self, run: _TreeRun, cur: _Cursor, entropy: float) -> None:
        """The branch rule at the cursor's state (before its action is applied)."""
        point = BranchPoint(
            step=run.tree.nodes[cur.node].step,
            entropy=entropy,
            depth=cur.depth,
            branches_so_far=run.branches,
            budget_left=self.config.budget.left(run.compute, self._reserved(run)),
            horizon=self.config.max_steps,
        )
        if not self.rule.causal:
            if cur.depth == 0:  # the ablation looks at the finished backbone: keep every state
                run.backbone.append((point, self._snapshot(run), cur.node))
            return
        want = int(self.rule.decide(point))
        k = self._cap(run, want, point.step)
        run.wanted += max(want - 1, 0)
        if k >= 2:
            run.tree.nodes[cur.node].branch_k = k
            run.pending.append(_Pending(cur.node, self._snapshot(run), k - 1, cur.depth + 1))
            run.branches += 1

    def _next_rollout(self, run: _TreeRun) -> bool:
        """Start the next queued fork if the budget allows; False when the tree is complete."""
        if run.backbone:  # non-causal ablation: choose branch points now, with hindsight
            chosen = self.rule.select([p for p, _, _ in run.backbone])
            for point, snap, node in run.backbone:
                want = chosen.get(point.step, 1)
                run.wanted += max(want - 1, 0)
                k = self._cap(run, want, point.step)
                if k >= 2:
                    run.tree.nodes[node].branch_k = k
                    run.pending.append(_Pending(node, snap, k - 1, 1))
                    run.branches += 1
                else:
                    self._release(run, snap)
            run.backbone = []
        budget = self.config.budget
        while run.pending:
            p = run.pending[0]
            spent = budget.used(run.compute) >= budget.amount
            if budget.mode == "hard" and spent and run.compute.episodes >= budget.min_rollouts:
                for q in run.pending:
                    self._release(run, q.snapshot)
                run.pending.clear()
                return False
            obs = self._restore(run, p.snapshot)
            p.forks_left -= 1
            if p.forks_left == 0:
                run.pending.popleft()
                self._release(run, p.snapshot)
            run.cursor = _Cursor(p.node, p.depth, obs, fork_start=True)
            run.compute.episodes += 1
            return True
        return False

    def _finish(self, run: _TreeRun) -> Tree:
        tree = run.tree
        run.prompts.clear()
        run.compute.wall_seconds = time.perf_counter() - run.started
        tree.meta["compute"] = run.compute
        stats = run.sandbox.stats()
        tree.meta["live_snapshots_after"] = stats.live
        c = run.compute
        for leaf in tree.leaves():
            self.costs.observe(tree.nodes[leaf].step, c.generated_tokens, c.sandbox_steps)
        self.costs.observe_tree(c, run.wanted, run.root_width)
        return tree

    # -- snapshots -------------------------------------------------------------------------
    def _snapshot(self, run: _TreeRun) -> Snapshot:
        t0 = time.perf_counter()
        snap = run.sandbox.snapshot()
        run.compute.snapshot_seconds += time.perf_counter() - t0
        run.compute.snapshots += 1
        return snap

    def _restore(self, run: _TreeRun, snap: Snapshot) -> Observation:
        t0 = time.perf_counter()
        obs = run.sandbox.restore(snap)
        run.compute.snapshot_seconds += time.perf_counter() - t0
        run.compute.restores += 1
        return obs

    def _release(self, run: _TreeRun, snap: Snapshot) -> None:
        run.sandbox.release(snap)

    def _abandon(self, run: _TreeRun) -> None:
        """Release every snapshot a dropped tree still holds; errors here are secondary."""
        snaps = [p.snapshot for p in run.pending] + [s for _, s, _ in run.backbone]
        run.pending.clear()
        run.backbone = []
        for snap in snaps:
            with contextlib.suppress(Exception):
                run.sandbox.release(snap)


def _turn_entropy(entropies: Sequence[float], mode: str) -> float:
    if not entropies:
        return 0.0
    if mode == "first":
        return float(entropies[0])
    return float(sum(entropies) / len(entropies))
