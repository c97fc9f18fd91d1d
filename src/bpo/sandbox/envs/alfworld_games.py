"""Local generation of ALFWorld-style games (the official game files need a download).

**These are not the official ALFWorld task instances.** The official games were produced
by replaying ALFRED trajectories in AI2-THOR; that data cannot be fetched here. What the
``alfworld`` wheel does ship is the PDDL domain, the text grammar, the goal templates and
the AI2-THOR layouts of its 120 floor plans (receptacle ids and their navigation points).
This module builds, from those, PDDL problems in the same format and vocabulary as the
official ``initial_state.pddl`` files, for all six ALFWorld task types:

1. receptacles: the floor plan's receptacles with their navigation points, plus one or two
   instances of each receptacle type the layout lists without a point (stove burner,
   toaster, garbage can, ...) placed on a seeded reachable point;
2. objects: 1 to 3 instances of every pickupable object type the layout lists, each in a
   seeded compatible receptacle (ALFRED's ``VAL_RECEPTACLE_OBJECTS``); desk/floor lamps on
   furniture; openable receptacles start closed;
3. the goal: ALFRED's goal PDDL for the task type with a target object and receptacle
   drawn from what the scene affords (never satisfied at the start); the instruction text
   is one of the goal library's templates, as in ALFWorld's templated goals.

Known differences from the official games: object placements and counts are sampled, not
ALFRED's; decorative objects that no receptacle holds (windows, light switches, paintings)
are left out; no object starts hot, cold or clean; receptacles the layout lists without a
navigation point get a sampled one.

Everything is a pure function of ``(task_type, floor_plan, seed)``: the same arguments give
byte-identical PDDL text. Which games are solvable, with what walkthrough, is decided and
cached by :mod:`bpo.sandbox.envs.alfworld_cache` (ALFWorld's planner, then a replay in its
text engine).

Task names are ``"{task_type}/{floor_plan}/{seed}"``, e.g.
``"pick_heat_then_place_in_recep/FloorPlan12/0"``. Splits are by floor plan: train uses
floor plans 10-30 of each room type, valid 7-9 and test 1-6 (ALFRED's held-out scenes), so
valid and test layouts never appear in training.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

GENERATOR_VERSION = 1
"""Bump when the generated PDDL changes; it is part of every cache path."""

TASK_TYPES: tuple[str, ...] = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

_ROOMS = {"Kitchen": 0, "LivingRoom": 200, "Bedroom": 300, "Bathroom": 400}
# Room types in which ALFRED defines each task (alfworld.gen.constants.GOALS_VALID).
_VALID_ROOMS = {
    "pick_and_place_simple": ("Kitchen", "LivingRoom", "Bedroom", "Bathroom"),
    "look_at_obj_in_light": ("LivingRoom", "Bedroom"),
    "pick_clean_then_place_in_recep": ("Kitchen", "Bathroom"),
    "pick_heat_then_place_in_recep": ("Kitchen",),
    "pick_cool_then_place_in_recep": ("Kitchen",),
    "pick_two_obj_and_place": ("Kitchen", "LivingRoom", "Bedroom", "Bathroom"),
}
# Floor plan numbers within a room type (1..30) per split. 1-6 are ALFRED's own held-out
# "test" scenes; 7-9 are held out from training as well, so valid and test layouts are
# both unseen in training.
SPLIT_SCENES = {"train": range(10, 31), "valid": range(7, 10), "test": range(1, 7)}

_MOVABLE = ("Bowl", "Box", "Cup", "Mug", "Pan", "Plate", "Pot")
_LAMP_HOSTS = {
    "DeskLamp": ("Desk", "SideTable", "Dresser", "Shelf", "CoffeeTable", "DiningTable"),
    "FloorLamp": ("SideTable", "Dresser", "Desk", "ArmChair", "Sofa", "CoffeeTable", "TVStand"),
}
# The receptacle whose action a task needs, and which may not also be the goal receptacle.
_TOOL = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
_PROPERTY = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}
_PDDL_CHARS = {"-": "_minus_", "#": "-", "|": "_bar_", "+": "_plus_", ".": "_dot_", ",": "_comma_"}


@dataclass(frozen=True)
class TaskParams:
    """ALFRED's ``pddl_params`` of a game (CamelCase type names, "" when unused)."""

    task_type: str
    object_target: str
    parent_target: str
    toggle_target: str = ""
    mrecep_target: str = ""


@dataclass(frozen=True)
class GeneratedProblem:
    """One generated game before solving: the PDDL problem and what it asks."""

    task_type: str
    floor_plan: str
    seed: int
    params: TaskParams
    goal_text: str
    """The instruction without the "Your task is to: " prefix, e.g. "put a hot apple in fridge"."""
    problem: str
    """PDDL problem text in the official ``initial_state.pddl`` vocabulary."""

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.problem.encode()).hexdigest()[:16]


