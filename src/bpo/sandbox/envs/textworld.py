"""TextWorld (Côté et al., 2018): generated text games played on the Z-machine, native snapshots.

**Tasks.** ``"<challenge>/level=<L>[/split=<s>]/seed=<n>"``, e.g.
``tw-cooking/level=1/split=train/seed=12``; the four ``tw-make`` challenges (tw-cooking with
its official splits, tw-simple, tw-coin_collector, tw-treasure_hunter) are generated on
first use and cached (see :mod:`bpo.sandbox.envs.textworld_games`). :func:`tasks` lists names.

**Observations.** ``text`` is TextWorld's feedback without the prompt/status line (after
reset: the intro without its ASCII banner), ``instruction`` the game's objective,
``admissible`` TextWorld's admissible commands (sorted). Actions are cleaned before the game
sees them (accents folded to ASCII, other symbols and line breaks to spaces, at most 180
characters: the Z-machine reads one line of at most 198 bytes). Interpreter meta-commands (save, restore, restart, quit, undo, script,
``tw-*``) are refused with an observation: they would write files, desynchronise TextWorld's
quest tracking from the Z-machine, or leave the game waiting on a yes/no question.

**Reward** (option ``reward``): ``"win"`` (default) 1.0 on the step that wins, else 0;
``"score"`` the change of the game's score (points); ``"normalized"`` that change divided by
the maximum score (a won game returns 1.0 in total). ``terminated`` when the game is won or
lost, ``truncated`` after ``max_steps`` actions; stepping a finished episode changes nothing.

**Expert.** TextWorld's ``policy_commands``: the first command of a shortest winning policy
from the current state, recomputed after every step (so it recovers after detours).

**Snapshots (native)**, 0.2-0.7 ms to take and 0.1-0.5 ms to restore, 40-120 KB:
:class:`TextWorldState` = the Z-machine's state plus a copy of TextWorld's quest tracking
(see :mod:`bpo.sandbox.envs.textworld_state`) plus this engine's counters. A state restores
into any :class:`TextWorldEngine` of this process; one engine is one interpreter, so
concurrent branches need one engine each.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from bpo.sandbox.envs import ENVS
from bpo.sandbox.envs.textworld_games import (
    CHALLENGES,
    GameFiles,
    ensure_games,
    task_names,
)
from bpo.sandbox.envs.textworld_state import StackState, TextWorldStack
from bpo.sandbox.protocol import EnvSpec, Observation, Sandbox, SandboxError, StepResult

__all__ = [
    "REWARD_MODES",
    "TextWorldEngine",
    "TextWorldState",
    "clean_command",
    "clean_text",
    "tasks",
]

REWARD_MODES = ("win", "score", "normalized")
MAX_COMMAND_CHARS = 180
REFUSED = "That command is not available in this game."
_META_VERBS = frozenset(
    [
        "save",
        "restore",
        "restart",
        "quit",
        "q",
        "undo",
        "script",
        "unscript",
        "transcript",
        "noscript",
        "verify",
    ]
)
_NOT_COMMAND_CHARS = re.compile(r"[^A-Za-z0-9 .,;:'!?\"/-]+")
_CLAUSES = re.compile(r"[.,;]|\bthen\b")
_HAS_WORD = re.compile(r"[A-Za-z0-9]")
_PROMPT_LINE = re.compile(r"\n>[^\n]*\Z")
_BLANK_LINES = re.compile(r"\n\s*\n(\s*\n)+")


def clean_command(action: str) -> str:
    """The command the Z-machine is sent for ``action``: ASCII, one line, at most 180 chars."""
    text = unicodedata.normalize("NFKD", action).encode("ascii", "ignore").decode("ascii")
    return " ".join(_NOT_COMMAND_CHARS.sub(" ", text).split())[:MAX_COMMAND_CHARS]


def _is_meta(command: str) -> bool:
    for clause in _CLAUSES.split(command.lower()):
        words = clause.split()
        if words and (words[0] in _META_VERBS or any(w.startswith("tw-") for w in words)):
            return True
    return False


def clean_text(text: str, strip_banner: bool = True) -> str:
    """TextWorld's feedback without the trailing prompt line (``>`` and the status bar:
    room, score/moves, padded with spaces), runs of blank lines cut to one, and (if asked)
    without the leading ASCII-art banner."""
    lines = _PROMPT_LINE.sub("", text.rstrip()).strip("\n").split("\n")
    while strip_banner and lines and not _HAS_WORD.search(lines[0]):
        lines.pop(0)
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


@functools.lru_cache(maxsize=64)
def _load_game(json_path: str) -> Any:
    """TextWorld's ``Game`` of a cached game file, loaded once per process (0.2 s each)."""
    from textworld import Game

    return Game.load(json_path)


