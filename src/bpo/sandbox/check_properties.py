"""The properties :func:`~bpo.sandbox.check.check_sandbox` checks, one method each, and the
likely cause named when one fails. Two sandboxes (``a`` and ``b``) run side by side; reference
trajectories recorded by the first property are what the others compare against."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bpo.sandbox.protocol import (
    Observation,
    Sandbox,
    SandboxError,
    Snapshot,
    SnapshotError,
    StepResult,
)

GARBAGE = (
    "",
    "xyzzy plugh",
    "🐍 ünïcödé 日本語 ?!",
    "look\ninventory\n",
    "take\tthe\x00key",
    "go " * 700,
    "   ",
    "))(({[",
    "take take take take",
)
"""Malformed actions: each must come back as an observation, never as an exception."""

_CAUSES = {
    "determinism": "the engine uses unseeded randomness, wall-clock time, hash()-ordered sets, "
    "or state shared between instances (module globals, caches)",
    "restore": "the snapshot misses part of the state (a Python-side tracker next to a C "
    "engine, a random generator), get_state() returns references that later "
    "steps mutate, or fingerprint() reads volatile data",
    "restore-many": "set_state()/restore keeps references into the snapshot that later steps "
    "mutate: copy the state when restoring",
    "isolation": "get_state()/snapshot returns live references that later steps mutate: "
    "return a copy",
    "release": "release() does not drop the snapshot, or stats() does not count it, or "
    "restore() accepts released or foreign handles",
    "invalid-actions": "the engine raises on text it cannot parse: catch that in the adapter "
    "and answer with an observation such as 'Nothing happens.'",
    "tree": "state leaks across snapshots, restores or resets (an engine-level cache, a "
    "shared interpreter, an RNG outside the snapshot)",
}


class SandboxCheckError(AssertionError):
    """A sandbox broke its contract; ``property`` names which part."""

    def __init__(self, prop: str, problem: str) -> None:
        super().__init__(f"[{prop}] {problem}\n  likely cause: {_CAUSES[prop]}")
        self.property = prop


@dataclass
class Traj:
    """A reference trajectory: observations and fingerprints after 0..n actions."""

    actions: list[str] = field(default_factory=list)
    obs: list[Observation] = field(default_factory=list)
    fps: list[str] = field(default_factory=list)
    results: list[StepResult] = field(default_factory=list)


class Properties:
    """The checks, in the order of :data:`PROPERTIES`; each returns what it exercised."""

    def __init__(
        self,
        a: Sandbox,
        b: Sandbox,
        tasks: Sequence[str],
        seed: int,
        max_steps: int,
        stress_nodes: int,
        rng_seed: int,
    ) -> None:
        self.a, self.b, self.tasks, self.seed = a, b, list(tasks), seed
        self.max_steps, self.stress_nodes, self.rng_seed = max_steps, stress_nodes, rng_seed
        self.trajs: dict[str, Traj] = {}
        self.steps = 0
        self.prop = "determinism"

    # -- helpers -------------------------------------------------------------------------
    def fail(self, problem: str) -> SandboxCheckError:
        return SandboxCheckError(self.prop, problem)

    def same(self, what: str, got: object, want: object) -> None:
        if got != want:
            raise self.fail(f"{what}: got {_short(got)}, expected {_short(want)}")

    def step(self, sb: Sandbox, action: str) -> StepResult:
        self.steps += 1
        try:
            result = sb.step(action)
        except SandboxError as e:
            if action in GARBAGE:
                raise SandboxCheckError(
                    "invalid-actions", f"step({action[:40]!r}) raised {e}"
                ) from e
            raise
        if not isinstance(result, StepResult) or not isinstance(result.observation, Observation):
            raise self.fail(
                f"step({action[:40]!r}) returned {type(result).__name__}, "
                "expected a StepResult holding an Observation"
            )
        if result.observation.done != (result.terminated or result.truncated):
            raise self.fail(
                f"step({action[:40]!r}): observation.done is "
                f"{result.observation.done} but terminated={result.terminated}, "
                f"truncated={result.truncated}"
            )
        return result

    def choose(self, rng: random.Random, sb: Sandbox) -> str:
        """An admissible action, the expert's, or (sometimes) garbage."""
        obs, expert = sb.observation(), sb.expert_action()
        if rng.random() < 0.1:
            return rng.choice(GARBAGE[:5])
        if obs.admissible and (expert is None or rng.random() < 0.5):
            return rng.choice(sorted(obs.admissible))
        return expert if expert is not None else rng.choice(GARBAGE[:5])

    def follow(self, sb: Sandbox, traj: Traj, start: int, stop: int, what: str) -> None:
        """Step ``sb`` through ``traj.actions[start:stop]``, comparing with the reference."""
        for i in range(start, stop):
            r = self.step(sb, traj.actions[i])
            want = traj.results[i]
            self.same(
                f"{what}: outcome of action {i + 1} ({traj.actions[i][:40]!r})",
                _outcome(r),
                _outcome(want),
            )
            self.same(
                f"{what}: fingerprint after action {i + 1}", sb.fingerprint(), traj.fps[i + 1]
            )

    def at(self, sb: Sandbox, traj: Traj, k: int, obs: Observation, what: str) -> None:
        self.same(f"{what}: observation returned by restore", obs, traj.obs[k])
        self.same(f"{what}: observation() after restore", sb.observation(), traj.obs[k])
        self.same(f"{what}: fingerprint after restore", sb.fingerprint(), traj.fps[k])

    def walk(self, task: str, k: int) -> Traj:
        traj = self.trajs[task]
        self.same(f"reset({task!r}) of a used sandbox", self.a.reset(task, self.seed), traj.obs[0])
        self.follow(self.a, traj, 0, k, f"{task}, replaying the reference")
        return traj

    # -- properties ----------------------------------------------------------------------
    def determinism(self) -> str:
        for n, task in enumerate(self.tasks):
            rng = random.Random(f"{self.rng_seed}:{n}")
            traj = self.trajs[task] = Traj()
            oa, ob = self.a.reset(task, self.seed), self.b.reset(task, self.seed)
            self.same(f"reset({task!r}, {self.seed}) in two fresh sandboxes", oa, ob)
            self.same(f"{task}: observation() after reset", self.a.observation(), oa)
            traj.obs.append(oa)
            traj.fps.append(self.a.fingerprint())
            self.same(f"{task}: fingerprint after reset", self.b.fingerprint(), traj.fps[0])
            self.same(f"{task}: fingerprint() called twice", self.a.fingerprint(), traj.fps[0])
            while len(traj.actions) < self.max_steps and not traj.obs[-1].done:
                action = self.choose(rng, self.a)
                self.same(
                    f"{task}: expert action after {len(traj.actions)} steps",
                    self.b.expert_action(),
                    self.a.expert_action(),
                )
                ra, rb = self.step(self.a, action), self.step(self.b, action)
                self.same(
                    f"{task}: outcome of action {len(traj.actions) + 1} ({action[:40]!r})"
                    " in two sandboxes",
                    _outcome(rb),
                    _outcome(ra),
                )
                traj.actions.append(action)
                traj.results.append(ra)
                traj.obs.append(ra.observation)
                traj.fps.append(self.a.fingerprint())
                self.same(
                    f"{task}: fingerprint after action {len(traj.actions)}",
                    self.b.fingerprint(),
                    traj.fps[-1],
                )
        n = sum(len(t.actions) for t in self.trajs.values())
        return f"{len(self.tasks)} task(s), {n} actions in each of two sandboxes"

    def restore(self) -> str:
        for task in self.tasks:
            traj = self.trajs[task]
            k, end = len(traj.actions) // 2, len(traj.actions)
            self.walk(task, k)
            snap = self.a.snapshot()
            self.same(f"{task}: snapshot fingerprint", snap.fingerprint, traj.fps[k])
            self.same(
                f"{task}: snapshot action prefix", tuple(snap.actions), tuple(traj.actions[:k])
            )
            self.follow(self.a, traj, k, end, f"{task}, first continuation")
            self.at(self.a, traj, k, self.a.restore(snap), f"{task}, step {k}")
            self.follow(self.a, traj, k, end, f"{task}, continuation after restore")
            self.a.release(snap)
        return f"{len(self.tasks)} snapshot(s) at mid-episode, continued twice"

    def restore_many(self) -> str:
        rng = random.Random(f"{self.rng_seed}:many")
        for task in self.tasks:
            traj = self.trajs[task]
            k, end = len(traj.actions) // 2, len(traj.actions)
            self.walk(task, k)
            snap = self.a.snapshot()
            for i in range(4):
                self.at(self.a, traj, k, self.a.restore(snap), f"{task}, restore #{i + 1}")
                self.follow(self.a, traj, k, min(k + 1, end), f"{task}, after restore #{i + 1}")
                for _ in range(2 if not self.a.observation().done else 0):
                    self.step(self.a, self.choose(rng, self.a))
            self.a.release(snap)
        return f"each of {len(self.tasks)} snapshot(s) restored 4 times with steps in between"

    def isolation(self) -> str:
        for task in self.tasks:
            traj = self.trajs[task]
            n = len(traj.actions)
            k1, k2 = n // 3, (2 * n) // 3
            self.walk(task, k1)
            s1 = self.a.snapshot()
            self.follow(self.a, traj, k1, k2, task)
            s2, twin = self.a.snapshot(), self.a.snapshot()
            self.follow(self.a, traj, k2, n, task)
            self.at(self.a, traj, k1, self.a.restore(s1), f"{task}, older snapshot")
            self.at(self.a, traj, k2, self.a.restore(s2), f"{task}, newer snapshot")
            self.follow(self.a, traj, k2, n, f"{task}, after the newer snapshot")
            self.a.release(s2)
            self.at(self.a, traj, k2, self.a.restore(twin), f"{task}, twin of a released one")
            self.at(self.a, traj, k1, self.a.restore(s1), f"{task}, older snapshot again")
            self.follow(self.a, traj, k1, n, f"{task}, after the older snapshot")
            self.a.release(s1)
            self.a.release(twin)
        return f"{len(self.tasks)} x 3 snapshots interleaved with steps and restores"

    def release(self) -> str:
        stats = self.a.stats()
        self.same("live snapshots after releasing every snapshot", stats.live, 0)
        task = self.tasks[0]
        self.a.reset(task, self.seed)
        snaps = [self.a.snapshot() for _ in range(3)]
        self.same("stats().live with 3 snapshots", self.a.stats().live, 3)
        self.same("stats().taken", self.a.stats().taken, stats.taken + 3)
        for s in snaps:
            self.a.release(s)
        after = self.a.stats()
        self.same("stats().live after release", after.live, 0)
        self.same("stats().live_bytes after release", after.live_bytes, 0)
        self._refused(lambda: self.a.restore(snaps[0]), "restore of a released snapshot", "releas")
        self._refused(lambda: self.a.release(snaps[0]), "a second release", "releas")
        self.b.reset(task, self.seed)
        foreign = self.b.snapshot()
        try:
            self._refused(
                lambda: self.a.restore(foreign), "restore of another sandbox's snapshot", ""
            )
        finally:
            self.b.release(foreign)
        return "3 snapshots released; released and foreign handles refused"

    def _refused(self, call: Callable[[], object], what: str, says: str) -> None:
        try:
            call()
        except SnapshotError as e:
            if says not in str(e).lower():
                raise self.fail(f"{what} raised SnapshotError without saying why: {e}") from e
            return
        except Exception as e:
            raise self.fail(f"{what} raised {e!r}, expected SnapshotError") from e
        raise self.fail(f"{what} was accepted, expected SnapshotError")

    def invalid_actions(self) -> str:
        task = self.tasks[0]
        for action in GARBAGE:
            for sb in (self.a, self.b):
                sb.reset(task, self.seed)
            ra, rb = self.step(self.a, action), self.step(self.b, action)
            if not isinstance(ra.observation.text, str):
                raise self.fail(f"step({action[:40]!r}) gave a non-text observation")
            self.prop, saved = "determinism", self.prop
            self.same(
                f"outcome of malformed action {action[:40]!r} in two sandboxes",
                _outcome(rb),
                _outcome(ra),
            )
            self.prop = saved
        return f"{len(GARBAGE)} malformed actions (empty, long, unicode, newlines, NUL)"

    def tree(self) -> str:
        rng = random.Random(f"{self.rng_seed}:tree")
        task, actions = self.tasks[0], []  # where ``a`` is, tracked here
        self.a.reset(task, self.seed)
        live: list[tuple[Snapshot, Observation, str]] = []
        b_task, replayed = "", []  # where ``b`` is: a replay from reset
        nodes = restores = 0
        for _ in range(self.stress_nodes):
            u, obs = rng.random(), self.a.observation()
            if u < 0.2 and len(live) < 8:
                snap = self.a.snapshot()
                self.same(
                    "snapshot's task and action prefix",
                    (snap.task, tuple(snap.actions)),
                    (task, tuple(actions)),
                )
                live.append((snap, obs, self.a.fingerprint()))
                continue
            if u < 0.45 and live:
                snap, want_obs, want_fp = rng.choice(live)
                self.same("observation returned by restore", self.a.restore(snap), want_obs)
                self.same("fingerprint after restore", self.a.fingerprint(), want_fp)
                task, actions, restores = snap.task, list(snap.actions), restores + 1
            elif u < 0.55 and live:
                self.a.release(live.pop(rng.randrange(len(live)))[0])
                continue
            elif u < 0.6 or obs.done or len(actions) >= self.max_steps:
                task, actions = rng.choice(self.tasks), []
                self.a.reset(task, self.seed)
            else:
                actions.append(self.choose(rng, self.a))
                self.step(self.a, actions[-1])
            if task != b_task or actions[: len(replayed)] != replayed:
                self.b.reset(task, self.seed)
                b_task, replayed = task, []
            for action in actions[len(replayed) :]:
                self.step(self.b, action)
                replayed.append(action)
            self.same(
                f"node {nodes} ({len(actions)} actions into {task}): observation vs "
                "replay from reset",
                self.a.observation(),
                self.b.observation(),
            )
            self.same(
                f"node {nodes}: fingerprint vs replay from reset",
                self.a.fingerprint(),
                self.b.fingerprint(),
            )
            nodes += 1
        for snap, _, _ in live:
            self.a.release(snap)
        self.same("live snapshots after the tree", self.a.stats().live, 0)
        return f"{nodes} nodes ({restores} restores) compared with replays from reset"


def _outcome(r: StepResult) -> tuple[object, ...]:
    return (r.observation, r.reward, r.terminated, r.truncated)


def _short(x: object, n: int = 300) -> str:
    text = repr(x)
    return text if len(text) <= n else text[:n] + "..."


PROPERTIES: tuple[tuple[str, str], ...] = (
    ("determinism", "determinism"),
    ("restore", "restore"),
    ("restore-many", "restore_many"),
    ("isolation", "isolation"),
    ("release", "release"),
    ("invalid-actions", "invalid_actions"),
    ("tree", "tree"),
)
