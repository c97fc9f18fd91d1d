"""TextWorld's own game stack with exact state capture (the native snapshot of
:mod:`bpo.sandbox.envs.textworld`).

TextWorld plays a generated game through wrappers around Jericho's Z-machine:
``TWInform7 -> StateTracking -> Inform7Data -> GameData -> JerichoEnv``. Their state is the
Z-machine's (RAM, stack, registers, RNG) plus a few Python fields per wrapper, the largest
being ``StateTracking``'s ``GameProgression`` (world facts, quest and event trees) that an
action mutates in place. :meth:`TextWorldStack.capture` takes the Z-machine's
``get_state()`` (15 us), a private copy of the progression (copied the way TextWorld's own
``copy()`` copies it, without re-running its constructor's searches) and the other fields
(the current ``GameState`` shallowly: nothing in it is mutated after its step).
:meth:`TextWorldStack.restore` puts them back, copying the progression again so one capture
restores any number of times. The interpreter itself is never copied (``env.copy()`` starts
a new one: 130-550 ms), and nothing here ever owns a second interpreter, so no wrapper's
``__del__`` can close a shared one.
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from dataclasses import dataclass
from typing import Any

from bpo.sandbox.protocol import SandboxError

__all__ = ["StackState", "TextWorldStack"]


@dataclass(frozen=True, eq=False, slots=True)
class StackState:
    """The captured state of a :class:`TextWorldStack`. Slotted, so that generic size
    estimators do not walk into the shared ``Game`` it references (use ``nbytes``)."""

    zmachine: tuple[Any, ...]
    """Jericho's ``FrotzEnv.get_state()``: RAM, stack, pc, sp, fp, frames, opcode, RNG, text."""
    game_state: dict[str, Any]
    """The current ``GameState``'s entries (its progression entry is refreshed on restore)."""
    progression: Any
    """A private copy of ``StateTracking._game_progression``."""
    tracking: tuple[Any, ...]
    """``StateTracking``'s last action, previous and current winning policy, moves."""
    prev_state: Any
    """``Inform7Data._prev_state`` (a finished step's ``GameState``: never mutated)."""
    tracked_infos: tuple[str, ...]
    nbytes: int
    """Bytes held privately: the Z-machine arrays plus ~200 per copied fact or tree node."""


def _copy_progression(gp: Any) -> Any:
    """``GameProgression.copy()`` without its constructor's action search: same fields."""
    new = copy.copy(gp)
    new.state = gp.state.copy()
    new.quest_progressions = [_copy_quest(qp) for qp in gp.quest_progressions]
    return new


def _copy_quest(qp: Any) -> Any:
    new = copy.copy(qp)
    new.win_events = [_copy_event(e) for e in qp.win_events]
    new.fail_events = [_copy_event(e) for e in qp.fail_events]
    return new


def _copy_event(ep: Any) -> Any:
    new = copy.copy(ep)
    new._tree = ep._tree.copy()
    return new


def _event_flags(qp: Any) -> list[tuple[bool, bool, int]]:
    return [(e.triggered, e.untriggerable, len(e._policy)) for e in qp.win_events + qp.fail_events]


