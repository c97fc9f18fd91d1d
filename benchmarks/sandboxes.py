"""Sandboxes: steps/s, reset latency, snapshot and restore latency and bytes, per environment x
snapshot backend (DESIGN sections 2 and 8).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/sandboxes.py [--quick] [--json PATH]

For each case (an environment, one task, the backends that apply to it):

1. **build**: ``make_env`` wall time (the fork backend starts its engine process here);
2. **reset**: the first reset of the fresh sandbox (loads the game; later sandboxes of the same
   game may find it cached in this process), then the median of ``--resets`` warm resets,
   each after a few steps;
3. **steps/s**: ``--steps`` steps of random admissible actions (seeded; ScienceWorld, which lists
   no actions by default, follows its gold path and then looks around), resetting when an
   episode ends; only ``step()`` is timed;
4. **snapshot / restore**: a fixed non-terminal *walk* (random admissible actions that do not
   end the episode, found once per case) is followed to depth ``d``; then, ``--repeats``
   times: snapshot, three more walk steps, read ``stats().live_bytes`` (what the one live
   snapshot holds), restore, release. Medians and p90 over the repeats. Every restore is
   checked: the fingerprint after it must equal the one at the snapshot (``exact`` column).
   Depth 5 for every backend; the replay backend also at depth 20 (its restore replays the
   prefix). Where an episode cannot last that long (the tabular MDPs), the deepest depth the
   walk reaches is used instead.

Targets (reported, not asserted; DESIGN section 8): native snapshot + restore <= 3 ms on
TextWorld and ALFWorld; fork server <= 10 ms for an engine holding 50 MB (the toy game with
``ballast_mb=50``, as in ``benchmarks/snapshots.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common import (
    Latency,
    Stopwatch,
    fmt_bytes,
    fmt_num,
    load_average,
    machine_info,
    markdown_table,
    write_json,
)

from bpo.sandbox import Sandbox, make_env

AFTER = 3
"""Walk steps taken between a snapshot and its restore."""


@dataclass(frozen=True)
class Case:
    """One environment and task, with the backends that apply to it."""

    label: str
    env: str
    task: str
    backends: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)
    """``make_env`` options (engine options, and backend options where the env passes them)."""
    fallback: tuple[str, ...] = ("look", "inventory")
    """Actions that never end an episode, used where no admissible action is safe."""
    expert_first: bool = False
    """Choose the expert's action (gold path) before the fallback (no admissible list)."""
    slow: bool = False
    """Fewer repeats (each step or replay takes tens of milliseconds or more)."""
    targets: dict[str, float] = field(default_factory=dict)
    """Snapshot + restore target in ms (median) per backend, where DESIGN states one."""


TW_COOKING = "tw-cooking/level=1/split=train/seed=0"
TW_COIN = "tw-coin_collector/level=5/seed=0"
ALF_PLACE = "pick_and_place_simple/FloorPlan315/0"
SW_BOIL = "boil/var=0"
SW_FALLBACK = ("look around", "inventory")

CASES: tuple[Case, ...] = (
    Case("textworld cooking", "textworld", TW_COOKING, ("native", "replay", "fork", "pickle"),
         {"max_steps": 200}, targets={"native": 3.0}),
    Case("textworld coin", "textworld", TW_COIN, ("native", "replay", "fork", "pickle"),
         {"max_steps": 200}, targets={"native": 3.0}),
    Case("alfworld pick&place", "alfworld", ALF_PLACE, ("native", "fork"),
         {"max_steps": 200}, targets={"native": 3.0}),
    Case("scienceworld boil", "scienceworld", SW_BOIL, ("replay",), {},
         fallback=SW_FALLBACK, expert_first=True, slow=True),
    Case("twx coin", "twx", "coin/seed=0/numLocations=3", ("replay",), {},
         fallback=SW_FALLBACK),
    Case("twx cookingworld", "twx", "cookingworld/seed=0", ("replay",), {},
         fallback=SW_FALLBACK),
    Case("mdp agent", "mdp", "agent-0", ("native", "replay"), {}, fallback=()),
    Case("toy", "toy", "keydoor-4", ("native", "replay", "pickle", "fork"), {"max_steps": 200}),
    Case("toy + 50 MB", "toy", "keydoor-4", ("fork", "native", "pickle"),
         {"max_steps": 200, "ballast_mb": 50.0}, slow=True, targets={"fork": 10.0}),
)  # fmt: skip


@dataclass
class Settings:
    steps: int
    resets: int
    repeats: int
    depths: tuple[int, int]
    seed: int = 0


# -- walks and actions ------------------------------------------------------------------------


