"""ALFWorld (text) in bpo: ALFWorld 0.4.2's own PDDL text engine behind the Engine protocol.

The engine is textworld's ``PddlEnv`` (fast-downward's state registry underneath) with
ALFWorld's domain, grammar and object naming (``Demangler``), exactly as ``AlfredTWEnv``
plays it; observations, admissible commands and feedback are ALFWorld's. Games come from

* **generated** ALFWorld-style games (default; :mod:`bpo.sandbox.envs.alfworld_games`, solved
  and cached by :mod:`bpo.sandbox.envs.alfworld_cache`).
  They are *not* the official ALFWorld task instances, which need a download that is not
  available here; task names look like ``"pick_clean_then_place_in_recep/FloorPlan12/0"``;
* the **official** games, when a user has them: ``data_dir`` (default ``$ALFWORLD_DATA``)
  laid out as ``alfworld-download`` leaves it (``json_2.1.1/{train,valid_seen,
  valid_unseen}/<task>/<trial>/{game.tw-pddl,traj_data.json}``); task names are paths
  relative to ``data_dir``; splits map train/valid/test to train/valid_seen/valid_unseen.

Native state (``get_state``/``set_state``): fast-downward's state id plus a copy of the
Python-side facts and the last observation. A state is valid only in the engine (and the
loaded game) that made it; anything else raises :class:`SnapshotError`. ``reset`` to a
recently played task restores its root state instead of translating the PDDL again.

Reward is 1 on the step that achieves the goal, else 0; episodes are truncated after
``max_steps`` actions. Text that is not an admissible command (empty, garbage, several
lines, unicode, very long) gives "Nothing happens." and leaves the state unchanged, as in
ALFWorld; it still counts as a step. The expert (``expert_action``) is ALFWorld's planner
expert: the game's walkthrough from the start state, and fast-downward's search from any
state off that path (milliseconds in small rooms, seconds to a minute in large kitchens;
the plan is then reused while it is followed).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import sys
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from bpo.sandbox.envs import ENVS, alfworld_cache
from bpo.sandbox.envs import alfworld_games as games
from bpo.sandbox.envs.alfworld_pddl import load_pddl_env
from bpo.sandbox.protocol import EnvSpec, Observation, Sandbox, SnapshotError, StepResult

INVALID = "Nothing happens."
OFFICIAL_SPLITS = {"train": "train", "valid": "valid_seen", "test": "valid_unseen"}
_TASK_RE = re.compile(r"Your task is to: (.*)$", re.S)
_UIDS = itertools.count(1)


@dataclass(frozen=True)
class AlfWorldOptions:
    """Options of the ``alfworld`` environment (``make_env("alfworld", **options)``)."""

    source: str = "generated"
    """"generated" (local ALFWorld-style games) or "official" (games under ``data_dir``)."""
    max_steps: int = 50
    """Actions per episode before truncation."""
    per_type: int | None = None
    """Generated games per task type and split (None: 8 train, 2 valid, 4 test; these ship
    solved). Larger values plan new games once, then read them from the cache."""
    task_types: tuple[str, ...] = games.TASK_TYPES
    """Which of the six ALFWorld task types to list."""
    data_dir: str | None = None
    """Official data root; None reads ``$ALFWORLD_DATA``."""
    cache_dir: str | None = None
    """Where planner verdicts of generated games are cached; None: ``$BPO_CACHE/alfworld``."""
    planner_timeout: float = 60.0
    """Seconds the planner may spend deciding that a generated game is solvable."""
    keep_loaded: int = 4
    """Games kept loaded per engine (reset to one of them costs ~1 ms instead of ~1 s)."""

    def __post_init__(self) -> None:
        if self.source not in ("generated", "official"):
            raise ValueError(f"alfworld source {self.source!r}; valid: generated, official")
        unknown = set(self.task_types) - set(games.TASK_TYPES)
        if unknown:
            raise ValueError(f"unknown task types {sorted(unknown)}; valid: {games.TASK_TYPES}")
        if self.max_steps < 1 or self.keep_loaded < 1:
            raise ValueError("alfworld max_steps and keep_loaded must be >= 1")

    @classmethod
    def parse(cls, options: dict[str, Any]) -> AlfWorldOptions:
        valid = {f.name for f in fields(cls)}
        unknown = set(options) - valid
        if unknown:
            raise ValueError(f"unknown alfworld options {sorted(unknown)}; valid: {sorted(valid)}")
        if "task_types" in options:
            options = {**options, "task_types": tuple(options["task_types"])}
        return cls(**options)

    def official_root(self) -> Path:
        root = self.data_dir or os.environ.get("ALFWORLD_DATA")
        if not root:
            raise ValueError("official ALFWorld games need data_dir= or $ALFWORLD_DATA")
        return Path(root).expanduser()


@dataclass
class _Game:
    """A loaded game: its PddlEnv (own copy of the planner library) and what never changes."""

    task: str
    env: Any
    uid: int
    instruction: str
    walkthrough: tuple[str, ...] | None
    dynamic: frozenset[str]
    """Predicates that actions change: the fingerprint hashes only those facts."""
    root: AlfWorldState | None = None
    fact_names: dict = field(default_factory=dict)
    """Memoized text of each fact seen (facts are immutable and shared)."""


@dataclass(frozen=True, eq=False, slots=True)
class AlfWorldState:
    """A native snapshot: fast-downward's state id and copies of the Python-side state.
    Valid only in the engine and loaded game that made it (``owner``). Slotted, so that a
    generic size estimate does not walk into the (shared, unchanging) GameState."""

    owner: tuple[int, int]
    """(engine uid, game uid)."""
    task: str
    state_id: int
    facts: dict
    vars_by_name: dict
    vars_by_type: dict
    var_counts: Counter
    game_state: Any
    """textworld's GameState of the last step (never mutated after it is made)."""
    operators: dict
    last_action: Any
    moves: int
    step: int
    won: bool
    observation: Observation
    plan: tuple[str, ...] | None
    nbytes: int = field(default=0)
    """Bytes of the containers copied for this state (facts and variables are shared,
    immutable objects; the GameState is shared too)."""


