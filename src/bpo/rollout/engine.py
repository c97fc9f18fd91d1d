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
import dataclasses
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from bpo.branching import BranchPoint, BranchRule
from bpo.rollout.budget import Budget, Compute, CostModel
from bpo.sandbox.protocol import Observation, Sandbox, Snapshot
from bpo.tree import Tree, Turn

__all__ = ["ENTROPY_MODES", "Prompter", "RolloutConfig", "RolloutEngine", "RolloutError"]

ENTROPY_MODES = ("mean", "first", "greedy")


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
    with "first" (``bpo verify --engine-checks``). "greedy": the mean entropy along the greedy
    continuation from the state (a second, temperature-0 call on the cached context): a
    function of the state alone, so causal like "first", but it sees the decisions that come
    after an almost certain first token (``move`` | ``east``/``west``), at the cost of the probe's
    tokens, which count as generated tokens."""
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
    max_retries: int = 2
    """Times a rollout hit by a fault (the sandbox raised, returned a malformed result, or
    could not restore) is started again from its snapshot (or from a reset) before it is
    dropped; see :meth:`RolloutEngine.run` for what a drop means for the estimator."""
    max_fault_frac: float = 0.25
    """A batch stops with :class:`RolloutError` when more than this share of its rollouts is
    dropped (judged at its end from 4 drops, or during it from 20): faults that common are a
    broken setup, not noise."""
    invalid_penalty: float = 0.0
    """Subtracted from a turn's reward when its action is invalid: the sample ran out of
    tokens before a stop token, or (where the sandbox lists admissible actions) the command is
    not one of them. GiGPO's ALFWorld and WebShop runs use 0.1. Without it, tokens the parser
    ignores cost nothing, and a policy can drift into never stopping (measured on the CPU demo:
    tokens per turn 3.2 -> 6.9 in 12 iterations)."""

    step_threads: int = 1
    """Sandbox steps in flight at once, across trees: 1 = one after another; more where a
    step waits on another process or machine (Ray sandbox actors, containers)."""

    def __post_init__(self) -> None:
        if self.step_threads < 1:
            raise ValueError(f"step_threads must be >= 1, got {self.step_threads}")
        if self.root_width < 1:
            raise ValueError(f"root_width must be >= 1, got {self.root_width}")
        if self.max_root_width < self.root_width and self.fill_budget:
            raise ValueError(
                f"max_root_width ({self.max_root_width}) must be >= root_width ({self.root_width})"
            )
        if self.entropy not in ENTROPY_MODES:
            raise ValueError(
                f"unknown entropy mode {self.entropy!r}; valid: {', '.join(ENTROPY_MODES)}"
            )
        if self.max_steps < 1 or self.concurrency < 1:
            raise ValueError("max_steps and concurrency must be >= 1")
        if self.max_retries < 0 or not 0.0 <= self.max_fault_frac <= 1.0:
            raise ValueError("max_retries must be >= 0 and max_fault_frac in [0, 1]")


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


class RolloutError(RuntimeError):
    """Too many rollouts of a batch were lost to faults, or the policy kept failing."""


class _Fault(Exception):
    """A sandbox result that breaks the protocol (wrapped so that it is handled as a fault)."""


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
        self._threads: ThreadPoolExecutor | None = None
        self.costs = CostModel(config.max_steps, int(getattr(sampling, "max_new_tokens", 32)))
        self.faults: dict[str, int] = {}
        """Fault counts of the last :meth:`run`."""

    # -- public --------------------------------------------------------------------------
    def run(self, tasks: Sequence[tuple[str, int]]) -> list[Tree]:
        """Grow one tree per ``(task, seed)``; returns them in task order.

        Faults: a rollout whose sandbox raises, returns a malformed result or fails to restore
        is undone (its nodes, its branch points and their snapshots) and started again from its
        snapshot, or from a reset for the root backbone, up to ``max_retries`` times; then it is
        dropped. A sandbox that cannot restore or reset is replaced, and its tree ends with the
        rollouts already complete. A dropped rollout leaves its branch node with one child
        fewer: the remaining children are still i.i.d. draws of the policy at that state, so
        the leave-one-out estimators stay unbiased over them (a node left with one child gets
        no sibling baseline, as if it had not branched). This holds when faults are independent
        of the policy's actions; a fault that some action provokes makes the estimate one for
        the policy conditioned on no fault. A tree with no complete rollout is left out of the
        result. Counts are in each tree's ``compute`` (``retries``, ``failed_rollouts``) and in
        :attr:`faults`; the batch stops with :class:`RolloutError` beyond ``max_fault_frac``.
        """
        todo = deque(enumerate(tasks))
        free = self._ensure_sandboxes(min(self.config.concurrency, len(tasks)))
        live: dict[int, _TreeRun] = {}
        done: dict[int, Tree] = {}
        self.faults = {"retries": 0, "failed_rollouts": 0, "failed_trees": 0, "policy_retries": 0,
                       "replaced_sandboxes": 0, "rollouts": 0}  # fmt: skip
        try:
            while todo or live:
                while todo and free:
                    i, (task, seed) = todo.popleft()
                    run = self._start(task, seed, free.pop())
                    if run is None:
                        free.append(self._replace(None))
                        self.faults["failed_trees"] += 1
                    else:
                        live[i] = run
                ready = [i for i, r in live.items() if r.cursor is not None]
                if ready:
                    self._turn([live[i] for i in ready])
                for i in list(live):
                    run = live[i]
                    if run.cursor is None and not self._next_rollout(run):
                        del live[i]
                        if run.broken:
                            self._abandon(run)
                            run.sandbox = self._replace(run.sandbox)
                        if run.tree.leaves() != [0]:
                            done[i] = self._finish(run)
                            if run.dirty or done[i].meta["live_snapshots_after"]:
                                # a leak or a failed release: do not hand this one on
                                run.sandbox = self._replace(run.sandbox)
                        elif run.broken and not run.restarted:  # nothing kept: start it over
                            again = self._start(run.tree.task, run.tree.seed, run.sandbox)
                            if again is not None:
                                again.restarted = True
                                live[i] = again
                                continue
                            run.sandbox = self._replace(None)
                            self.faults["failed_trees"] += 1
                        else:  # not one complete rollout
                            self.faults["failed_trees"] += 1
                        free.append(run.sandbox)
                self._check_faults(final=not (todo or live))
        except BaseException:
            # an error that retries cannot absorb (the policy, too many faults, Ctrl-C) aborts
            # the batch: the trees in flight give back their snapshots, or the sandboxes
            # (reused by the next run) would hold them for good
            for run in live.values():
                self._abandon(run)
            raise
        self.rule.end_iteration()
        self.costs.end_iteration()
        return [done[i] for i in range(len(tasks)) if i in done]

    def _check_faults(self, final: bool) -> None:
        """Over the bound: at the end of the batch (at least 4 lost), or already during it
        once the loss is beyond doubt (at least 20 lost)."""
        f, cap = self.faults, self.config.max_fault_frac
        lost = f["failed_rollouts"]
        if lost >= (4 if final else 20) and lost > cap * max(f["rollouts"], 1):
            raise RolloutError(
                f"{lost} of {f['rollouts']} rollouts were lost to sandbox faults (more than "
                f"max_fault_frac={cap}); check the sandbox (bpo check-sandbox) or its resources"
            )

    def _replace(self, sandbox: Sandbox | None) -> Sandbox:
        """A fresh sandbox in place of a broken one (closed, errors ignored)."""
        fresh = self._factory()
        if sandbox is not None:
            with contextlib.suppress(Exception):
                sandbox.close()
            self._sandboxes = [fresh if s is sandbox else s for s in self._sandboxes]
        else:
            self._sandboxes.append(fresh)
        self.faults["replaced_sandboxes"] += 1
        return fresh

    def close(self) -> None:
        for sb in self._sandboxes:
            sb.close()
        self._sandboxes = []
        if self._threads is not None:
            self._threads.shutdown()
            self._threads = None

    # -- phases ----------------------------------------------------------------------------
    def _ensure_sandboxes(self, n: int) -> list[Sandbox]:
        while len(self._sandboxes) < n:
            self._sandboxes.append(self._factory())
        return list(self._sandboxes[:n])

    def _start(self, task: str, seed: int, sandbox: Sandbox) -> _TreeRun | None:
        """Reset a sandbox to the task and start the root backbone; None when the reset keeps
        failing (the sandbox is then closed; the caller replaces it)."""
        for attempt in range(self.config.max_retries + 1):
            try:
                t0 = time.perf_counter()
                obs = self._checked_obs(sandbox.reset(task, seed))
                break
            except Exception:
                if attempt == self.config.max_retries:
                    with contextlib.suppress(Exception):
                        sandbox.close()
                    self._sandboxes = [s for s in self._sandboxes if s is not sandbox]
                    return None
                self.faults["retries"] += 1
                sandbox = self._replace(sandbox)
        run = _TreeRun(Tree(task, seed), sandbox, rng=random.Random(f"budget-{seed}"))
        run.compute.sandbox_seconds += time.perf_counter() - t0
        state = self.prompter.start(obs.instruction, obs.text, obs.admissible)
        run.tree.add_root(state.ids, obs.text, sandbox.fingerprint())
        run.prompts[0] = state
        width = self._root_width(run.rng)
        run.root_width = width
        run.wanted = width
        if width >= 2:
            run.tree.nodes[0].branch_k = width
            run.pending.append(_Pending(0, self._snapshot(run), width - 1, 0))
            run.branches += 1
        run.cursor = _Cursor(0, 0, obs, fork_start=width >= 2)
        run.current = _Rollout(0, 1, len(run.pending), 0, None, False, 0, width >= 2, run.branches)
        run.compute.episodes += 1
        self.faults["rollouts"] += 1
        return run

    def _root_width(self, rng: random.Random | None) -> int:
        """Children of the root, fixed before any of them is sampled, from the costs of other,
        finished trees (causal). In the expected-budget mode an independent group (a rule that
        never branches) gets as many episodes as the budget buys at the expected episode cost
        (at least ``min_rollouts``, at most ``root_width``); with ``fill_budget`` a branching
        tree gets as many backbones as the budget buys at the expected cost of a backbone with
        the forks its rule asks for (at least ``root_width``, at most ``max_root_width``).
        "As many as the budget buys" is rounded at random (:func:`_round`), so that the
        expected cost matches the budget: rounding down left up to one backbone's cost unspent
        per tree (BPO spent 0.71x the groups' tokens in the default comparison)."""
        cfg, b = self.config, self.config.budget
        if b.mode != "expected":
            return cfg.root_width
        if getattr(self.rule, "k", 2) == 1:
            if cfg.root_width < 2:
                return cfg.root_width
            n = _round(b.amount / max(self.costs.rollout_cost(b.unit, 0), 1e-9), rng)
            return max(b.min_rollouts, min(cfg.root_width, n))
        per_child = self.costs.root_child_cost(b.unit) if cfg.fill_budget else None
        if per_child is None:
            return cfg.root_width
        n = _round(b.amount / max(per_child, 1e-9), rng)
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
        """Largest K <= k whose K - 1 forks fit in the budget left (expected mode), the number
        of forks that fit rounded at random (:func:`_round`); the budget never cuts what is
        already queued, so K is fixed before any child is sampled."""
        b = self.config.budget
        if b.mode != "expected" or k < 2:
            return k
        avail = b.amount - b.used(run.compute) - self._reserved(run)
        fork = max(self.costs.rollout_cost(b.unit, step), 1e-9)
        return min(k, 1 + _round(max(avail, 0.0) / fork, run.rng))

    def _turn(self, runs: list[_TreeRun]) -> None:
        """1. batch the policy over every tree's cursor; 2. branch decision; 3. step sandboxes."""
        contexts = [list(r.prompts[r.cursor.node].ids) for r in runs]  # type: ignore[union-attr]
        t0 = time.perf_counter()
        samples = self._sample(contexts, self.sampling)
        probes: list[object | None] = [None] * len(runs)
        if self.config.entropy == "greedy" and self.rule.causal:
            need = [i for i, r in enumerate(runs) if not r.cursor.fork_start]  # type: ignore[union-attr]
            greedy = dataclasses.replace(self.sampling, temperature=0.0)  # type: ignore[type-var]
            got = self._sample([contexts[i] for i in need], greedy) if need else []
            for i, (probe,) in zip(need, got, strict=True):
                probes[i] = probe
        dt = (time.perf_counter() - t0) / len(runs)
        todo: list[tuple[_TreeRun, object, str]] = []
        for run, ctx, (s,), probe in zip(runs, contexts, samples, probes, strict=True):
            run.compute.policy_seconds += dt
            run.compute.generated_tokens += len(s.action_ids)
            run.compute.prefill_tokens += int(getattr(s, "prefill_tokens", len(ctx)))
            run.compute.context_tokens += len(ctx)
            if probe is not None:
                run.compute.generated_tokens += len(probe.action_ids)
                run.compute.probe_tokens += len(probe.action_ids)
            try:
                todo.append((run, s, self._prepare(run, s, probe)))
            except Exception:
                self._fault(run)
        stepped = self._step_all([(run, action) for run, _, action in todo])
        for (run, s, action), (res, seconds) in zip(todo, stepped, strict=True):
            run.compute.sandbox_seconds += seconds
            try:
                if isinstance(res, BaseException):
                    raise res
                self._record(run, s, action, res)
            except Exception:
                self._fault(run)

    def _step_all(self, steps: list[tuple[_TreeRun, str]]) -> list[tuple[object, float]]:
        """Each tree's sandbox takes its action: one after another, or ``step_threads`` at a
        time (the sandboxes are independent, so the order of the steps does not matter; every
        decision that does -- the branch rule, the budget -- was taken before). Returns
        ``(result or the exception raised, seconds)`` per step."""

        def one(item: tuple[_TreeRun, str]) -> tuple[object, float]:
            t0 = time.perf_counter()
            try:
                res: object = item[0].sandbox.step(item[1])
            except Exception as e:
                res = e
            return res, time.perf_counter() - t0

        threads = min(self.config.step_threads, len(steps))
        if threads <= 1:
            return [one(item) for item in steps]
        if self._threads is None or self._threads._max_workers < threads:
            if self._threads is not None:
                self._threads.shutdown()
            self._threads = ThreadPoolExecutor(threads, thread_name_prefix="bpo-step")
        return list(self._threads.map(one, steps))

    def _sample(self, contexts: list[list[int]], params: object) -> list:
        """One policy call, retried as a whole when the backend fails mid-batch."""
        for attempt in range(self.config.max_retries + 1):
            try:
                return self.policy.sample(contexts, 1, params)
            except Exception as e:
                if attempt == self.config.max_retries:
                    raise RolloutError(
                        f"the policy failed {attempt + 1} times in a row on a batch of "
                        f"{len(contexts)} contexts: {type(e).__name__}: {e}"
                    ) from e
                self.faults["policy_retries"] += 1
        raise AssertionError("unreachable")

    def _prepare(self, run: _TreeRun, s, probe=None) -> str:
        """Before the step: the turn's entropy, the branch decision, the action text."""
        cur = run.cursor
        assert cur is not None
        node = run.tree.nodes[cur.node]
        if probe is not None:  # "greedy": the state's greedy continuation
            ent = _turn_entropy(probe.entropies, "mean")
        else:
            mode = self.config.entropy
            ent = _turn_entropy(s.entropies, "first" if mode == "greedy" else mode)
        if node.entropy is None:
            node.entropy = ent
        if not cur.fork_start:
            self._decide(run, cur, ent)
        return self.parse_action(s.text, cur.observation.admissible)

    def _record(self, run: _TreeRun, s, action: str, res) -> None:
        """After the step: the turn and its child node; the rollout goes on or ends."""
        cur = run.cursor
        assert cur is not None
        tree, node = run.tree, run.tree.nodes[cur.node]
        admissible = cur.observation.admissible
        if not (isinstance(getattr(res, "reward", None), (int, float))
                and math.isfinite(res.reward)):  # fmt: skip
            raise _Fault(f"step returned a malformed result: {res!r}"[:300])
        self._checked_obs(res.observation)
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
            self._end_rollout(run)
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
        while run.pending and not run.broken:
            p = run.pending[0]
            spent = budget.used(run.compute) >= budget.amount
            if budget.mode == "hard" and spent and run.compute.episodes >= budget.min_rollouts:
                for q in run.pending:
                    self._release(run, q.snapshot)
                run.pending.clear()
                return False
            p.forks_left -= 1
            last = p.forks_left == 0
            if last:
                run.pending.popleft()
            run.current = _Rollout(p.node, len(run.tree), len(run.pending), len(run.backbone),
                                   p.snapshot, last, p.depth, True, run.branches)  # fmt: skip
            run.compute.episodes += 1
            self.faults["rollouts"] += 1
            try:
                obs = self._checked_obs(self._restore(run, p.snapshot))
            except Exception:
                self._fault(run)
                if run.cursor is None:
                    continue  # dropped: the next queued fork, if the sandbox still works
                return True
            run.cursor = _Cursor(p.node, p.depth, obs, fork_start=True)
            return True
        return False

    # -- faults ------------------------------------------------------------------------------
    @staticmethod
    def _checked_obs(obs: object) -> Observation:
        if not isinstance(getattr(obs, "text", None), str):
            raise _Fault(f"the sandbox returned a malformed observation: {obs!r}"[:300])
        return obs  # type: ignore[return-value]

    def _end_rollout(self, run: _TreeRun) -> None:
        cur = run.current
        if cur is not None and cur.owns_snapshot and cur.snapshot is not None:
            self._release(run, cur.snapshot)
        run.current = None

    def _fault(self, run: _TreeRun) -> None:
        """The rollout in flight hit a fault: undo it, then start it again or drop it."""
        cur = run.current
        assert cur is not None
        self._undo(run, cur)
        cur.attempts += 1
        while cur.attempts <= self.config.max_retries:
            run.compute.retries += 1
            self.faults["retries"] += 1
            try:
                if cur.snapshot is None:  # the root backbone: the task from its reset
                    obs = self._checked_obs(run.sandbox.reset(run.tree.task, run.tree.seed))
                else:
                    obs = self._checked_obs(self._restore(run, cur.snapshot))
            except Exception:
                run.broken = True  # cannot get back to a known state in this sandbox
                break
            run.cursor = _Cursor(cur.start, cur.depth, obs, fork_start=cur.fork_start)
            return
        run.compute.failed_rollouts += 1
        self.faults["failed_rollouts"] += 1
        run.cursor = None
        with contextlib.suppress(Exception):
            self._end_rollout(run)
        run.current = None
        if run.broken:  # what is still queued cannot be restored here
            self._abandon(run)

    def _undo(self, run: _TreeRun, cur: _Rollout) -> None:
        """Remove what the failed rollout added: its nodes, prompts, branch points (their
        snapshots released) and, for a root backbone of width 1, the root's decision."""
        tree = run.tree
        while len(run.pending) > cur.pending:
            with contextlib.suppress(Exception):
                self._release(run, run.pending.pop().snapshot)
        for _, snap, _ in run.backbone[cur.backbone :]:
            with contextlib.suppress(Exception):
                self._release(run, snap)
        del run.backbone[cur.backbone :]
        if cur.nodes < len(tree):
            tree.truncate(cur.nodes)
        for node in [n for n in run.prompts if n >= cur.nodes]:
            del run.prompts[node]
        if cur.snapshot is None and run.root_width < 2:
            tree.nodes[0].branch_k = 1
        run.branches = cur.branches
        run.cursor = None

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
        try:
            run.sandbox.release(snap)
        except Exception:
            run.dirty = True  # its snapshots are no longer accounted for: replace it after

    def _abandon(self, run: _TreeRun) -> None:
        """Release every snapshot a dropped tree still holds; errors here are secondary."""
        snaps = [p.snapshot for p in run.pending] + [s for _, s, _ in run.backbone]
        cur = run.current
        if cur is not None and cur.owns_snapshot and cur.snapshot is not None:
            snaps.append(cur.snapshot)  # the last fork's snapshot, held until it is over
        run.pending.clear()
        run.backbone = []
        run.current = None
        for snap in snaps:
            with contextlib.suppress(Exception):
                run.sandbox.release(snap)


def _turn_entropy(entropies: Sequence[float], mode: str) -> float:
    if not entropies:
        return 0.0
    if mode == "first":
        return float(entropies[0])
    return float(sum(entropies) / len(entropies))


def _round(x: float, rng: random.Random | None) -> int:
    """``x`` rounded down or up at random, up with probability its fractional part, so that
    the expected result is ``x``: a budget that buys 2.6 rollouts buys 3 in 60% of trees (the
    draw is independent of the samples, so the decision stays causal). Down without ``rng``."""
    n = math.floor(x)
    if rng is not None and rng.random() < x - n:
        n += 1
    return int(n)
