"""Solving, caching and listing the generated ALFWorld games of
:mod:`bpo.sandbox.envs.alfworld_games` (which builds their PDDL problems).

Whether a generated game is solvable is decided by ALFWorld's planner (fast-downward's
search, in a child process killed after ``planner_timeout``, 60 s by default) and its plan is
replayed in ALFWorld's text engine until the goal holds; only such games are listed, each with
that plan as its walkthrough. Verdicts are cached under ``$BPO_CACHE/alfworld`` (default
``~/.cache/bpo/alfworld``); the verdicts of the default task lists ship with the package
(``alfworld_games.json``, written by ``python -m bpo.sandbox.envs.alfworld_cache``), so listing
them plans nothing.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from bpo.sandbox.envs.alfworld_games import (
    GENERATOR_VERSION,
    TASK_TYPES,
    GeneratedProblem,
    game_data,
    generate_problem,
    split_floor_plans,
)
from bpo.sandbox.envs.alfworld_pddl import load_pddl_env


@dataclass(frozen=True)
class SolvedGame:
    """A generated game and the planner's verdict on it."""

    name: str
    problem: GeneratedProblem | None
    """None when the layout cannot host the task type."""
    walkthrough: tuple[str, ...] | None
    """The planner's plan as ALFWorld commands; None unless ``status == "solved"``."""
    status: str
    """"solved", "unsolvable" (no plan or the plan fails), "timeout" or "no_task"."""
    seconds: float = 0.0
    """Planner time when it was solved (not counting loading)."""


def parse_name(name: str) -> tuple[str, str, int]:
    """``"{task_type}/{floor_plan}/{seed}"`` -> its parts (ValueError naming the format)."""
    parts = name.split("/")
    if len(parts) != 3 or parts[0] not in TASK_TYPES or not parts[2].isdigit():
        raise ValueError(
            f"{name!r} is not a generated ALFWorld game name; expected "
            f"'{{task_type}}/FloorPlan{{n}}/{{seed}}' with task_type one of {', '.join(TASK_TYPES)}"
        )
    return parts[0], parts[1], int(parts[2])


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir`` or ``$BPO_CACHE/alfworld`` (default ``~/.cache/bpo/alfworld``)."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("BPO_CACHE", "~/.cache/bpo")).expanduser() / "alfworld"


_SHIPPED = Path(__file__).with_name("alfworld_games.json")


@lru_cache(maxsize=1)
def _shipped() -> dict:
    if not _SHIPPED.exists():
        return {}
    data = json.loads(_SHIPPED.read_text())
    return data["games"] if data.get("generator_version") == GENERATOR_VERSION else {}


def resolve(
    name: str, cache_dir: str | Path | None = None, planner_timeout: float = 60.0
) -> SolvedGame:
    """The game called ``name`` with its walkthrough: from the shipped table, the disk
    cache, or by running the planner now (slow: seconds to ``planner_timeout``)."""
    task_type, floor_plan, seed = parse_name(name)
    gen = generate_problem(task_type, floor_plan, seed)
    if gen is None:
        return SolvedGame(name, None, None, "no_task")
    path = cache_root(cache_dir) / f"v{GENERATOR_VERSION}" / "solved" / f"{name}.json"
    for entry in (_shipped().get(name), _read_json(path)):
        if entry is not None and entry["digest"] == gen.digest:
            walk = entry["walkthrough"]
            return SolvedGame(
                name, gen, tuple(walk) if walk else None, entry["status"], entry["seconds"]
            )
    walk, status, seconds = _solve_in_child(gen, planner_timeout)
    entry = {"digest": gen.digest, "status": status, "walkthrough": walk, "seconds": seconds}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, path)  # atomic: concurrent workers may solve the same game
    return SolvedGame(name, gen, tuple(walk) if walk else None, status, seconds)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def candidates(split: str, task_type: str) -> Iterator[str]:
    """Game names of ``split`` for ``task_type`` in a fixed order: every floor plan of the
    split once (seeded shuffle), then again with the next seed, and so on."""
    plans = split_floor_plans(split, task_type)
    random.Random(f"{split}/{task_type}").shuffle(plans)
    for seed in itertools.count():
        for plan in plans:
            yield f"{task_type}/{plan}/{seed}"


DEFAULT_PER_TYPE = {"train": 8, "valid": 2, "test": 4}
"""Games per task type that :func:`list_games` returns by default (these ship solved)."""