class AlfWorldEngine:
    """ALFWorld's text engine as a bpo :class:`~bpo.sandbox.protocol.Engine` with native
    state. ``reset(task, seed)``: ``task`` is a generated game name, an official game path
    relative to ``data_dir``, or an absolute path to a game folder; ``seed`` is unused
    (ALFWorld's text games are deterministic)."""

    def __init__(self, **options: Any) -> None:
        self.options = AlfWorldOptions.parse(options)
        self.max_steps = self.options.max_steps
        self.uid = next(_UIDS)
        self._games: OrderedDict[str, _Game] = OrderedDict()
        self._game: _Game | None = None
        self._step = 0
        self._won = False
        self._obs: Observation | None = None
        self._plan: tuple[str, ...] | None = None

    # -- episodes ---------------------------------------------------------------------
    def reset(self, task: str, seed: int = 0) -> Observation:
        game = self._games.get(task)
        if game is None:
            game = self._load(task)
        self._games.move_to_end(task)
        self.set_state(game.root)
        return self._obs

    def step(self, action: str) -> StepResult:
        game = self._current()
        env = game.env
        if self._obs.done:
            return StepResult(
                self._obs, 0.0, self._won, not self._won, {"won": self._won, "valid": False}
            )
        command = action.strip() if isinstance(action, str) else ""
        valid = command in env.state["_valid_commands"]  # a list of ~10-100 commands
        self._step += 1
        if valid:
            env.step(command)
            text = env.state["feedback"]
            self._won = bool(env.state["won"])
            plan = self._plan
            self._plan = plan[1:] if plan and plan[0] == command else None
        else:
            text = INVALID
        truncated = not self._won and self._step >= self.max_steps
        self._obs = Observation(
            text,
            game.instruction,
            tuple(env.state["admissible_commands"]),
            done=self._won or truncated,
        )
        info = {"won": self._won, "valid": valid}
        return StepResult(
            self._obs, 1.0 if valid and self._won else 0.0, self._won, truncated, info
        )

    def fingerprint(self) -> str:
        game = self._current()
        names = game.fact_names
        facts = []
        for sig, props in game.env._pddl_state._facts.items():
            if props and sig.name.removeprefix("not_") in game.dynamic:
                for p in props:
                    name = names.get(p)
                    if name is None:
                        name = names[p] = f"{p.name}({','.join(v.name for v in p.arguments)})"
                    facts.append(name)
        facts.sort()
        text = "\n".join([game.task, str(self._step), str(self._won), str(self._obs.done), *facts])
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def expert_action(self) -> str | None:
        """The planner's next command (None when the episode is over or no plan exists)."""
        game = self._current()
        if self._obs.done:
            return None
        if self._plan is None:
            self._plan = tuple(game.env._pddl_state.replan(game.env._entity_infos))
        return self._plan[0] if self._plan else None

    def close(self) -> None:
        for game in self._games.values():
            game.env.close()
        self._games.clear()
        self._game = None

    # -- native state -----------------------------------------------------------------
    def get_state(self) -> AlfWorldState:
        game = self._current()
        pddl = game.env._pddl_state
        facts = {sig: set(props) for sig, props in pddl._facts.items()}
        by_name, counts = dict(pddl._vars_by_name), Counter(pddl._var_counts)
        by_type = {k: set(v) for k, v in pddl._vars_by_type.items()}
        copied = [facts, by_name, by_type, counts, *facts.values(), *by_type.values()]
        return AlfWorldState(
            owner=(self.uid, game.uid),
            task=game.task,
            state_id=pddl.downward_lib.get_state_id(),
            facts=facts,
            vars_by_name=by_name,
            vars_by_type=by_type,
            var_counts=counts,
            game_state=game.env.state,
            operators=pddl._operators,
            last_action=game.env._last_action,
            moves=game.env._moves,
            step=self._step,
            won=self._won,
            observation=self._obs,
            plan=self._plan,
            nbytes=sum(map(sys.getsizeof, copied)),
        )

    def set_state(self, state: AlfWorldState) -> None:
        if not isinstance(state, AlfWorldState) or state.owner[0] != self.uid:
            raise SnapshotError(
                "this ALFWorld state was made by another engine (fast-downward state ids are "
                "only meaningful in the library instance that made them); restore it there "
                "or rebuild it by replaying its actions"
            )
        game = self._games.get(state.task)
        if game is None or game.uid != state.owner[1]:
            raise SnapshotError(
                f"the game {state.task!r} of this ALFWorld state is no longer loaded (more "
                f"than keep_loaded={self.options.keep_loaded} games were played since); "
                "raise keep_loaded or rebuild the state by replay"
            )
        env, pddl = game.env, game.env._pddl_state
        pddl.downward_lib.set_state_id(state.state_id)
        pddl._facts = defaultdict(set, {sig: set(p) for sig, p in state.facts.items()})
        pddl._vars_by_name = dict(state.vars_by_name)
        pddl._vars_by_type = defaultdict(set, {k: set(v) for k, v in state.vars_by_type.items()})
        pddl._var_counts = Counter(state.var_counts)
        pddl._operators = state.operators
        env.state, env._last_action, env._moves = state.game_state, state.last_action, state.moves
        self._game, self._step, self._won = game, state.step, state.won
        self._obs, self._plan = state.observation, state.plan

    # -- loading ----------------------------------------------------------------------
    def _current(self) -> _Game:
        if self._game is None:
            raise RuntimeError("AlfWorldEngine: call reset(task) before stepping")
        return self._game

    def _load(self, task: str) -> _Game:
        data, walkthrough = self._game_data(task)
        while len(self._games) >= self.options.keep_loaded:
            _, old = self._games.popitem(last=False)
            if old is self._game:
                self._game = None
            old.env.close()
        env = load_pddl_env(data)
        intro = env.state["feedback"]
        match = _TASK_RE.search(intro)
        instruction = f"Your task is to: {match.group(1).strip()}" if match else ""
        dynamic = frozenset(
            eff.literal.predicate for act in env._pddl_state.task.actions for eff in act.effects
        )
        game = _Game(task, env, next(_UIDS), instruction, walkthrough, dynamic)
        self._games[task] = game
        self._game, self._step, self._won, self._plan = game, 0, False, walkthrough
        self._obs = Observation(intro, instruction, tuple(env.state["admissible_commands"]))
        game.root = self.get_state()
        return game

    def _game_data(self, task: str) -> tuple[dict, tuple[str, ...] | None]:
        if task.split("/", 1)[0] in games.TASK_TYPES:
            solved = alfworld_cache.resolve(
                task, self.options.cache_dir, self.options.planner_timeout
            )
            if solved.problem is None:
                raise ValueError(f"{task!r}: this floor plan cannot host that task type")
            gen = solved.problem
            return games.game_data(gen.problem, gen.goal_text, None), solved.walkthrough
        path = Path(task) if os.path.isabs(task) else self.options.official_root() / task
        file = path if path.name == "game.tw-pddl" else path / "game.tw-pddl"
        if not file.is_file():
            raise FileNotFoundError(
                f"no ALFWorld game at {file}; task names are generated game names "
                f"('{games.TASK_TYPES[0]}/FloorPlan10/0') or official game folders relative "
                "to data_dir / $ALFWORLD_DATA (see list_tasks('alfworld', split))"
            )
        data = json.loads(file.read_text())
        walk = data.get("walkthrough")
        return data, tuple(walk) if walk else None


