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

from bpo.branching import BranchRule
from bpo.rollout.branch import decide, decide_with_hindsight
from bpo.rollout.budget import CostModel, root_width
from bpo.rollout.budget import _round as _round  # re-exported: tests import it from here
from bpo.rollout.config import ENTROPY_MODES, Prompter, RolloutConfig, SamplerPolicy
from bpo.rollout.config import PromptState as PromptState  # re-exported
from bpo.rollout.faults import RolloutError, _Fault, check_faults, checked_obs, end_rollout, fault
from bpo.rollout.records import _Cursor, _Pending, _Rollout, _TreeRun
from bpo.rollout.snapshots import abandon, release, restore, snapshot
from bpo.sandbox.protocol import Sandbox
from bpo.tree import Tree, Turn

__all__ = ["ENTROPY_MODES", "Prompter", "RolloutConfig", "RolloutEngine", "RolloutError"]


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
                            abandon(run)
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
                check_faults(self.faults, self.config.max_fault_frac, final=not (todo or live))
        except BaseException:
            # an error that retries cannot absorb (the policy, too many faults, Ctrl-C) aborts
            # the batch: the trees in flight give back their snapshots, or the sandboxes
            # (reused by the next run) would hold them for good
            for run in live.values():
                abandon(run)
            raise
        self.rule.end_iteration()
        self.costs.end_iteration()
        return [done[i] for i in range(len(tasks)) if i in done]

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
                obs = checked_obs(sandbox.reset(task, seed))
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
            run.pending.append(_Pending(0, snapshot(run), width - 1, 0))
            run.branches += 1
        run.cursor = _Cursor(0, 0, obs, fork_start=width >= 2)
        run.current = _Rollout(0, 1, len(run.pending), 0, None, False, 0, width >= 2, run.branches)
        run.compute.episodes += 1
        self.faults["rollouts"] += 1
        return run

    def _root_width(self, rng: random.Random | None) -> int:
        """Children of the root (:func:`bpo.rollout.budget.root_width`)."""
        return root_width(self.config, self.rule, self.costs, rng)

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
                fault(run, self.config.max_retries, self.faults)
        stepped = self._step_all([(run, action) for run, _, action in todo])
        for (run, s, action), (res, seconds) in zip(todo, stepped, strict=True):
            run.compute.sandbox_seconds += seconds
            try:
                if isinstance(res, BaseException):
                    raise res
                self._record(run, s, action, res)
            except Exception:
                fault(run, self.config.max_retries, self.faults)

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
            decide(run, cur, ent, self.rule, self.config, self.costs)
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
        checked_obs(res.observation)
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
            end_rollout(run)
        else:
            run.cursor = _Cursor(child, cur.depth, res.observation, fork_start=False)

    def _next_rollout(self, run: _TreeRun) -> bool:
        """Start the next queued fork if the budget allows; False when the tree is complete."""
        if run.backbone:  # non-causal ablation: choose branch points now, with hindsight
            decide_with_hindsight(run, self.rule, self.config.budget, self.costs)
        budget = self.config.budget
        while run.pending and not run.broken:
            p = run.pending[0]
            spent = budget.used(run.compute) >= budget.amount
            if budget.mode == "hard" and spent and run.compute.episodes >= budget.min_rollouts:
                for q in run.pending:
                    release(run, q.snapshot)
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
                obs = checked_obs(restore(run, p.snapshot))
            except Exception:
                fault(run, self.config.max_retries, self.faults)
                if run.cursor is None:
                    continue  # dropped: the next queued fork, if the sandbox still works
                return True
            run.cursor = _Cursor(p.node, p.depth, obs, fork_start=True)
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


def _turn_entropy(entropies: Sequence[float], mode: str) -> float:
    if not entropies:
        return 0.0
    if mode == "first":
        return float(entropies[0])
    return float(sum(entropies) / len(entropies))