def _candidates(sb: Sandbox, case: Case, rng: random.Random) -> list[str]:
    """Actions to try in the current state, in order."""
    obs = sb.observation()
    first: list[str] = []
    if case.expert_first:
        expert = sb.expert_action()
        first = [expert] if expert else []
    adm = list(obs.admissible or ())
    rng.shuffle(adm)
    fallback = list(case.fallback)
    rng.shuffle(fallback)
    return first + adm + fallback


def make_walk(sb: Sandbox, case: Case, length: int, seed: int) -> list[str]:
    """A walk of up to ``length`` actions from the task's start that never ends the episode
    (found with snapshots: a step that ends it is undone and another action tried)."""
    rng = random.Random(seed)
    sb.reset(case.task, 0)
    walk: list[str] = []
    while len(walk) < length:
        snap = sb.snapshot()
        for action in _candidates(sb, case, rng)[:12]:
            if not sb.step(action).observation.done:
                walk.append(action)
                break
            sb.restore(snap)
        else:
            sb.release(snap)
            break  # every action ends the episode here (a horizon): the walk stops
        sb.release(snap)
    return walk


def _play_action(sb: Sandbox, case: Case, rng: random.Random) -> str:
    obs = sb.observation()
    if case.expert_first and (expert := sb.expert_action()):
        return expert
    if obs.admissible:
        return rng.choice(obs.admissible)
    return rng.choice(case.fallback)


# -- measurements -----------------------------------------------------------------------------


def steps_per_second(sb: Sandbox, case: Case, steps: int, seed: int) -> dict[str, float]:
    """Random admissible play (reset when an episode ends); only ``step`` is timed."""
    rng = random.Random(seed)
    sb.reset(case.task, 0)
    watch = Stopwatch()
    episodes = 1
    for _ in range(steps):
        action = _play_action(sb, case, rng)
        with watch:
            result = sb.step(action)
        if result.observation.done:
            sb.reset(case.task, 0)
            episodes += 1
    return {"steps_per_s": steps / watch.total, "play_episodes": episodes}


def warm_resets(sb: Sandbox, case: Case, walk: list[str], n: int) -> Latency:
    """Reset latency after a few steps into the episode (the game is loaded already)."""
    laps = []
    for i in range(n):
        for action in walk[: 1 + i % 3]:
            sb.step(action)
        t0 = time.perf_counter()
        sb.reset(case.task, 0)
        laps.append(time.perf_counter() - t0)
    return Latency.of(laps)


