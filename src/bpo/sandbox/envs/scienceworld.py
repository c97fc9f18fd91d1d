"""ScienceWorld (Wang et al., 2022): 30 elementary-science tasks, 7,207 variations.

**Task names.** ``"<task>/var=<n>"``, where ``<task>`` is the library's task name
(``boil``, ``find-animal``, ...) or its id (``1-1``), and ``<n>`` a variation index. A bare
``"<task>"`` takes the variation from ``reset``'s ``seed``. :func:`tasks` lists the official
splits (``train``, ``valid`` = the library's dev, ``test``), always with ``/var=<n>``. The
simulator is deterministic given (task, variation, actions), so with ``/var=`` the seed is
unused. Unknown names and variations are answered with the valid ones.

**Observations.** ``text`` is the simulator's reply (after reset: the ``look around`` text),
``instruction`` the task description. ``admissible`` lists the valid action-object
combinations when the engine is built with ``admissible=True``; enumerating them costs
0.1-1 s per step (up to about 2,700 actions in a kitchen), so it is off by default.

**Reward.** ScienceWorld scores 0-100, and -100 when the agent fails (focuses on a wrong
object). Progress is ``clip(score, 0, 100) / 100`` and the reward of a step is the change
in progress, so an episode's return is its final progress, in [0, 1] (a step that loses
progress, e.g. by failing, has a negative reward). ``terminated`` when the task is
completed (``info["success"]``) or failed (score < 0); ``truncated`` after ``step_limit``
actions when one is set. ``info`` carries the raw ``score`` and the simulator's ``moves``.

**Expert.** The library's gold path, generated on first use for each variation (up to
10 s for the longest tasks) and cached: ``expert_action()`` is its next action while the
episode has followed it exactly, else None (the gold path is open-loop).

**Snapshots.** Replay: ``reset`` is the simulator's ``load`` (40-470 ms here, by task and
machine load; its ``reset`` is slower), and :meth:`ScienceWorldEngine.replay` replays a
prefix without building the intermediate observations. The JVM runs with
``-XX:hashCode=2`` (see :mod:`bpo.sandbox.envs.java`), without which reloads are not
deterministic.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bpo.sandbox.envs import ENVS
from bpo.sandbox.envs.java import Jvm, java_text
from bpo.sandbox.envs.java import check_backend as _check_backend
from bpo.sandbox.protocol import EnvSpec, Observation, Sandbox, SandboxError, StepResult

# (id, name, variations, train, dev) per task; the splits are contiguous ranges
# [0, train), [train, train + dev), [train + dev, variations), as read from scienceworld
# 1.2.3's get_variations_train/dev/test (tests/contract/test_env_scienceworld.py checks it).
_TABLE: tuple[tuple[str, str, int, int, int], ...] = (
    ("1-1", "boil", 30, 14, 7),
    ("1-2", "melt", 30, 14, 7),
    ("1-3", "freeze", 30, 14, 7),
    ("1-4", "change-the-state-of-matter-of", 30, 14, 7),
    ("2-1", "use-thermometer", 540, 270, 135),
    ("2-2", "measure-melting-point-known-substance", 436, 218, 109),
    ("2-3", "measure-melting-point-unknown-substance", 300, 150, 75),
    ("3-1", "power-component", 20, 10, 5),
    ("3-2", "power-component-renewable-vs-nonrenewable-energy", 20, 10, 5),
    ("3-3", "test-conductivity", 900, 450, 225),
    ("3-4", "test-conductivity-of-unknown-substances", 600, 300, 150),
    ("4-1", "find-living-thing", 300, 150, 75),
    ("4-2", "find-non-living-thing", 300, 150, 75),
    ("4-3", "find-plant", 300, 150, 75),
    ("4-4", "find-animal", 300, 150, 75),
    ("5-1", "grow-plant", 126, 62, 31),
    ("5-2", "grow-fruit", 126, 62, 31),
    ("6-1", "chemistry-mix", 32, 16, 8),
    ("6-2", "chemistry-mix-paint-secondary-color", 36, 18, 9),
    ("6-3", "chemistry-mix-paint-tertiary-color", 36, 18, 9),
    ("7-1", "lifespan-longest-lived", 125, 62, 31),
    ("7-2", "lifespan-shortest-lived", 125, 62, 31),
    ("7-3", "lifespan-longest-lived-then-shortest-lived", 125, 62, 31),
    ("8-1", "identify-life-stages-1", 14, 6, 3),
    ("8-2", "identify-life-stages-2", 10, 4, 2),
    ("9-1", "inclined-plane-determine-angle", 168, 84, 42),
    ("9-2", "inclined-plane-friction-named-surfaces", 1386, 692, 346),
    ("9-3", "inclined-plane-friction-unnamed-surfaces", 162, 80, 40),
    ("10-1", "mendelian-genetics-known-plant", 120, 60, 30),
    ("10-2", "mendelian-genetics-unknown-plant", 480, 240, 120),
)
TASK_NAMES: tuple[str, ...] = tuple(row[1] for row in _TABLE)
_BY_KEY = {key: row for row in _TABLE for key in (row[0], row[1])}
SPLITS = ("train", "valid", "test")


def variations(task: str, split: str) -> range:
    """The official variations of ``task`` in ``split`` ("train", "valid"/"dev", "test")."""
    _, _, n, n_train, n_dev = _row(task)
    bounds = {"train": (0, n_train), "valid": (n_train, n_train + n_dev),
              "test": (n_train + n_dev, n)}
    key = "valid" if split == "dev" else split
    if key not in bounds:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    return range(*bounds[key])


def tasks(
    split: str, *, task_names: Sequence[str] | None = None, per_task: int | None = None,
    **_engine_options: Any,
) -> list[str]:
    """Task names ``"<task>/var=<n>"`` of an official split, all 30 tasks unless
    ``task_names`` picks some; ``per_task`` keeps the first n variations of each."""
    names = [_row(t)[1] for t in task_names] if task_names else list(TASK_NAMES)
    return [f"{name}/var={v}" for name in names for v in variations(name, split)[:per_task]]


@dataclass(frozen=True)
class SwTask:
    """One ScienceWorld instance: a task and a variation."""

    name: str
    variation: int

    @property
    def key(self) -> str:
        return f"{self.name}/var={self.variation}"


def parse_task(task: str, seed: int = 0) -> SwTask:
    """``"boil/var=3"`` -> SwTask("boil", 3); ``"boil"`` takes the variation from ``seed``."""
    head, *rest = task.strip().split("/")
    name = _row(head)[1]
    if not rest:
        variation = seed
    elif len(rest) == 1 and rest[0].startswith("var=") and rest[0][4:].isdigit():
        variation = int(rest[0][4:])
    else:
        raise ValueError(f"bad ScienceWorld task {task!r}: expected '<task>/var=<n>', "
                         f"e.g. '{name}/var=0'")
    n = _row(name)[2]
    if not 0 <= variation < n:
        raise ValueError(f"ScienceWorld task {name!r} has variations 0..{n - 1}, not {variation} "
                         f"(train {_span(name, 'train')}, valid {_span(name, 'valid')}, "
                         f"test {_span(name, 'test')})")
    return SwTask(name, variation)


class ScienceWorldEngine:
    """A :class:`~bpo.sandbox.protocol.Engine` over one ScienceWorld JVM (about 500 MB)."""

    def __init__(
        self,
        *,
        simplifications: str = "",
        admissible: bool = False,
        max_admissible: int | None = None,
        step_limit: int | None = None,
        heap: str = "1g",
    ) -> None:
        """``simplifications``: the library's comma-separated list ("easy", "teleportAction",
        "openDoors", ...). ``admissible``: enumerate valid actions in every observation
        (costly); ``max_admissible`` then keeps that many, evenly spaced over the sorted list.
        ``step_limit``: truncate after that many actions. ``heap``: the JVM's ``-Xmx``."""
        from scienceworld.constants import BASEPATH, JAR_PATH

        if max_admissible is not None and max_admissible < 1:
            raise ValueError(f"max_admissible must be >= 1 or None, not {max_admissible}")
        self.simplifications = simplifications
        self.admissible = admissible
        self.max_admissible = max_admissible
        self.step_limit = step_limit
        self._jvm = Jvm(JAR_PATH, cwd=BASEPATH, heap=heap, deterministic_hash=True)
        self._server = self._jvm.jvm.scienceworld.runtime.pythonapi.PythonInterface()
        self._task: SwTask | None = None
        self._actions: list[str] = []
        self._text = ""
        self._instruction = ""
        self._score = 0
        self._done = False
        self._fingerprint: str | None = None
        self._gold: dict[str, tuple[str, ...]] = {}

    # -- Engine --------------------------------------------------------------------------
    def reset(self, task: str, seed: int) -> Observation:
        self._load(parse_task(task, seed))
        return self._observe(done=False)

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise SandboxError("step() before reset()")
        before = self._score
        self._raw_step(action)
        completed = bool(self._call(self._server.getCompleted))
        failed = self._score < 0
        terminated = completed or failed
        truncated = not terminated and self.step_limit is not None and (
            len(self._actions) >= self.step_limit)
        self._done = terminated or truncated
        obs = self._observe(done=self._done)
        reward = _progress(self._score) - _progress(before)
        info = {"score": self._score, "success": completed and not failed, "failed": failed,
                "moves": int(self._call(self._server.getNumMoves)), "task": self._task.key}
        return StepResult(obs, reward, terminated, truncated, info)

    def replay(self, task: str, seed: int, actions: Sequence[str]) -> Observation:
        """Reset and apply ``actions`` without building intermediate observations (the fast
        path of the replay backend); returns the final observation, as ``step`` would.

        When the current episode is a prefix of the target (same task, ``actions`` starting
        with the actions applied so far), only the rest is applied: the simulator is
        deterministic, so this equals a reset and a full replay, without the reload."""
        target, done = parse_task(task, seed), len(self._actions)
        if target != self._task or list(actions[:done]) != self._actions or done > len(actions):
            self._load(target)
            done = 0
        for action in actions[done:]:
            self._raw_step(action)
        if len(actions) > done:
            completed = bool(self._call(self._server.getCompleted))
            limit = self.step_limit is not None and len(self._actions) >= self.step_limit
            self._done = completed or self._score < 0 or limit
        return self._observe(done=self._done)

    def fingerprint(self) -> str:
        """Digest of the task, step count, last reply, ``look``, inventory, score, simulator
        moves and completion flag (everything the agent can query)."""
        if self._fingerprint is None:
            s = self._server
            parts = (self._task.key if self._task else "", len(self._actions), self._text,
                     self._call(s.freeActionLook), self._call(s.freeActionInventory),
                     self._score, self._call(s.getNumMoves), self._call(s.getCompleted))
            self._fingerprint = hashlib.blake2b(repr(parts).encode("utf-8", "surrogatepass"),
                                                digest_size=16).hexdigest()
        return self._fingerprint

    def expert_action(self) -> str | None:
        if self._task is None or self._done:
            return None
        gold = self.gold_path()
        k = len(self._actions)
        return gold[k] if k < len(gold) and tuple(self._actions) == gold[:k] else None

    def close(self) -> None:
        self._jvm.close()

    # -- extras --------------------------------------------------------------------------
    def gold_path(self) -> tuple[str, ...]:
        """The library's gold action sequence for the current task (cached per variation)."""
        if self._task is None:
            raise SandboxError("gold_path() before reset()")
        task = self._task
        if task.key not in self._gold:
            # generating the gold path runs it in the simulator: rebuild our state afterwards
            actions = list(self._actions)
            self._call(self._server.load, task.name, task.variation, self.simplifications, True)
            self._gold[task.key] = tuple(self._call(self._server.getGoldActionSequence))
            self._task = None  # the simulator is at the gold run's end: reload, then replay
            self.replay(task.key, task.variation, actions)
        return self._gold[task.key]

    @property
    def steps(self) -> int:
        """Actions applied since the last reset."""
        return len(self._actions)

    # -- internals -----------------------------------------------------------------------
    def _load(self, task: SwTask) -> None:
        self._call(self._server.load, task.name, task.variation, self.simplifications, False)
        self._task = task
        self._actions = []
        self._score = 0
        self._done = False
        self._text = str(self._call(self._server.freeActionLook))
        self._instruction = str(self._call(self._server.getTaskDescription))
        self._fingerprint = None

    def _raw_step(self, action: str) -> None:
        try:
            self._text = str(self._call(self._server.step, java_text(str(action))))
        except BaseException:
            self._task = None  # the simulator's state is unknown: the next replay reloads
            raise
        self._score = round(100 * float(self._call(self._server.getScore)))
        self._actions.append(action)
        self._fingerprint = None

    def _observe(self, done: bool) -> Observation:
        admissible = None
        if self.admissible:
            valid = sorted(self._call(self._server.getValidActionObjectCombinations))
            if self.max_admissible is not None and len(valid) > self.max_admissible:
                n, m = len(valid), self.max_admissible
                valid = [valid[i * n // m] for i in range(m)]
            admissible = tuple(valid)
        return Observation(self._text, self._instruction, admissible, done)

    def _call(self, fn: Any, *args: Any) -> Any:
        return self._jvm.call(fn, *args)


def _progress(score: int) -> float:
    return min(max(score, 0), 100) / 100


def _row(task: str) -> tuple[str, str, int, int, int]:
    row = _BY_KEY.get(task.strip().lower())
    if row is None:
        raise ValueError(f"unknown ScienceWorld task {task!r}; valid tasks (name or id): "
                         + ", ".join(f"{r[1]} ({r[0]})" for r in _TABLE))
    return row


def _span(task: str, split: str) -> str:
    r = variations(task, split)
    return f"{r.start}..{r.stop - 1}"


def make(*, backend: str = "auto", **options: Any) -> Sandbox:
    """A ScienceWorld sandbox with replay snapshots ("auto" = "replay"); ``options`` go to
    :class:`ScienceWorldEngine`."""
    from bpo.sandbox import make_sandbox

    _check_backend(backend)
    for key in ("task_names", "per_task"):  # task-listing options (see tasks())
        options.pop(key, None)
    return make_sandbox(functools.partial(ScienceWorldEngine, **options), backend=backend)


ENVS.register("scienceworld")(EnvSpec(
    name="scienceworld", make=make, tasks=tasks,
    description="ScienceWorld 1.2: 30 science tasks, 7,207 variations, official splits; "
                "JVM (Java 8+); replay snapshots",
))