@functools.lru_cache(maxsize=4096)
def _game_files(task: str, cache_dir: str | None, on_corrupt: str) -> GameFiles:
    """Generate (if needed) and verify a task's game once per process."""
    return ensure_games([task], cache_dir=cache_dir, on_corrupt=on_corrupt)[0]


@dataclass(frozen=True, eq=False, slots=True)
class TextWorldState:
    """A native snapshot of a :class:`TextWorldEngine` (restorable any number of times)."""

    task: str
    seed: int
    stack: StackState
    """The Z-machine and TextWorld's wrappers."""
    step: int
    score: int
    won: bool
    lost: bool
    truncated: bool
    observation: Observation

    @property
    def nbytes(self) -> int:
        """Bytes held privately (the game itself is shared, not counted)."""
        return self.stack.nbytes


class TextWorldEngine:
    """A TextWorld game on Jericho's Z-machine, behind the bpo Engine + NativeState protocols.

    Options: ``max_steps`` (truncation), ``reward`` (one of :data:`REWARD_MODES`),
    ``admissible`` (compute admissible commands), ``expert`` (track quests for
    :meth:`expert_action`: most of a step's time in games with many quests, e.g. 4x in
    tw-cooking level 4), ``strip_banner``, ``cache_dir`` (default ``$BPO_CACHE``),
    ``on_corrupt`` ("raise" or "regenerate" a damaged cached game), ``root_cache`` (initial
    states kept per engine, so that a reset is a restore).
    """

    def __init__(
        self,
        max_steps: int = 50,
        reward: str = "win",
        admissible: bool = True,
        expert: bool = True,
        strip_banner: bool = True,
        cache_dir: str | None = None,
        on_corrupt: str = "raise",
        root_cache: int = 16,
    ) -> None:
        if reward not in REWARD_MODES:
            raise ValueError(f"unknown reward mode {reward!r}; valid: {', '.join(REWARD_MODES)}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, not {max_steps}")
        self.max_steps = max_steps
        self.reward_mode = reward
        self.strip_banner = strip_banner
        self.cache_dir = None if cache_dir is None else str(cache_dir)
        self.on_corrupt = on_corrupt
        self.root_cache = root_cache
        self._roots: OrderedDict[tuple[str, int], TextWorldState] = OrderedDict()
        self._stack = TextWorldStack(admissible=admissible, expert=expert)
        self._task: str | None = None
        self._seed = 0
        self._objective = ""
        self._max_score = 0
        self._step = self._score = 0
        self._won = self._lost = self._truncated = False
        self._obs: Observation | None = None
        self._fingerprint: str | None = None

    # -- episode ---------------------------------------------------------------------------
    def reset(self, task: str, seed: int) -> Observation:
        """Start ``task``'s game; the initial state is cached, so later resets are restores."""
        self._load(task)
        root = self._roots.get((task, seed))
        if root is not None:
            self._roots.move_to_end((task, seed))
            self.set_state(root)
            return root.observation
        gs = self._stack.reset(seed)
        self._task, self._seed = task, seed
        self._step, self._score = 0, int(gs.score or 0)
        self._won = self._lost = self._truncated = False
        self._obs = self._observation(gs, self.strip_banner)
        self._fingerprint = None
        self._roots[(task, seed)] = self.get_state()
        while len(self._roots) > self.root_cache:
            self._roots.popitem(last=False)
        return self._obs

    def step(self, action: str) -> StepResult:
        """Send ``action`` (cleaned) to the game; invalid text is answered by the game."""
        if self._obs is None:
            raise SandboxError("TextWorldEngine.step before reset(task, seed)")
        command = clean_command(action)
        if self._obs.done:  # a finished episode stays finished
            ended = self._won or self._lost
            return StepResult(self._obs, 0.0, ended, self._truncated, self._info(command))
        self._step += 1
        self._fingerprint = None
        reward = 0.0
        if _is_meta(command):
            obs = Observation(REFUSED, self._obs.instruction, self._obs.admissible, False)
        else:
            gs = self._stack.step(command)
            score = int(gs.score or 0)
            won, lost = bool(gs.won), bool(gs.lost)
            reward = self._reward(score - self._score, won)
            self._score, self._won, self._lost = score, won, lost
            obs = self._observation(gs, False)
        terminated = self._won or self._lost
        self._truncated = not terminated and self._step >= self.max_steps
        if terminated or self._truncated:
            obs = Observation(obs.text, obs.instruction, obs.admissible, True)
        self._obs = obs
        return StepResult(obs, reward, terminated, self._truncated, self._info(command))

    def expert_action(self) -> str | None:
        """First command of TextWorld's shortest winning policy from here (None when done)."""
        if self._obs is None or self._obs.done:
            return None
        policy = self._stack.game_state.get("policy_commands") or []
        return policy[0] if policy else None

    def fingerprint(self) -> str:
        """Digest of the Z-machine state, TextWorld's world facts and quest progress, the
        task, step count, score and end flags."""
        if self._fingerprint is None:
            if self._obs is None:
                raise SandboxError("TextWorldEngine.fingerprint before reset(task, seed)")
            h = self._stack.digest()
            counters = (self._task, self._step, self._score, self._won, self._lost)
            h.update(repr((counters, self._truncated)).encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def close(self) -> None:
        """Shut the interpreter down (idempotent)."""
        self._roots.clear()
        self._stack.close()
        self._obs = None

    # -- native state ----------------------------------------------------------------------
    def get_state(self) -> TextWorldState:
        """The full state; later steps mutate nothing it holds."""
        if self._obs is None or self._task is None:
            raise SandboxError("TextWorldEngine.get_state before reset(task, seed)")
        return TextWorldState(
            task=self._task,
            seed=self._seed,
            stack=self._stack.capture(),
            step=self._step,
            score=self._score,
            won=self._won,
            lost=self._lost,
            truncated=self._truncated,
            observation=self._obs,
        )

    def set_state(self, state: TextWorldState) -> None:
        """Return to ``state`` (loading its game first if another one is loaded)."""
        if not isinstance(state, TextWorldState):
            raise SandboxError(f"expected a TextWorldState, got {type(state).__name__}")
        self._load(state.task)
        self._stack.restore(state.stack)
        self._task, self._seed = state.task, state.seed
        self._step, self._score = state.step, state.score
        self._won, self._lost, self._truncated = state.won, state.lost, state.truncated
        self._obs = state.observation
        self._fingerprint = None

    # -- helpers ---------------------------------------------------------------------------
    def _load(self, task: str) -> None:
        files = _game_files(task, self.cache_dir, self.on_corrupt)
        if self._stack.loaded != str(files.z8):
            game = _load_game(str(files.json))
            self._stack.load(str(files.z8), game)
            self._objective = game.objective or ""
            self._max_score = int(game.max_score or 0)

    def _observation(self, gs: Any, strip_banner: bool) -> Observation:
        admissible = gs.get("admissible_commands")
        return Observation(
            text=clean_text(gs.feedback or "", strip_banner),
            instruction=self._objective,
            admissible=None if admissible is None else tuple(admissible),
            done=False,
        )

    def _reward(self, delta: int, won: bool) -> float:
        if self.reward_mode == "win":
            return 1.0 if won else 0.0
        if self.reward_mode == "score":
            return float(delta)
        return delta / self._max_score if self._max_score else 0.0

    def _info(self, command: str) -> dict[str, Any]:
        return dict(
            command=command,
            score=self._score,
            max_score=self._max_score,
            won=self._won,
            lost=self._lost,
            steps=self._step,
        )


def tasks(
    split: str,
    n: int = 100,
    challenge: str = "tw-cooking",
    level: int = 1,
    start: int = 0,
    **_engine_options: Any,
) -> list[str]:
    """``n`` task names of one challenge and level for ``split`` ("train", "valid", "test").

    Challenges: tw-cooking (levels 1-4), tw-simple (1-4), tw-coin_collector (1-150, 201-233),
    tw-treasure_hunter (1-30); see :mod:`bpo.sandbox.envs.textworld_games`. Games are
    generated on first use; :func:`~bpo.sandbox.envs.textworld_games.ensure_games` makes a
    batch ahead of time.
    """
    return task_names(split, n=n, challenge=challenge, level=level, start=start)


def make(backend: str = "auto", **options: Any) -> Sandbox:
    """A sandbox over a :class:`TextWorldEngine` (``auto`` picks the native backend)."""
    from bpo.sandbox import make_sandbox

    for key in ("n", "challenge", "level", "start"):  # task-listing options (see tasks())
        options.pop(key, None)
    return make_sandbox(lambda: TextWorldEngine(**options), backend=backend)


ENVS.register("textworld")(
    EnvSpec(
        name="textworld",
        make=make,
        tasks=tasks,
        description=(
            "TextWorld tw-make games (" + ", ".join(CHALLENGES.names()) + ") on "
            "Jericho's Z-machine; native snapshots (about 1 ms, 40-120 KB)."
        ),
    )
)