def scene_number(floor_plan: str) -> int:
    return int(floor_plan.removeprefix("FloorPlan"))


def split_floor_plans(split: str, task_type: str) -> list[str]:
    """The floor plans of ``split`` in the room types where ``task_type`` exists."""
    if split not in SPLIT_SCENES:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLIT_SCENES)}")
    if task_type not in _VALID_ROOMS:
        raise ValueError(f"unknown task type {task_type!r}; valid: {', '.join(TASK_TYPES)}")
    return [
        f"FloorPlan{_ROOMS[room] + n}"
        for room in _VALID_ROOMS[task_type]
        for n in SPLIT_SCENES[split]
    ]


@lru_cache(maxsize=1)
def domain_text() -> str:
    """ALFWorld's PDDL domain (``alfworld/data/alfred.pddl``)."""
    return (resources.files("alfworld") / "data" / "alfred.pddl").read_text()


@lru_cache(maxsize=1)
def grammar_text() -> str:
    """ALFWorld's text grammar with the "UNKNOWN GOAL" placeholder (``alfred.twl2``)."""
    return (resources.files("alfworld") / "data" / "alfred.twl2").read_text()


def game_data(problem: str, goal_text: str, walkthrough: list[str] | None) -> dict:
    """The content of a ``game.tw-pddl`` file, as ``alfworld-generate`` writes it."""
    return {
        "pddl_domain": domain_text(),
        "grammar": grammar_text().replace("UNKNOWN GOAL", goal_text),
        "pddl_problem": problem,
        "solvable": walkthrough is not None,
        "walkthrough": walkthrough,
    }


def traj_data(gen: GeneratedProblem) -> dict:
    """A minimal ``traj_data.json`` (what ALFWorld's loaders and handcoded expert read)."""
    p = gen.params
    return {
        "task_type": p.task_type,
        "pddl_params": {
            "object_target": p.object_target,
            "parent_target": p.parent_target,
            "toggle_target": p.toggle_target,
            "mrecep_target": p.mrecep_target,
            "object_sliced": False,
        },
        "scene": {"floor_plan": gen.floor_plan, "scene_num": scene_number(gen.floor_plan)},
        "turk_annotations": {"anns": [{"task_desc": gen.goal_text}]},
        "bpo_generated": {"generator_version": GENERATOR_VERSION, "seed": gen.seed},
    }


def official_dir_name(gen: GeneratedProblem) -> str:
    """``{task_type}-{Object}-{Mrecep}-{Parent}-{scene}`` like the official data folders."""
    p = gen.params
    parent = p.toggle_target if p.task_type == "look_at_obj_in_light" else p.parent_target
    mrecep = p.mrecep_target or "None"
    return f"{p.task_type}-{p.object_target}-{mrecep}-{parent}-{scene_number(gen.floor_plan)}"


# ---------------------------------------------------------------------------------------
# Layout data shipped with alfworld


@dataclass(frozen=True)
class _Layout:
    receptacles: dict[str, str]  # THOR id -> receptacle type
    locations: dict[str, str]  # THOR id -> "loc|x|z|rot|horizon"
    object_types: tuple[str, ...]
    points: tuple[tuple[float, float], ...]  # reachable floor points (metres)


