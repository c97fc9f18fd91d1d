"""Held-out success of TextWorld-Express runs, split by whether the game's gold path opens a door.

    .venv/bin/python scripts/twx_doors.py RUN_DIR [RUN_DIR ...]

Reads each run's ``summary.json`` (its ``eval_before`` / ``eval_after`` per-task success) and
asks the game's own expert (``getGoldActionSequence``) whether reaching the coin takes an
``open door to ...`` action. The README's default-run section uses it: on the default coin
games, RL raises success where no door is in the way and moves the door games less, both ways.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def needs_door(env, key: str, cache: dict[str, bool]) -> bool:
    from bpo.sandbox.envs.twx import parse_task

    if key not in cache:
        t = parse_task(key)
        env.reset(gameName=t.game, gameParams=t.params_str, gameFold=t.fold, seed=t.seed,
                  generateGoldPath=True)  # fmt: skip
        cache[key] = any(a.startswith("open door") for a in env.getGoldActionSequence())
    return cache[key]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    import textworld_express as twx

    env = twx.TextWorldExpressEnv(envStepLimit=100)
    cache: dict[str, bool] = {}
    print(
        "| run | games without a door: n, before -> after | games with a door: n, before -> after |"
    )
    print("| --- | --- | --- |")
    for run in argv:
        path = Path(run) / "summary.json"
        if not path.exists():
            print(f"{run}: no summary.json (not a finished bpo run)", file=sys.stderr)
            return 2
        s = json.loads(path.read_text())
        before, after = s["eval_before"]["per_task"], s["eval_after"]["per_task"]
        cells = []
        for door in (False, True):
            keys = [k for k in before if needs_door(env, k, cache) == door]
            if not keys:
                cells.append("0")
                continue
            b = sum(before[k] for k in keys) / len(keys)
            a = sum(after[k] for k in keys) / len(keys)
            cells.append(f"{len(keys)}, {b:.3f} -> {a:.3f}")
        print(f"| {run} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
