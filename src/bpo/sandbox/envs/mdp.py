"""``mdp``: the tabular MDPs of :mod:`bpo.analysis` as a text sandbox (exact values known).

Tasks are ``<family>-<n>``: ``random-<n>`` (a full tree MDP, H=3, 3 actions), ``agent-<n>``
(12 steps, two uncertain irreversible route choices, blunders end the episode) and ``chain-<n>``
(a walk on 5 positions for 8 steps, state aliasing). ``n`` seeds the MDP; the splits are
n = 0..59 (train), 60..79 (valid), 80..99 (test). ``trap-<n>`` and ``budget_trap-<n>`` (n
ignored) are the MDPs built to expose biased tree growing; they are in no split.

Observations name the step, the state and the actions; invalid text answers "Nothing
happens." without changing the state (the episode is truncated after ``max_steps`` actions,
valid or not). The success reward of Bernoulli MDPs is drawn from a hash of (reset seed,
terminal state): the sandbox is deterministic, so snapshots and replays are exact, and the
draw differs across seeds. ``expert_action`` is the action with the highest exact Q.
``info`` carries ``mdp_state`` and ``anchor`` (the MDP's fingerprint: the position in
``chain``), which is what GiGPO's step groups should compare.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np

from bpo.sandbox.envs import ENVS
from bpo.sandbox.protocol import EnvSpec, Observation, Sandbox, StepResult

NOTHING = "Nothing happens."
_SPLITS = {"train": range(0, 60), "valid": range(60, 80), "test": range(80, 100)}
FAMILIES = ("random", "agent", "chain")
EXTRA = ("trap", "budget_trap")
"""Families built to expose biases (bpo.analysis.families); not in the task lists."""
_LABELS = {
    "trap": ("choose a", "choose b"),
    "budget_trap": ("choose a", "choose b"),
    "random": ("choose a", "choose b", "choose c"),
    "agent": ("option 1", "option 2"),
    "chain": ("go left", "stay", "go right"),
}


def build_task(task: str) -> Any:
    """The :class:`~bpo.analysis.mdp.TabularMDP` of a task name ``<family>-<n>``."""
    from bpo.analysis.families import agent, budget_trap, chain, random_tree, trap

    m = re.fullmatch(r"(random|agent|chain|trap|budget_trap)-(\d+)", task)
    if m is None:
        raise ValueError(
            f"unknown mdp task {task!r}; tasks are named '<family>-<n>' with family one of "
            f"{', '.join(FAMILIES + EXTRA)} (e.g. 'agent-3')"
        )
    family, n = m.group(1), int(m.group(2))
    if family == "trap":
        return trap()
    if family == "budget_trap":
        return budget_trap()
    if family == "random":
        return random_tree(seed=n, horizon=3, actions=3)
    if family == "agent":
        return agent(seed=n, horizon=12, decisions=(2 + n % 3, 8 + n % 3))
    return chain(seed=n, length=5, horizon=8)


def labels_of(task: str) -> tuple[str, ...]:
    """The action texts of a task, in action order."""
    mdp = build_task(task)
    return _LABELS[task.split("-")[0]][: mdp.num_actions]


class MDPEngine:
    """A tabular MDP as an :class:`~bpo.sandbox.protocol.Engine` with native state."""

    def __init__(self, max_steps: int | None = None) -> None:
        self.max_steps = max_steps
        self._cache: dict[str, tuple[Any, np.ndarray]] = {}
        self._s: dict[str, Any] = {}

    # -- Engine ----------------------------------------------------------------------------
    def reset(self, task: str, seed: int) -> Observation:
        self._load(task)
        self._s = {"task": task, "seed": int(seed), "state": 0, "steps": 0, "done": False}
        mdp = self._mdp
        return self._obs(f"A new episode of {mdp.horizon} steps begins. {self._where()}")

    def step(self, action: str) -> StepResult:
        s = self._s
        if not s:
            raise RuntimeError("step() before reset()")
        mdp = self._mdp
        if s["done"]:
            over = bool(mdp.terminal[s["state"]])
            info = {"mdp_state": s["state"], "anchor": int(mdp.fingerprint[s["state"]])}
            return StepResult(self._obs("The episode is over."), 0.0, over, not over, info)
        s["steps"] += 1
        command = " ".join(action.lower().split())
        labels = self._labels()
        reward, text, terminated = 0.0, NOTHING, False
        if command in labels:
            a = labels.index(command)
            state = s["state"]
            nxt = int(mdp.next_state[state, a])
            reward = float(mdp.step_reward[state, a])
            s["state"] = nxt
            if mdp.terminal[nxt]:
                reward += self._terminal_reward(nxt)
                terminated = True
                text = f"You chose {command!r}. The episode is over (reward {reward:g})."
            else:
                text = f"You chose {command!r}. {self._where()}"
        limit = self.max_steps if self.max_steps is not None else 4 * mdp.horizon
        truncated = not terminated and s["steps"] >= limit
        s["done"] = terminated or truncated
        info = {"mdp_state": s["state"], "anchor": int(mdp.fingerprint[s["state"]])}
        return StepResult(self._obs(text), reward, terminated, truncated, info)

    def fingerprint(self) -> str:
        s = self._s
        text = repr(sorted(s.items()))
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def expert_action(self) -> str | None:
        s = self._s
        if not s or s["done"]:
            return None
        q = self._q[s["state"]]
        return self._labels()[int(np.argmax(q))]

    def close(self) -> None:
        self._s = {}

    # -- NativeState -------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        return dict(self._s)

    def set_state(self, state: dict[str, Any]) -> None:
        self._load(state["task"])
        self._s = dict(state)

    # -- internals -----------------------------------------------------------------------------
    def _load(self, task: str) -> None:
        if task not in self._cache:
            from bpo.analysis.mdp import exact

            mdp = build_task(task)
            self._cache[task] = (mdp, exact(mdp).q)
        self._mdp, self._q = self._cache[task]

    def _labels(self) -> tuple[str, ...]:
        family = self._s["task"].split("-")[0]
        return _LABELS[family][: self._mdp.num_actions]

    def _terminal_reward(self, state: int) -> float:
        mdp = self._mdp
        mean = float(mdp.terminal_reward[state])
        if mdp.noise != "bernoulli":
            return mean
        digest = hashlib.blake2b(f"{self._s['seed']}:{state}".encode(), digest_size=8).digest()
        u = int.from_bytes(digest, "big") / 2.0**64
        return 1.0 if u < mean else 0.0

    def _where(self) -> str:
        mdp, st = self._mdp, self._s["state"]
        place = (
            f"position {int(mdp.fingerprint[st])}"
            if self._s["task"].startswith("chain")
            else f"state {st}"
        )
        return f"Step {int(mdp.step[st])} of {mdp.horizon}: you are at {place}."

    def _obs(self, text: str) -> Observation:
        s = self._s
        mdp = self._mdp
        live = not s["done"] and not mdp.terminal[s["state"]]
        return Observation(
            text=text,
            instruction=f"Collect as much reward as you can. ({mdp.description})",
            admissible=self._labels() if live else (),
            done=s["done"],
        )


def make(backend: str = "auto", max_steps: int | None = None, **backend_options: Any) -> Sandbox:
    """An MDP sandbox; ``backend_options`` go to the snapshot backend."""
    from bpo.sandbox.snapshots import make_sandbox

    return make_sandbox(lambda: MDPEngine(max_steps), backend, **backend_options)


def tasks(split: str, families: tuple[str, ...] = FAMILIES, **_: Any) -> list[str]:
    """Task names of a split: ``<family>-<n>`` for n in 0..59 / 60..79 / 80..99."""
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(_SPLITS)}")
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        raise ValueError(f"unknown mdp families {bad}; valid: {', '.join(FAMILIES)}")
    return [f"{f}-{i}" for f in families for i in _SPLITS[split]]


ENVS.register("mdp")(
    EnvSpec("mdp", make, tasks, "tabular MDPs with exact values (bpo.analysis families)")
)