def official_tasks(split: str, root: Path, task_types: tuple[str, ...]) -> list[str]:
    """Solvable official games of ``split`` under ``root`` (ALFWorld's own filter: skip
    movable/sliced trajectories and games not marked solvable), sorted."""
    base = root / "json_2.1.1" / OFFICIAL_SPLITS[split]
    names = []
    for traj in sorted(base.glob("*/*/traj_data.json")):
        folder = traj.parent
        if "movable" in str(folder) or "Sliced" in str(folder):
            continue
        if json.loads(traj.read_text()).get("task_type") not in task_types:
            continue
        game = folder / "game.tw-pddl"
        if game.is_file() and json.loads(game.read_text()).get("solvable"):
            names.append(folder.relative_to(root).as_posix())
    if not names:
        raise FileNotFoundError(
            f"no solvable ALFWorld games under {base}; run `alfworld-download` (with "
            "$ALFWORLD_DATA set) or point data_dir at a folder laid out like its output"
        )
    return names


def list_alfworld_tasks(split: str, **options: Any) -> list[str]:
    """Task names of ``split`` ("train", "valid", "test") for these options."""
    opts = AlfWorldOptions.parse(options)
    if split not in OFFICIAL_SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(OFFICIAL_SPLITS)}")
    if opts.source == "official":
        return official_tasks(split, opts.official_root(), opts.task_types)
    return alfworld_cache.list_games(
        split, opts.per_type, opts.task_types, opts.cache_dir, opts.planner_timeout
    )


def make_alfworld(backend: str = "auto", **options: Any) -> Sandbox:
    """A sandbox around :class:`AlfWorldEngine` (native snapshots by default)."""
    from bpo.sandbox import make_sandbox

    AlfWorldOptions.parse(options)  # fail here, not in a worker
    return make_sandbox(lambda: AlfWorldEngine(**options), backend=backend)


ENVS.register("alfworld")(
    EnvSpec(
        name="alfworld",
        make=make_alfworld,
        tasks=list_alfworld_tasks,
        description="ALFWorld text games (ALFWorld's PDDL engine); locally generated "
        "ALFWorld-style games by default, the official games from $ALFWORLD_DATA on request",
    )
)