@lru_cache(maxsize=8)
def _layout(floor_plan: str) -> _Layout:
    import numpy as np

    base = resources.files("alfworld") / "gen" / "layouts"
    try:
        openable = json.loads((base / f"{floor_plan}-openable.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"alfworld ships no layout for {floor_plan!r}") from None
    objects = json.loads((base / f"{floor_plan}-objects.json").read_text())
    with (base / f"{floor_plan}-layout.npy").open("rb") as f:
        points = tuple((float(x), float(z)) for x, z in np.load(f).tolist())
    receptacles, locations = {}, {}
    for rid, (x, z, rot, hor) in sorted(openable.items()):
        parts = rid.split("|")
        receptacles[rid] = parts[4] if len(parts) == 5 else parts[0]
        locations[rid] = _loc(x, z, rot, hor)
    return _Layout(receptacles, locations, tuple(sorted(objects)), points)


def _loc(x: float, z: float, rot: float, hor: float) -> str:
    return f"loc|{round(x / 0.25)}|{round(z / 0.25)}|{round(rot / 90) % 4}|{round(hor)}"


def _coord(v: float) -> str:
    return f"{v:+06.2f}"


def _fix_chars(text: str) -> str:
    """ALFRED's ``fix_pddl_str_chars``: THOR ids to PDDL names ("|" -> "_bar_", ...)."""
    pattern = re.compile("|".join(re.escape(k) for k in sorted(_PDDL_CHARS, key=len, reverse=True)))
    return pattern.sub(lambda m: _PDDL_CHARS[m.group(0)], text)


# ---------------------------------------------------------------------------------------
# Generation


def generate_problem(task_type: str, floor_plan: str, seed: int) -> GeneratedProblem | None:
    """Build the PDDL problem of ``(task_type, floor_plan, seed)``; None when this layout
    cannot host the task (for example no lamp for ``look_at_obj_in_light``). Deterministic."""
    import alfworld.gen.constants as C
    import alfworld.gen.goal_library as glib

    if task_type not in TASK_TYPES:
        raise ValueError(f"unknown task type {task_type!r}; valid: {', '.join(TASK_TYPES)}")
    layout = _layout(floor_plan)
    key = f"{GENERATOR_VERSION}/{task_type}/{floor_plan}/{seed}".encode()
    rng = random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))

    # 1. Receptacles: the layout's own, plus listed types without a navigation point.
    receptacles = dict(layout.receptacles)
    locations = dict(layout.locations)
    present = set(receptacles.values())
    static = sorted(
        (set(layout.object_types) & C.RECEPTACLES) - C.MOVABLE_RECEPTACLES_SET - present
    )
    static = [t for t in static if t in C.VAL_RECEPTACLE_OBJECTS]
    if "Sink" in layout.object_types and "SinkBasin" not in present and "SinkBasin" not in static:
        static.append("SinkBasin")
    for rtype in static:
        for _ in range(2 if rtype == "StoveBurner" else 1):
            x, z = rng.choice(layout.points)
            rid = f"{rtype}|{_coord(x)}|{_coord(rng.uniform(0.0, 1.2))}|{_coord(z)}"
            if rtype in ("SinkBasin", "BathtubBasin"):
                rid = f"{rtype.removesuffix('Basin')}|{rid.split('|', 1)[1]}|{rtype}"
            receptacles[rid] = rtype
            locations[rid] = _loc(x, z, rng.randrange(4) * 90, 30)
    rtypes = set(receptacles.values())

    # 2. The task's targets.
    pickupable = sorted(
        t
        for t in layout.object_types
        if "Sliced" not in t and any(t in objs for objs in C.VAL_RECEPTACLE_OBJECTS.values())
    )

    def hosts(otype: str) -> list[str]:
        return sorted(r for r in rtypes if otype in C.VAL_RECEPTACLE_OBJECTS.get(r, ()))

    toggle = ""
    tool = _TOOL.get(task_type)
    if tool is not None and tool not in rtypes:
        return None
    if task_type == "look_at_obj_in_light":
        lamps = [t for t in ("DeskLamp", "FloorLamp") if t in layout.object_types]
        lamps = [t for t in lamps if any(h in rtypes for h in _LAMP_HOSTS[t])]
        if not lamps:
            return None
        toggle = rng.choice(lamps)
        candidates = [o for o in pickupable if len(hosts(o)) >= 1]
        if not candidates:
            return None
        obj, parent = rng.choice(candidates), ""
    else:
        if task_type in _PROPERTY:
            allowed = C.VAL_ACTION_OBJECTS[_PROPERTY[task_type]]
            candidates = [o for o in pickupable if o in allowed]
        else:
            candidates = list(pickupable)
        pairs = [
            (o, r)
            for o in candidates
            for r in hosts(o)
            if r != tool and len(hosts(o)) >= 2  # somewhere to start that is not the goal
        ]
        if not pairs:
            return None
        obj, parent = rng.choice(pairs)
    params = TaskParams(task_type, obj, parent, toggle)

    # 3. Objects, each in a compatible receptacle; the target never starts in the goal.
    placed: list[tuple[str, str, str]] = []  # (object id, type, receptacle id)
    rids_by_type: dict[str, list[str]] = {}
    for rid, rtype in sorted(receptacles.items()):
        rids_by_type.setdefault(rtype, []).append(rid)
    for otype in pickupable:
        options = [rid for r in hosts(otype) for rid in rids_by_type[r]]
        if otype == obj and parent:
            options = [rid for rid in options if receptacles[rid] != parent]
        if not options:
            continue
        count = rng.choice((1, 1, 2, 2, 3))
        if otype == obj and task_type == "pick_two_obj_and_place":
            count = max(count, 2)
        for _ in range(count):
            rid = rng.choice(options)
            placed.append((_object_id(rng, otype), otype, rid))
    if toggle:
        options = [rid for r in _LAMP_HOSTS[toggle] for rid in rids_by_type.get(r, ())]
        placed.append((_object_id(rng, toggle), toggle, rng.choice(options)))
    if not any(t == obj for _, t, _ in placed):
        return None

    # 4. Agent start: a reachable point that is not a receptacle's.
    taken = set(locations.values())
    for _ in range(100):
        x, z = rng.choice(layout.points)
        start = _loc(x, z, rng.randrange(4) * 90, 30)
        if start not in taken:
            break
    else:  # pragma: no cover - layouts have dozens of points
        return None

    goal_pddl = glib.gdict[task_type]["pddl"].format(
        obj=obj, recep=parent, toggle=toggle, mrecep=""
    )
    template = rng.choice(glib.gdict[task_type]["templates"])
    goal_text = template.format(
        obj=obj.lower(), recep=parent.lower(), toggle=toggle.lower(), mrecep=""
    )
    problem = _problem_text(
        floor_plan, seed, task_type, receptacles, locations, placed, start, goal_pddl
    )
    return GeneratedProblem(task_type, floor_plan, seed, params, goal_text, problem)


