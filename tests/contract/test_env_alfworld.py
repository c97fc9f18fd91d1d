"""ALFWorld engine: generated games pass the sandbox contract, native restores equal replays,
the planner expert wins, the generator reproduces the shipped games, official-layout data
loads, malformed text is an observation, and foreign states are refused."""

from __future__ import annotations

import json
import random
import sys

import pytest

from bpo.sandbox import SnapshotError, check_sandbox, list_tasks, make_env
from bpo.sandbox.envs import alfworld_cache as cache
from bpo.sandbox.envs import alfworld_games as games
from bpo.sandbox.envs.alfworld import INVALID, AlfWorldEngine

pytestmark = pytest.mark.env

# Small rooms (bedroom, living room, bathroom) load in about half a second.
PLACE = "pick_and_place_simple/FloorPlan315/0"
LIGHT = "look_at_obj_in_light/FloorPlan229/0"
CLEAN = "pick_clean_then_place_in_recep/FloorPlan426/0"
JUNK = (
    "",
    "   ",
    "\n",
    "go to\nbed 1",
    "xyzzy",
    "é🙂 日本語 ünïcode",
    "x" * 20000,
    "look\x00",
    "go  to bed 1",
    "GO TO BED 1",
)


@pytest.fixture
def engine():
    eng = AlfWorldEngine()
    yield eng
    eng.close()


def _choose(rng: random.Random, obs) -> str:
    return rng.choice(obs.admissible) if rng.random() < 0.9 else rng.choice(JUNK)


def _random_walk(eng: AlfWorldEngine, obs, rng: random.Random, n: int) -> tuple[list[str], object]:
    """Up to ``n`` random actions (mostly admissible, some junk) from observation ``obs``."""
    actions = []
    while len(actions) < n and not obs.done:
        actions.append(_choose(rng, obs))
        obs = eng.step(actions[-1]).observation
    return actions, obs


def test_check_sandbox_native_two_task_types():
    report = check_sandbox(
        lambda: make_env("alfworld", backend="native"),
        [PLACE, LIGHT],
        max_steps=20,
        stress_nodes=20,
    )
    assert report.backend == "native"
    assert report.snapshots > 0 and report.restores > 0


def test_native_restore_equals_replay_on_random_trajectories():
    a, b = AlfWorldEngine(), AlfWorldEngine()
    try:
        for task, seed in ((PLACE, 1), (CLEAN, 2)):
            rng = random.Random(seed)
            obs = a.reset(task)
            saved = []  # (state, actions so far, fingerprint, observation)
            actions: list[str] = []
            for _ in range(6):
                saved.append((a.get_state(), list(actions), a.fingerprint(), obs))
                more, obs = _random_walk(a, obs, rng, rng.randint(1, 5))
                actions += more
            rng.shuffle(saved)
            for state, prefix, fingerprint, seen in saved:
                a.set_state(state)
                b.reset(task)
                for action in prefix:
                    b.step(action)
                assert a.fingerprint() == b.fingerprint() == fingerprint
                obs = seen
                for _ in range(4):  # both continue identically after the restore
                    if obs.done:
                        break
                    action = _choose(rng, obs)
                    got, want = a.step(action), b.step(action)
                    assert got == want and a.fingerprint() == b.fingerprint()
                    obs = got.observation
    finally:
        a.close()
        b.close()


def test_expert_wins_and_replans_off_its_path(engine):
    for task in (PLACE, CLEAN):
        steps, result = 0, None
        obs = engine.reset(task)
        while (action := engine.expert_action()) is not None:
            assert action in obs.admissible
            result = engine.step(action)
            obs, steps = result.observation, steps + 1
        assert result is not None and result.reward == 1.0 and result.terminated
        assert steps == len(cache.resolve(task).walkthrough)
    obs = engine.reset(PLACE)
    detour = [a for a in obs.admissible if a != engine.expert_action()][:2]
    for action in detour:
        engine.step(action)
    total = 0.0
    while (action := engine.expert_action()) is not None:
        total += engine.step(action).reward
    assert total == 1.0


def test_invalid_text_is_nothing_happens_and_truncation_counts_it():
    eng = AlfWorldEngine(max_steps=len(JUNK) + 1)
    try:
        first = eng.reset(PLACE)
        assert first.instruction.startswith("Your task is to: ")
        before = eng.get_state().facts
        for i, junk in enumerate(JUNK, start=1):
            r = eng.step(junk)
            assert r.observation.text == INVALID and r.reward == 0.0
            assert r.observation.admissible == first.admissible
            assert not r.terminated and not r.truncated and r.info["valid"] is False
            assert eng._step == i
        assert eng.get_state().facts == before
        r = eng.step(first.admissible[0])
        assert r.truncated and r.observation.done and not r.terminated
        again = eng.step("look")
        assert again.observation.done and again.reward == 0.0
    finally:
        eng.close()


