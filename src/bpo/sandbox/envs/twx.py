"""TextWorld-Express (Jansen & Côté, 2022): eight procedurally generated text games.

**Task names.** ``"<game>/seed=<n>"``, optionally followed by ``/fold=<train|dev|test>``
and game parameters ``/<name>=<int>`` (e.g. ``cookingworld/seed=3/numLocations=5``; the
JVM lists the valid parameter names of a game on error). A bare ``"<game>"`` takes the
seed from ``reset``'s ``seed``, so any seed works. The fold (which object sets the
generator may use) defaults to the official split the seed belongs to: train 0-999, dev
10000-10999, test 20000-20999, and train for every other seed. :func:`tasks` lists the
official seeds per split (``valid`` = dev).

**Observations.** ``text`` is the game's reply (after reset: the room description),
``instruction`` the task description, ``admissible`` the game's valid actions (sorted;
a handful to a few dozen). Unknown actions are observations ("Unknown action: ...").

**Reward.** Games score in [0, 1] and -1 on failure (e.g. a wrong answer in arithmetic).
Progress is ``clip(score, 0, 1)``; the reward of a step is the change in progress, so the
return is the final progress, in [0, 1]. ``terminated`` on the game's success or failure
flag (``info["success"]``, ``info["failed"]``) or a full score; ``truncated`` after
``step_limit`` actions when one is set.

**Expert.** The game's gold agent (the library's), run on first use and cached:
``expert_action()`` is the next action of its path while the episode has followed it, else
None. The library seeds the agent's random choices only for cookingworld; this engine seeds
them with the game seed for every game, so gold paths are the same in every JVM (for
cookingworld, identical to the library's). Games (initial states, transitions) are
deterministic across JVMs too.

**Snapshots.** Replay inside one JVM: ``reset`` regenerates the game from its seed without
reloading the generator (0.3-8 ms), and :meth:`TwxEngine.replay` replays a prefix parsing
only the last reply.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bpo.sandbox.envs import ENVS
from bpo.sandbox.envs.java import Jvm, java_text
from bpo.sandbox.envs.java import check_backend as _check_backend
from bpo.sandbox.protocol import EnvSpec, Observation, Sandbox, SandboxError, StepResult

GAMES: tuple[str, ...] = ("cookingworld", "twc", "coin", "mapreader", "arithmetic", "sorting",
                          "simonsays", "peckingorder")
# Official seeds per fold in textworld_express 1.x (getSeedsTrain/Dev/Test, the same for every
# game; tests/contract/test_env_twx.py checks it).
FOLD_SEEDS: dict[str, range] = {
    "train": range(0, 1000), "dev": range(10000, 11000), "test": range(20000, 21000)}
_SPLIT_TO_FOLD = {"train": "train", "valid": "dev", "dev": "dev", "test": "test"}


def tasks(
    split: str, *, games: Sequence[str] | None = None, per_game: int | None = None,
    params: dict[str, int] | None = None, **_engine_options: Any,
) -> list[str]:
    """Task names ``"<game>/seed=<n>"`` with the official seeds of ``split`` ("train",
    "valid"/"dev", "test"), for all eight games unless ``games`` picks some; ``per_game``
    keeps the first n seeds of each; ``params`` appends generator parameters to every name
    (e.g. ``{"numLocations": 3}``)."""
    if split not in _SPLIT_TO_FOLD:
        raise ValueError(f"unknown split {split!r}; valid splits: train, valid, test")
    seeds = FOLD_SEEDS[_SPLIT_TO_FOLD[split]][:per_game]
    suffix = "".join(f"/{k}={int(v)}" for k, v in (params or {}).items())
    return [f"{_game(g)}/seed={s}{suffix}" for g in (games or GAMES) for s in seeds]


@dataclass(frozen=True)
class TwxTask:
    """One TextWorld-Express game instance."""

    game: str
    seed: int
    fold: str
    params: tuple[tuple[str, int], ...] = ()
    """Generator parameters, in the order given (passed as ``name=value,...``)."""

    @property
    def params_str(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.params)

    @property
    def key(self) -> str:
        fold = "" if self.fold == default_fold(self.seed) else f"/fold={self.fold}"
        return f"{self.game}/seed={self.seed}{fold}" + "".join(
            f"/{k}={v}" for k, v in self.params)


def default_fold(seed: int) -> str:
    """The fold whose official seeds contain ``seed``; train for any other seed."""
    return next((fold for fold, seeds in FOLD_SEEDS.items() if seed in seeds), "train")


def parse_task(task: str, seed: int = 0) -> TwxTask:
    """``"coin/seed=5/numLocations=3"`` -> TwxTask; a bare ``"coin"`` uses ``seed``."""
    head, *rest = task.strip().split("/")
    game = _game(head)
    fold: str | None = None
    params: list[tuple[str, int]] = []
    for part in rest:
        name, sep, value = part.partition("=")
        if name == "fold" and value in FOLD_SEEDS:
            fold = value
        elif sep and value.lstrip("-").isdigit() and name.isidentifier():
            if name == "seed":
                seed = int(value)
            else:
                params.append((name, int(value)))
        else:
            raise ValueError(
                f"bad TextWorld-Express task {task!r} at {part!r}: expected "
                "'<game>/seed=<n>[/fold=train|dev|test][/<parameter>=<int>...]', "
                f"e.g. '{game}/seed=0'")
    seed = int(seed)
    if not 0 <= seed < 2**31:
        raise ValueError(f"TextWorld-Express seeds are in [0, 2**31), not {seed} ({task!r})")
    return TwxTask(game, seed, fold or default_fold(seed), tuple(params))


class TwxEngine:
    """A :class:`~bpo.sandbox.protocol.Engine` over one TextWorld-Express JVM."""

    def __init__(self, *, step_limit: int | None = None, heap: str = "1g") -> None:
        """``step_limit``: truncate after that many actions. ``heap``: the JVM's ``-Xmx``."""
        from textworld_express.constants import BASEPATH, JAR_PATH

        self.step_limit = step_limit
        self._jvm = Jvm(JAR_PATH, cwd=BASEPATH, heap=heap, deterministic_hash=True)
        self._server = self._jvm.jvm.textworldexpress.runtime.PythonInterface()
        self._loaded: tuple[str, str] | None = None
        self._task: TwxTask | None = None
        self._actions: list[str] = []
        self._reply: dict[str, Any] = {}
        self._instruction = ""
        self._fingerprint: str | None = None
        self._gold: dict[str, tuple[str, ...]] = {}

    # -- Engine --------------------------------------------------------------------------
    def reset(self, task: str, seed: int) -> Observation:
        self._generate(parse_task(task, seed))
        return self._observe()

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise SandboxError("step() before reset()")
        before = _progress(self._reply)
        self._reply = json.loads(self._raw_step(action))
        obs = self._observe()
        r = self._reply
        info = {"score": float(r["score"]), "score_raw": float(r["scoreRaw"]),
                "success": bool(r["tasksuccess"]), "failed": bool(r["taskfailure"]),
                "task": self._task.key}
        terminated = self._terminal()
        return StepResult(obs, _progress(r) - before, terminated, obs.done and not terminated,
                          info)

    def replay(self, task: str, seed: int, actions: Sequence[str]) -> Observation:
        """Reset and apply ``actions``, parsing only the last reply (the fast path of the
        replay backend); returns the final observation, as ``step`` would."""
        self._generate(parse_task(task, seed))
        last = None
        for action in actions:
            last = self._raw_step(action)
        if last is not None:
            self._reply = json.loads(last)
        return self._observe()

    def fingerprint(self) -> str:
        """Digest of the task, step count and the game's last reply (observation, look,
        inventory, valid actions, score, success and failure flags)."""
        if self._fingerprint is None:
            parts = (self._task.key if self._task else "", len(self._actions),
                     json.dumps(self._reply, sort_keys=True))
            self._fingerprint = hashlib.blake2b(repr(parts).encode("utf-8", "surrogatepass"),
                                                digest_size=16).hexdigest()
        return self._fingerprint

    def expert_action(self) -> str | None:
        if self._task is None or self._terminal():
            return None
        gold = self.gold_path()
        k = len(self._actions)
        return gold[k] if k < len(gold) and tuple(self._actions) == gold[:k] else None

    def close(self) -> None:
        self._jvm.close()

    # -- extras --------------------------------------------------------------------------
    def gold_path(self) -> tuple[str, ...]:
        """The gold action sequence of the current game (cached per task)."""
        if self._task is None:
            raise SandboxError("gold_path() before reset()")
        task = self._task
        if task.key not in self._gold:
            actions = list(self._actions)
            self._gold[task.key] = self._run_gold_agent(task)
            self.replay(task.key, task.seed, actions)  # back to where the episode was
        return self._gold[task.key]

    def _run_gold_agent(self, task: TwxTask) -> tuple[str, ...]:
        """Run the game's own gold agent, as the library's generators do, but with
        ``scala.util.Random(seed)``: the library seeds it so for cookingworld only and uses an
        unseeded one for the seven other games, whose gold paths then vary between JVMs."""
        jvm = self._jvm.jvm
        rng = jvm.scala.util.Random(task.seed)
        for _ in range(50):  # the library's number of attempts
            self._call(self._server.generateNewGameJSON, task.seed, task.fold, False)
            game = self._call(self._server.game)
            agent_class = str(game.getClass().getSimpleName()).removesuffix("Game") + "GoldAgent"
            agent = self._call(getattr(jvm.textworldexpress.goldagent, agent_class), game)
            found = self._call(agent.mkGoldPath, rng)  # Tuple2(success, actions); plays `game`
            if found._1:
                return tuple(str(a) for a in found._2)[1:]  # [0] is the game's opening look
        raise SandboxError(f"the gold agent found no path for {task.key!r} in 50 attempts")

    @property
    def steps(self) -> int:
        """Actions applied since the last reset."""
        return len(self._actions)

    # -- internals -----------------------------------------------------------------------
    def _generate(self, task: TwxTask) -> None:
        wanted = (task.game, task.params_str)
        if self._loaded != wanted:
            self._loaded = None
            message = self._call(self._server.load, *wanted)
            if message:
                raise ValueError(f"TextWorld-Express rejected task {task.key!r}: {message.strip()}")
            self._loaded = wanted
        self._reply = json.loads(
            self._call(self._server.generateNewGameJSON, task.seed, task.fold, False))
        self._instruction = str(self._call(self._server.getTaskDescription))
        self._task = task
        self._actions = []
        self._fingerprint = None

    def _raw_step(self, action: str) -> str:
        reply = str(self._call(self._server.stepJSON, java_text(str(action))))
        self._actions.append(action)
        self._fingerprint = None
        return reply

    def _terminal(self) -> bool:
        r = self._reply
        return bool(r.get("tasksuccess") or r.get("taskfailure")) or float(
            r.get("score", 0.0)) >= 1.0

    def _observe(self) -> Observation:
        r = self._reply
        limit = self.step_limit is not None and len(self._actions) >= self.step_limit
        return Observation(str(r["observation"]), self._instruction,
                           tuple(sorted(r["validActions"])), self._terminal() or limit)

    def _call(self, fn: Any, *args: Any) -> Any:
        return self._jvm.call(fn, *args)


def _progress(reply: dict[str, Any]) -> float:
    return min(max(float(reply.get("score", 0.0)), 0.0), 1.0)


def _game(name: str) -> str:
    game = name.strip().lower()
    if game not in GAMES:
        raise ValueError(f"unknown TextWorld-Express game {name!r}; valid games: "
                         + ", ".join(GAMES))
    return game


def make(*, backend: str = "auto", **options: Any) -> Sandbox:
    """A TextWorld-Express sandbox with replay snapshots ("auto" = "replay"); ``options`` go
    to :class:`TwxEngine`."""
    from bpo.sandbox import make_sandbox

    _check_backend(backend)
    for key in ("games", "per_game", "params"):  # task-listing options (see tasks())
        options.pop(key, None)
    return make_sandbox(functools.partial(TwxEngine, **options), backend=backend)


ENVS.register("twx")(EnvSpec(
    name="twx", make=make, tasks=tasks,
    description="TextWorld-Express 1.x: eight procedural games, any seed, official seed "
                "splits; JVM (Java 8+); replay snapshots",
))
