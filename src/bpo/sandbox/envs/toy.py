"""``toy``: a tiny deterministic text game built in, for tests and benchmarks of sandboxes.

A row of rooms; the last one, the vault, is behind a locked door. Find the key (sometimes in
a chest), unlock and open the door, take the treasure (reward 1, terminal). The layout is a
pure function of the task (``keydoor-<n>``); the seed drives an engine-owned random stream
of ambient noises, so that snapshots must capture a random generator's state to be exact.
Invalid actions answer "Nothing happens." The engine implements ``NativeState`` and can
carry ``ballast_mb`` megabytes of Python objects that steps rewrite (for memory tests).
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from bpo.sandbox.envs import ENVS
from bpo.sandbox.protocol import EnvSpec, Observation, Sandbox, StepResult

INSTRUCTION = "Find the key, unlock the door to the vault and take the treasure."
NOTHING = "Nothing happens."
_NAMES = ("hall", "kitchen", "library", "study", "cellar", "pantry")
_TRINKETS = ("coin", "lamp", "book")
_NOISES = ("A rat scurries past.", "The wind howls.", "Somewhere, water drips.")
_SPLITS = {"train": range(0, 60), "valid": range(60, 80), "test": range(80, 100)}


def layout(task: str) -> dict[str, Any]:
    """The game of ``task`` ("keydoor-<n>"): rooms, key place, start, trinkets."""
    m = re.fullmatch(r"keydoor-(\d+)", task)
    if m is None:
        raise ValueError(f"unknown toy task {task!r}; toy tasks are named 'keydoor-<n>'")
    n = int(m.group(1))
    rng = random.Random(n)
    rooms = [*rng.sample(_NAMES, 2 + n % 3), "vault"]  # 3 to 5 rooms, vault last
    key_room = rng.randrange(len(rooms) - 1)
    items: list[list[str]] = [[] for _ in rooms]
    items[-1].append("treasure")
    for trinket in rng.sample(_TRINKETS, 1 + n % 2):
        items[rng.randrange(len(rooms) - 1)].append(trinket)
    in_chest = (n // 3) % 2 == 1
    if in_chest:
        items[key_room].append("chest")
    else:
        items[key_room].append("key")
    return {
        "rooms": rooms,
        "key_room": key_room,
        "items": items,
        "in_chest": in_chest,
        "start": rng.randrange(len(rooms) - 1),
    }


class KeyDoorEngine:
    """The toy game as an :class:`~bpo.sandbox.protocol.Engine` with native state."""

    def __init__(self, max_steps: int = 40, ballast_mb: float = 0.0) -> None:
        self.max_steps = max_steps
        self._ballast: list[tuple[int, str]] = [
            (i, f"ballast-{i}") for i in range(int(ballast_mb * 1e6 / 168))
        ]
        self._s: dict[str, Any] = {}

    # -- Engine ----------------------------------------------------------------------------
    def reset(self, task: str, seed: int) -> Observation:
        game = layout(task)
        self._s = {
            "task": task,
            "rooms": game["rooms"],
            "key_room": game["key_room"],
            "items": [sorted(x) for x in game["items"]],
            "room": game["start"],
            "inventory": [],
            "chest_open": False,
            "door": "locked",
            "steps": 0,
            "done": False,
            "rng": random.Random(seed),
            "mark": "",
        }
        return self._obs(f"You are in the {self._name()}. {self._describe()}")

    def step(self, action: str) -> StepResult:
        s = self._s
        s["steps"] += 1
        command = " ".join(action.lower().split())
        reward, text = 0.0, NOTHING
        if command in self._admissible():
            reward, text = self._apply(command)
        if s["rng"].random() < 0.3:
            text += " " + s["rng"].choice(_NOISES)
        self._touch_ballast(command)
        terminated = reward > 0
        truncated = not terminated and s["steps"] >= self.max_steps
        s["done"] = terminated or truncated
        return StepResult(
            self._obs(text), reward, terminated, truncated, {"won": terminated, "steps": s["steps"]}
        )

    def fingerprint(self) -> str:
        s = self._s
        plain = {k: v for k, v in s.items() if k != "rng"}
        text = repr((sorted(plain.items()), s["rng"].getstate() if s else None))
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def expert_action(self) -> str | None:
        s = self._s
        if not s or s["done"]:
            return None
        vault = len(s["rooms"]) - 1
        if s["room"] == vault:
            return "take treasure"
        if s["door"] == "open":
            return "go east"
        if "key" in s["inventory"]:
            if s["room"] != vault - 1:
                return "go east" if s["room"] < vault - 1 else "go west"
            return "unlock door with key" if s["door"] == "locked" else "open door"
        if s["room"] != s["key_room"]:
            return "go east" if s["room"] < s["key_room"] else "go west"
        return "open chest" if "chest" in self._here() and not s["chest_open"] else "take key"

    def close(self) -> None:
        self._s = {}

    # -- NativeState -------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        s = self._s
        state = {k: v for k, v in s.items() if k not in ("rng", "items", "inventory")}
        state.update(
            items=[list(x) for x in s["items"]],
            inventory=list(s["inventory"]),
            rng=s["rng"].getstate(),
            ballast=list(self._ballast),
        )
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        rng = random.Random()
        rng.setstate(state["rng"])
        self._ballast = list(state["ballast"])
        self._s = {k: v for k, v in state.items() if k not in ("rng", "ballast")}
        self._s.update(
            items=[list(x) for x in state["items"]], inventory=list(state["inventory"]), rng=rng
        )

    # -- the game ------------------------------------------------------------------------------
    def _name(self) -> str:
        return self._s["rooms"][self._s["room"]]

    def _here(self) -> list[str]:
        return self._s["items"][self._s["room"]]

    def _describe(self) -> str:
        s = self._s
        room, vault = s["room"], len(s["rooms"]) - 1
        exits = [d for d, ok in (("west", room > 0), ("east", room < vault)) if ok]
        parts = [f"Exits: {', '.join(exits)}."]
        if room == vault - 1:
            parts.append(f"A {s['door']} door leads east.")
        seen = [
            f"a {x} ({'open' if s['chest_open'] else 'closed'})" if x == "chest" else f"a {x}"
            for x in self._here()
        ]
        if seen:
            parts.append(f"You see {', '.join(seen)}.")
        return " ".join(parts)

    def _admissible(self) -> list[str]:
        s = self._s
        if not s or s["done"]:
            return []
        room, vault = s["room"], len(s["rooms"]) - 1
        acts = ["look", "inventory"]
        if room > 0:
            acts.append("go west")
        if room < vault - 1 or (room == vault - 1 and s["door"] == "open"):
            acts.append("go east")
        acts += [f"take {x}" for x in self._here() if x != "chest"]
        if "chest" in self._here() and not s["chest_open"]:
            acts.append("open chest")
        if room == vault - 1 and s["door"] == "locked" and "key" in s["inventory"]:
            acts.append("unlock door with key")
        if room == vault - 1 and s["door"] == "closed":
            acts.append("open door")
        return sorted(acts)

    def _apply(self, command: str) -> tuple[float, str]:
        s = self._s
        verb, _, rest = command.partition(" ")
        if command == "look":
            return 0.0, f"You are in the {self._name()}. {self._describe()}"
        if command == "inventory":
            return 0.0, f"You carry: {', '.join(s['inventory']) or 'nothing'}."
        if verb == "go":
            s["room"] += 1 if rest == "east" else -1
            return 0.0, f"You are in the {self._name()}. {self._describe()}"
        if verb == "take":
            self._here().remove(rest)
            s["inventory"] = sorted([*s["inventory"], rest])
            if rest == "treasure":
                return 1.0, "You take the treasure. You win!"
            return 0.0, f"You take the {rest}."
        if command == "open chest":
            s["chest_open"] = True
            self._here().append("key")
            self._here().sort()
            return 0.0, "You open the chest. Inside is a key."
        if command == "unlock door with key":
            s["door"] = "closed"
            return 0.0, "You unlock the door."
        s["door"] = "open"  # "open door"
        return 0.0, "You open the door. The vault lies east."

    def _touch_ballast(self, command: str) -> None:
        if self._ballast:  # rewrite a few entries, as a real engine's state churns
            k = int(
                hashlib.blake2b(
                    f"{self._s['steps']}:{command}".encode(), digest_size=4
                ).hexdigest(),
                16,
            )
            for j in range(8):
                i = (k + j * 7919) % len(self._ballast)
                self._ballast[i] = (i, f"{command[:16]}@{self._s['steps']}")
            self._s["mark"] = hashlib.blake2b(
                f"{self._s['mark']}{k}".encode(), digest_size=8
            ).hexdigest()

    def _obs(self, text: str) -> Observation:
        return Observation(
            text=text,
            instruction=INSTRUCTION,
            admissible=tuple(self._admissible()),
            done=self._s["done"],
        )


def make(
    backend: str = "auto", max_steps: int = 40, ballast_mb: float = 0.0, **backend_options: Any
) -> Sandbox:
    """A toy sandbox; ``backend_options`` go to the snapshot backend (e.g. ``step_timeout``)."""
    from bpo.sandbox.snapshots import make_sandbox

    return make_sandbox(lambda: KeyDoorEngine(max_steps, ballast_mb), backend, **backend_options)


def tasks(split: str, **_: Any) -> list[str]:
    """Task names of a split: train keydoor-0..59, valid 60..79, test 80..99."""
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(_SPLITS)}")
    return [f"keydoor-{i}" for i in _SPLITS[split]]


ENVS.register("toy")(EnvSpec("toy", make, tasks, "built-in key-and-door text rooms (tests)"))