def test_states_are_refused_by_other_engines_and_after_eviction():
    a, b = AlfWorldEngine(keep_loaded=1), AlfWorldEngine()
    try:
        a.reset(PLACE)
        state = a.get_state()
        b.reset(PLACE)
        with pytest.raises(SnapshotError, match="another engine"):
            b.set_state(state)
        a.reset(LIGHT)  # evicts PLACE: its planner library now holds LIGHT
        with pytest.raises(SnapshotError, match="no longer loaded"):
            a.set_state(state)
        with pytest.raises(SnapshotError):
            a.set_state("not a state")
    finally:
        a.close()
        b.close()


def test_memoized_commands_equal_textworlds_and_argv_survives(engine):
    from textworld.envs import PddlEnv

    argv = list(sys.argv)
    first = obs = engine.reset(LIGHT)
    assert sys.argv == argv  # fast_downward's translator overwrites it; the loader restores
    env, rng, uid = engine._game.env, random.Random(3), engine._game.uid
    for _ in range(12):
        obs = engine.step(rng.choice(obs.admissible)).observation
        ours = (list(env.state["_valid_commands"]), list(env.state["admissible_commands"]))
        PddlEnv._gather_infos(env)  # textworld's own derivation of every command
        assert ours == (env.state["_valid_commands"], env.state["admissible_commands"])
    assert engine.reset(LIGHT) == first and engine._game.uid == uid  # root restored, no reload


def test_generator_reproduces_a_shipped_game_and_is_deterministic():
    shipped = cache._shipped()[CLEAN]
    gen = games.generate_problem(*cache.parse_name(CLEAN))
    assert gen is not None and gen.digest == shipped["digest"]
    assert games.generate_problem(*cache.parse_name(CLEAN)).problem == gen.problem
    walk, status, _ = cache.solve_here(gen.problem, gen.goal_text)
    assert status == "solved" and walk == shipped["walkthrough"]
    other = games.generate_problem("pick_clean_then_place_in_recep", "FloorPlan426", 1)
    assert other is not None and other.problem != gen.problem


def test_default_lists_are_shipped_and_splits_use_disjoint_floor_plans(tmp_path):
    seen = {}
    for split, per_type in cache.DEFAULT_PER_TYPE.items():
        names = list_tasks("alfworld", split, cache_dir=str(tmp_path))
        assert len(names) == len(set(names)) == per_type * len(games.TASK_TYPES)
        assert {n.split("/")[0] for n in names} == set(games.TASK_TYPES)
        assert all(cache._shipped()[n]["status"] == "solved" for n in names)
        seen[split] = {n.split("/")[1] for n in names}
    assert not list(tmp_path.iterdir())  # nothing had to be planned
    assert not (
        seen["train"] & seen["valid"]
        or seen["train"] & seen["test"]
        or seen["valid"] & seen["test"]
    )
    with pytest.raises(ValueError, match="valid splits"):
        games.split_floor_plans("dev", "pick_and_place_simple")
    with pytest.raises(ValueError, match="unknown alfworld options"):
        list_tasks("alfworld", "train", colour="red")


def test_official_layout_data_dir_loads(tmp_path, monkeypatch):
    for task, split in ((PLACE, "train"), (CLEAN, "valid_unseen"), (LIGHT, "train")):
        solved = cache.resolve(task)
        trial = games.write_official_layout(
            tmp_path, solved.problem, list(solved.walkthrough), split
        )
        if task == LIGHT:  # ALFWorld skips games not marked solvable
            data = json.loads((trial / "game.tw-pddl").read_text())
            (trial / "game.tw-pddl").write_text(json.dumps({**data, "solvable": False}))
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    train = list_tasks("alfworld", "train", source="official")
    test = list_tasks("alfworld", "test", source="official")
    assert len(train) == 1 and train[0].startswith("json_2.1.1/train/pick_and_place_simple-")
    assert len(test) == 1 and "/valid_unseen/pick_clean_then_place_in_recep-" in test[0]
    with pytest.raises(FileNotFoundError, match="alfworld-download"):
        list_tasks("alfworld", "valid", source="official")
    eng = AlfWorldEngine(source="official")
    try:
        obs = eng.reset(test[0])
        assert obs.instruction == f"Your task is to: {cache.resolve(CLEAN).problem.goal_text}."
        total = 0.0
        while (action := eng.expert_action()) is not None:
            total += eng.step(action).reward
        assert total == 1.0
        with pytest.raises(FileNotFoundError, match="no ALFWorld game"):
            eng.reset("json_2.1.1/train/missing/trial")
    finally:
        eng.close()
