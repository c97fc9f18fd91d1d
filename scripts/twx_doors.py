"""Held-out success of TextWorld-Express runs, split by whether the game's gold path opens a door.

    .venv/bin/python scripts/twx_doors.py RUN_DIR [RUN_DIR ...]

Reads each run's ``summary.json`` (its ``eval_before`` / ``eval_after`` per-task success) and
asks the game's own gold agent (seeded, as ``bpo``'s TextWorld-Express sandbox runs it for the
warm start's demos) whether reaching the coin takes an ``open door to ...`` action. The README's
default-run section uses it: on the default coin games, RL raises success where no door is in
the way and moves the door games less, both ways.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def needs_door(engine, key: str, cache: dict[str, bool]) -> bool:
    """Whether the seeded gold path of game ``key`` (the one the warm start's demos follow)
    opens a door."""
    if key not in cache:
        engine.reset(key, 0)  # the key carries its own seed
        cache[key] = any(a.startswith("open door") for a in engine.gold_path())
    return cache[key]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    missing = [run for run in argv if not (Path(run) / "summary.json").exists()]
    if missing:
        print(f"no summary.json (not a finished bpo run): {', '.join(missing)}", file=sys.stderr)
        return 2
    from bpo.sandbox.envs.twx import TwxEngine

    engine = TwxEngine()
    cache: dict[str, bool] = {}
    print(
        "| run | games without a door: n, before -> after | games with a door: n, before -> after |"
    )
    print("| --- | --- | --- |")
    try:
        for run in argv:
            s = json.loads((Path(run) / "summary.json").read_text())
            before, after = s["eval_before"]["per_task"], s["eval_after"]["per_task"]
            cells = []
            for door in (False, True):
                keys = [k for k in before if needs_door(engine, k, cache) == door]
                if not keys:
                    cells.append("0")
                    continue
                b = sum(before[k] for k in keys) / len(keys)
                a = sum(after[k] for k in keys) / len(keys)
                cells.append(f"{len(keys)}, {b:.3f} -> {a:.3f}")
            print(f"| {run} | {cells[0]} | {cells[1]} |")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