def list_games(
    split: str,
    per_type: int | None = None,
    task_types: Iterable[str] = TASK_TYPES,
    cache_dir: str | Path | None = None,
    planner_timeout: float = 60.0,
    max_tries: int = 200,
) -> list[str]:
    """The first ``per_type`` solvable games of each task type in ``split``. Fast for the
    defaults (shipped); otherwise it plans each new candidate once and caches the verdict."""
    per_type = DEFAULT_PER_TYPE[split] if per_type is None else per_type
    names: list[str] = []
    for task_type in task_types:
        found = 0
        for tries, name in enumerate(candidates(split, task_type)):
            if found >= per_type:
                break
            if tries >= max_tries:
                raise RuntimeError(
                    f"only {found} of {per_type} solvable {task_type} games in split {split!r} "
                    f"after {max_tries} candidates; ask for fewer or raise planner_timeout"
                )
            if resolve(name, cache_dir, planner_timeout).status == "solved":
                names.append(name)
                found += 1
    return names


def _solve_in_child(gen: GeneratedProblem, timeout: float) -> tuple[list[str] | None, str, float]:
    """Run :func:`solve_here` in a fresh interpreter whose planner search is killed by
    SIGALRM after ``timeout`` seconds (a C library call cannot be interrupted in-process)."""
    code = "from bpo.sandbox.envs.alfworld_cache import _child_main; _child_main()"
    payload = json.dumps({"problem": gen.problem, "goal_text": gen.goal_text, "timeout": timeout})
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            input=payload,
            text=True,
            capture_output=True,
            timeout=timeout + 120.0,
        )  # + loading
    except subprocess.TimeoutExpired:
        return None, "timeout", timeout
    if out.returncode == -signal.SIGALRM:
        return None, "timeout", timeout
    if out.returncode < 0:  # killed by another signal: the planner library crashed
        return None, "unsolvable", 0.0
    if out.returncode != 0:
        raise RuntimeError(f"the ALFWorld planner process failed:\n{out.stderr[-2000:]}")
    walk, status, seconds = json.loads(out.stdout.strip().splitlines()[-1])
    return walk, status, round(seconds, 3)


def _child_main() -> None:  # pragma: no cover - runs in the child interpreter
    request = json.loads(sys.stdin.read())
    print(json.dumps(solve_here(request["problem"], request["goal_text"], request["timeout"])))


def solve_here(
    problem: str, goal_text: str, alarm: float | None = None
) -> tuple[list[str] | None, str, float]:
    """Plan with ALFWorld's planner in this process and replay the plan in ALFWorld's text
    engine; returns ``(walkthrough, status, planner seconds)``. With ``alarm``, the process
    is killed (SIGALRM, default action) if the search takes longer: use in a child only."""
    import time

    env = load_pddl_env(game_data(problem, goal_text, None))
    try:
        t0 = time.perf_counter()
        if alarm is not None:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.setitimer(signal.ITIMER_REAL, alarm)
        plan = env._pddl_state.replan(env._entity_infos)
        signal.setitimer(signal.ITIMER_REAL, 0)
        seconds = time.perf_counter() - t0
        won = False
        for command in plan:
            if command not in env.state["admissible_commands"]:
                return None, "unsolvable", seconds
            _, _, won = env.step(command)
        return (plan, "solved", seconds) if plan and won else (None, "unsolvable", seconds)
    finally:
        env.close()


def pregenerate(
    path: Path = _SHIPPED,
    per_type: dict[str, int] = DEFAULT_PER_TYPE,
    cache_dir: str | Path | None = None,
    planner_timeout: float = 60.0,
) -> dict[str, dict]:
    """Solve the default game lists and write the table that ships with the package
    (``python -m bpo.sandbox.envs.alfworld_cache``); unsolvable candidates are kept too,
    so that listing never plans them again."""
    table: dict[str, dict] = {}
    for split, n in per_type.items():
        for task_type in TASK_TYPES:
            found = 0
            for name in candidates(split, task_type):
                if found >= n:
                    break
                game = resolve(name, cache_dir, planner_timeout)
                table[name] = {
                    "digest": game.problem.digest if game.problem else "",
                    "status": game.status,
                    "walkthrough": list(game.walkthrough) if game.walkthrough else None,
                    "seconds": game.seconds,
                }
                found += game.status == "solved"
                print(f"{name}: {game.status} ({game.seconds:.1f} s)", flush=True)
    data = {"generator_version": GENERATOR_VERSION, "games": table}
    path.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
    return table


if __name__ == "__main__":
    pregenerate()