def snapshot_cycle(sb: Sandbox, case: Case, walk: list[str], depth: int, repeats: int) -> dict:
    """Snapshot at ``depth``, step ``AFTER`` times, restore, release; ``repeats`` times."""
    sb.reset(case.task, 0)
    for action in walk[:depth]:
        sb.step(action)
    snap_s, restore_s, held = [], [], []
    exact = True
    for _ in range(repeats):
        before = sb.fingerprint()
        t0 = time.perf_counter()
        snap = sb.snapshot()
        snap_s.append(time.perf_counter() - t0)
        for action in walk[depth : depth + AFTER]:
            sb.step(action)
        held.append(sb.stats().live_bytes)
        t0 = time.perf_counter()
        sb.restore(snap)
        restore_s.append(time.perf_counter() - t0)
        exact = exact and sb.fingerprint() == before
        sb.release(snap)
    stats = sb.stats()
    snap_l, rest_l = Latency.of(snap_s), Latency.of(restore_s)
    pair = Latency.of([a + b for a, b in zip(snap_s, restore_s, strict=True)])
    return {
        "depth": depth,
        "repeats": repeats,
        "snapshot": snap_l,
        "restore": rest_l,
        "snapshot_plus_restore": pair,
        "live_bytes": sorted(held)[len(held) // 2],
        "exact": exact,
        "live_after": stats.live,
        "replayed": stats.replayed,
        "evicted": stats.evicted,
    }


def measure(case: Case, backend: str, walk: list[str], cfg: Settings) -> list[dict]:
    """Every measurement of one case under one backend; one row per snapshot depth."""
    t0 = time.perf_counter()
    sb = make_env(case.env, backend, **case.options)
    build_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        sb.reset(case.task, 0)
        first_reset_s = time.perf_counter() - t0
        resets = warm_resets(sb, case, walk, max(2, cfg.resets // (3 if case.slow else 1)))
        play = steps_per_second(sb, case, cfg.steps // (3 if case.slow else 1), cfg.seed)
        wanted = [cfg.depths[0]] + ([cfg.depths[1]] if backend == "replay" else [])
        depths = sorted({max(0, min(d, len(walk) - AFTER)) for d in wanted})
        rows = []
        for depth in depths:
            repeats = cfg.repeats
            if case.slow and (backend in ("replay", "pickle") or case.env == "scienceworld"):
                repeats = max(3, cfg.repeats // 4)
            cyc = snapshot_cycle(sb, case, walk, depth, repeats)
            rows.append(
                {
                    "case": case.label,
                    "env": case.env,
                    "task": case.task,
                    "backend": backend,
                    "build_s": build_s,
                    "first_reset_ms": 1e3 * first_reset_s,
                    "reset": resets,
                    **play,
                    **cyc,
                    "target_ms": case.targets.get(backend),
                }
            )
        return rows
    finally:
        sb.close()


def run_case(case: Case, cfg: Settings) -> list[dict]:
    """Find the walk once (first backend), then measure every backend on it."""
    walk_len = cfg.depths[1] + AFTER
    sb = make_env(case.env, case.backends[0], **case.options)
    try:
        walk = make_walk(sb, case, walk_len, cfg.seed)
    finally:
        sb.close()
    rows = []
    for backend in case.backends:
        print(f"  {case.label} / {backend} ...", file=sys.stderr, flush=True)
        try:
            rows += measure(case, backend, walk, cfg)
        except Exception as e:  # one failing backend must not hide the others' numbers
            rows.append({"case": case.label, "env": case.env, "task": case.task,
                         "backend": backend, "error": f"{type(e).__name__}: {e}"[:300]})  # fmt: skip
    for row in rows:
        row["walk_length"] = len(walk)
    return rows


# -- output -----------------------------------------------------------------------------------


def _target(row: dict) -> str:
    target = row.get("target_ms")
    if target is None:
        return ""
    pair: Latency = row["snapshot_plus_restore"]
    verdict = "yes" if pair.median_ms <= target else "**no**"
    return f"<= {target:g} ms: {verdict}"


def table(rows: Sequence[dict]) -> str:
    headers = ["case", "backend", "steps/s", "first reset ms", "reset ms (med)", "depth",
               "snapshot ms med / p90", "restore ms med / p90", "bytes held", "exact",
               "target (snap+restore med)"]  # fmt: skip
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["case"], r["backend"], f"failed: {r['error']}"] + [""] * 8)
            continue
        s, t = r["snapshot"], r["restore"]
        out.append(
            [
                r["case"],
                r["backend"],
                fmt_num(r["steps_per_s"]),
                fmt_num(r["first_reset_ms"]),
                fmt_num(r["reset"].median_ms),
                r["depth"],
                f"{fmt_num(s.median_ms)} / {fmt_num(s.p90_ms)}",
                f"{fmt_num(t.median_ms)} / {fmt_num(t.p90_ms)}",
                fmt_bytes(r["live_bytes"]),
                "yes" if r["exact"] and r["live_after"] == 0 else "**no**",
                _target(r),
            ]
        )
    return markdown_table(headers, out, right=range(2, 9))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few repeats and steps (a smoke run)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--only", nargs="*", help="run only these environments (e.g. toy textworld)")
    p.add_argument("--repeats", type=int, default=None, help="snapshot/restore pairs per row")
    p.add_argument("--steps", type=int, default=None, help="steps for steps/s")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cfg = Settings(steps=300, resets=10, repeats=30, depths=(5, 20), seed=a.seed)
    if a.quick:
        cfg = Settings(steps=30, resets=3, repeats=5, depths=(5, 20), seed=a.seed)
    cfg.repeats = a.repeats or cfg.repeats
    cfg.steps = a.steps or cfg.steps
    cases = [c for c in CASES if not a.only or c.env in a.only]
    load_before = load_average()
    started = time.perf_counter()
    rows: list[dict] = []
    for case in cases:
        rows += run_case(case, cfg)
    wall = time.perf_counter() - started
    load_after = load_average()
    print(table(rows))
    print(
        f"\nsteps/s: {cfg.steps} random admissible steps (1/3 of that for slow cases); "
        f"snapshot/restore: {cfg.repeats} pairs per row (fewer for slow replays), {AFTER} steps "
        f"between; bytes held = stats().live_bytes with one live snapshot. "
        f"wall {wall:.0f} s; load average {load_before} before, {load_after} after."
    )
    m = machine_info()
    print(f"machine: {m['cores']} x {m['machine']} ({m['cpu']}), {m['os']}, {m['date_utc']} UTC")
    if a.json:
        write_json(a.json, "sandboxes", rows, settings=vars(cfg), wall_s=wall,
                   load_before=load_before, load_after=load_after)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