class TextWorldStack:
    """One interpreter and TextWorld's wrappers (textworld 1.7) for playing cached games."""

    def __init__(self, admissible: bool, expert: bool) -> None:
        from textworld import EnvInfos
        from textworld.envs import JerichoEnv, TWInform7
        from textworld.envs.wrappers.tw_inform7 import GameData, Inform7Data, StateTracking

        infos = EnvInfos(
            admissible_commands=admissible,
            policy_commands=expert,
            objective=True,
            max_score=True,
            score=True,
            won=True,
            lost=True,
            feedback=True,
            last_action=not (admissible or expert),  # keeps state tracking on
        )
        self.env = TWInform7(JerichoEnv(infos))
        self._tracking = self.env._wrapped_env
        self._i7 = self._tracking._wrapped_env
        self._gamedata = self._i7._wrapped_env
        self._zenv = self._gamedata._wrapped_env
        layout = (type(self._tracking), type(self._i7), type(self._gamedata), type(self._zenv))
        if layout != (StateTracking, Inform7Data, GameData, JerichoEnv):
            raise SandboxError(
                f"unexpected TextWorld wrapper layout {layout}: bpo's TextWorld adapter was "
                "written for textworld 1.7 (pip install 'textworld>=1.7,<1.8')"
            )
        self.loaded: str | None = None
        """Path of the game file in the interpreter."""

    def load(self, z8: str, game: Any) -> None:
        """Load a game file; ``game`` is its already parsed TextWorld ``Game``."""
        self._zenv._game = game  # GameData/StateTracking take it instead of re-parsing
        with warnings.catch_warnings():  # Jericho's own score detection does not know
            warnings.simplefilter("ignore")  # TextWorld games ("not fully supported")
            self.env.load(z8)
        self.loaded = z8

    def reset(self, seed: int) -> Any:
        """Start the loaded game; returns TextWorld's ``GameState``."""
        self._zenv.seed(seed % (2**31 - 2) + 1)  # Jericho reads 0 as "random per run"
        return self.env.reset()

    def step(self, command: str) -> Any:
        """Send one (clean, single-line) command; returns TextWorld's ``GameState``."""
        return self.env.step(command)[0]

    @property
    def game_state(self) -> Any:
        return self._tracking.state

    def capture(self) -> StackState:
        """The full state; later steps mutate nothing it holds."""
        z = self._zenv._jericho.get_state()
        tr = self._tracking
        progression = _copy_progression(tr._game_progression)
        nodes = sum(map(len, progression.state._facts.values())) + sum(
            1 + len(e._policy)
            for qp in progression.quest_progressions
            for e in qp.win_events + qp.fail_events
        )
        return StackState(
            zmachine=z,
            game_state=dict(tr.state),
            progression=progression,
            tracking=(
                tr._last_action,
                tr._previous_winning_policy,
                tr._current_winning_policy,
                tr._moves,
            ),
            prev_state=self._i7._prev_state,
            tracked_infos=tuple(self._i7._tracked_infos),
            nbytes=z[0].nbytes + z[1].nbytes + len(z[8]) + 200 * nodes,
        )

    def restore(self, state: StackState) -> None:
        """Return to ``state`` (its game must be the loaded one)."""
        from textworld.core import GameState

        self._zenv._jericho.set_state(state.zmachine)
        self._zenv._reset = True
        progression = _copy_progression(state.progression)
        gs = GameState(state.game_state)
        gs["_game_progression"] = progression
        for layer in (self._zenv, self._gamedata, self._i7, self._tracking):
            layer.state = gs  # the layers share one GameState per step
        self._i7._prev_state = state.prev_state
        self._i7._tracked_infos = list(state.tracked_infos)
        tr = self._tracking
        tr._game_progression = progression
        (
            tr._last_action,
            tr._previous_winning_policy,
            tr._current_winning_policy,
            tr._moves,
        ) = state.tracking

    def digest(self) -> hashlib.blake2b:
        """A hash of the Z-machine state, the world facts and the quest progress."""
        ram, stack, pc, sp, fp, frames, opcode, rng, text = self._zenv._jericho.get_state()
        gp = self._tracking._game_progression
        quests = [(qp.nb_completions, _event_flags(qp)) for qp in gp.quest_progressions]
        h = hashlib.blake2b(digest_size=16)
        for part in (ram.tobytes(), stack.tobytes(), text):
            h.update(part)
        h.update(repr((pc, sp, fp, frames, opcode, [int(x) for x in rng], quests)).encode())
        h.update("\n".join(sorted(map(str, gp.state.facts))).encode())
        return h

    def close(self) -> None:
        self.env.close()
        self.loaded = None