def _object_id(rng: random.Random, otype: str) -> str:
    x, y, z = (rng.uniform(-3.0, 3.0), rng.uniform(0.0, 1.8), rng.uniform(-3.0, 3.0))
    return f"{otype}|{_coord(x)}|{_coord(y)}|{_coord(z)}"


def _problem_text(
    floor_plan: str,
    seed: int,
    task_type: str,
    receptacles: dict[str, str],
    locations: dict[str, str],
    placed: list[tuple[str, str, str]],
    start: str,
    goal_pddl: str,
) -> str:
    import alfworld.gen.constants as C

    placed = sorted(placed)
    otypes = sorted({t for _, t, _ in placed})
    rtypes = sorted(set(receptacles.values()))
    locs = sorted(set(locations.values()) | {start})
    objects = (
        ["agent1 # agent"]
        + [f"{t}Type # otype" for t in otypes]
        + [f"{t}Type # rtype" for t in rtypes]
        + [f"{oid} # object" for oid, _, _ in placed]
        + [f"{rid} # receptacle" for rid in sorted(receptacles)]
        + [f"{loc} # location" for loc in locs]
    )
    init = [f"(receptacleType {rid} {t}Type)" for rid, t in sorted(receptacles.items())]
    init += [f"(objectType {oid} {t}Type)" for oid, t, _ in placed]
    init += [
        f"(canContain {r}Type {o}Type)"
        for r in rtypes
        for o in otypes
        if o in C.VAL_RECEPTACLE_OBJECTS.get(r, ())
    ]
    props = (
        ("cleanable", C.VAL_ACTION_OBJECTS["Cleanable"]),
        ("heatable", C.VAL_ACTION_OBJECTS["Heatable"]),
        ("coolable", C.VAL_ACTION_OBJECTS["Coolable"]),
        ("sliceable", C.VAL_ACTION_OBJECTS["Sliceable"]),
        ("toggleable", C.VAL_ACTION_OBJECTS["Toggleable"]),
        ("isReceptacleObject", set(_MOVABLE)),
    )
    for oid, otype, _ in placed:
        if otype not in _LAMP_HOSTS:
            init.append(f"(pickupable {oid})")
        init += [f"({name} {oid})" for name, types in props if otype in types]
    init += [
        f"(openable {rid})" for rid, t in sorted(receptacles.items()) if t in C.OPENABLE_CLASS_SET
    ]
    init.append(f"(atLocation agent1 {start})")
    init += [f"(inReceptacle {oid} {rid})" for oid, _, rid in placed]
    init += [f"(receptacleAtLocation {rid} {locations[rid]})" for rid in sorted(receptacles)]
    init += [f"(objectAtLocation {oid} {locations[rid]})" for oid, _, rid in placed]
    sep = "\n        "
    text = (
        f"\n(define (problem bpo_{task_type}_{floor_plan}_{seed})\n(:domain alfred)\n(:objects\n"
        f"        {sep.join(objects)}\n        )\n(:init\n        {sep.join(init)}\n        )\n"
        f"{goal_pddl}"
    )
    return _fix_chars(text)


def write_official_layout(
    root: Path, gen: GeneratedProblem, walkthrough: list[str] | None, split: str
) -> Path:
    """Write ``gen`` under ``root`` laid out like the official data
    (``json_2.1.1/{split}/{task folder}/trial_bpo_{seed}/{game.tw-pddl,traj_data.json,
    initial_state.pddl}``); returns the trial directory."""
    trial = root / "json_2.1.1" / split / official_dir_name(gen) / f"trial_bpo_{gen.seed:05d}"
    trial.mkdir(parents=True, exist_ok=True)
    (trial / "initial_state.pddl").write_text(gen.problem)
    (trial / "traj_data.json").write_text(json.dumps(traj_data(gen), indent=1))
    (trial / "game.tw-pddl").write_text(
        json.dumps(game_data(gen.problem, gen.goal_text, walkthrough))
    )
    return trial
