"""ScienceWorld engine: task names and splits, gold paths, determinism, replay, errors."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from bpo.sandbox.envs.scienceworld import (
    TASK_NAMES,
    ScienceWorldEngine,
    parse_task,
    tasks,
    variations,
)

pytestmark = pytest.mark.env

GOLD_TASK = "find-animal/var=7"  # a 12-action gold path


@pytest.fixture(scope="module")
def engine():
    eng = ScienceWorldEngine()
    yield eng
    eng.close()


def test_task_names_resolve_and_errors_list_valid_names():
    assert parse_task("boil/var=3").key == "boil/var=3"
    assert parse_task("1-1/var=3") == parse_task("boil", seed=3)
    with pytest.raises(ValueError, match=r"valid tasks .*boil \(1-1\)"):
        parse_task("boiling/var=1")
    with pytest.raises(ValueError, match=r"variations 0\.\.29, not 30 .*test 21\.\.29"):
        parse_task("boil/var=30")
    with pytest.raises(ValueError, match="expected '<task>/var=<n>'"):
        parse_task("boil/variation=2")


def test_splits_partition_every_task():
    total = 0
    for name in TASK_NAMES:
        parts = [set(variations(name, s)) for s in ("train", "valid", "test")]
        n = len(set().union(*parts))
        assert set().union(*parts) == set(range(n)), name
        assert sum(map(len, parts)) == n and all(parts), name  # disjoint, none empty
        total += n
    assert total == 7207  # the paper's count
    assert len(TASK_NAMES) == 30
    assert tasks("test", task_names=["boil"], per_task=2) == ["boil/var=21", "boil/var=22"]
    assert len(tasks("train")) + len(tasks("valid")) + len(tasks("test")) == 7207


def test_split_table_matches_the_library():
    """Our table of splits equals the library's get_variations_train/dev/test."""
    from scienceworld import ScienceWorldEnv

    env = ScienceWorldEnv()
    try:
        assert sorted(env.get_task_names()) == sorted(TASK_NAMES)
        for name in TASK_NAMES:
            env.load(name, 0)
            assert list(variations(name, "train")) == sorted(env.get_variations_train()), name
            assert list(variations(name, "valid")) == sorted(env.get_variations_dev()), name
            assert list(variations(name, "test")) == sorted(env.get_variations_test()), name
    finally:
        env.close()


def test_gold_path_reaches_full_success(engine):
    obs = engine.reset(GOLD_TASK, 0)
    assert "animal" in obs.instruction and obs.text and not obs.done
    total, steps, result = 0.0, 0, None
    while (action := engine.expert_action()) is not None:
        result = engine.step(action)
        total += result.reward
        steps += 1
        assert -1.0 <= result.reward <= 1.0
    assert result is not None and result.terminated and not result.truncated
    assert result.info["success"] and result.info["score"] == 100
    assert result.observation.done
    assert total == pytest.approx(1.0)
    assert steps == len(engine.gold_path())


def test_failure_terminates_without_success(engine):
    engine.reset("boil/var=3", 0)  # starts outside with an orange in the inventory
    result = engine.step("focus on orange")
    assert result.terminated and result.info["failed"] and not result.info["success"]
    assert result.info["score"] < 0 and result.reward == 0.0  # progress is clipped at 0
    assert engine.expert_action() is None


def test_invalid_actions_are_observations(engine):
    engine.reset("boil/var=3", 0)
    before = engine.fingerprint()
    for action in ["", "fly to the moon", "héllo ☃", "x" * 3000, "look around\ngo to kitchen"]:
        result = engine.step(action)
        assert isinstance(result.observation.text, str) and result.observation.text
        assert result.reward == 0.0 and not result.terminated
    assert engine.steps == 5 and engine.fingerprint() != before  # the step count is state


def test_fast_replay_equals_stepping(engine):
    engine.reset(GOLD_TASK, 0)
    actions = [*engine.gold_path()[:6], "open nothing", "look around"]
    for a in actions:
        last = engine.step(a).observation
    fingerprint = engine.fingerprint()
    assert engine.replay(GOLD_TASK, 0, actions) == last
    assert engine.fingerprint() == fingerprint
    fingerprints = []  # replay forward from a prefix (no reload), then back to a shorter one
    for k in (2, 5, 8, 3):
        engine.replay(GOLD_TASK, 0, actions[:k])
        fingerprints.append(engine.fingerprint())
    engine.reset(GOLD_TASK, 0)
    for k, a in enumerate(actions[:8], start=1):
        engine.step(a)
        if k in (2, 3, 5, 8):
            assert engine.fingerprint() == fingerprints[(2, 5, 8, 3).index(k)], k
    engine.reset(GOLD_TASK, 0)
    empty = engine.fingerprint()
    assert engine.replay(GOLD_TASK, 0, []).text == engine.reset(GOLD_TASK, 0).text
    assert engine.fingerprint() == empty


def test_admissible_actions_and_cap(engine):
    engine.admissible, engine.max_admissible = True, None
    try:
        full = engine.reset("boil/var=3", 0).admissible
        assert full is not None and "look around" in full and len(full) > 50
        assert list(full) == sorted(full)
        engine.max_admissible = 20
        capped = engine.reset("boil/var=3", 0).admissible
        assert capped is not None and len(capped) == 20 and set(capped) <= set(full)
        assert capped[0] == full[0] and capped[-1] != full[19]  # spread, not a prefix
    finally:
        engine.admissible, engine.max_admissible = False, None


def _walk(engine: ScienceWorldEngine, task: str, actions: list[str]) -> list[tuple]:
    engine.reset(task, 0)
    trace = [engine.fingerprint()]
    for a in actions:
        r = engine.step(a)
        trace.append((r.observation.text, r.reward, r.terminated, engine.fingerprint()))
    return trace


def test_deterministic_across_engines_and_reloads(engine):
    rng = random.Random(0)
    engine.admissible = True
    try:  # random valid actions (enumerating them is slow: keep the walk short)
        obs, walk = engine.reset("chemistry-mix/var=2", 0), []
        for _ in range(6):
            walk.append(rng.choice([a for a in obs.admissible or () if "focus" not in a]))
            obs = engine.step(walk[-1]).observation
    finally:
        engine.admissible = False
    engine.reset(GOLD_TASK, 0)
    walks = {"chemistry-mix/var=2": walk, GOLD_TASK: list(engine.gold_path()[:8])}
    first = {task: _walk(engine, task, acts) for task, acts in walks.items()}
    other = ScienceWorldEngine()
    try:
        for task in reversed(list(walks)):  # another JVM, another load order
            assert _walk(other, task, walks[task]) == first[task], task
    finally:
        other.close()
    for task, acts in walks.items():  # reloads in one JVM
        assert _walk(engine, task, acts) == first[task], task


def test_missing_java_names_the_package():
    code = ("from bpo.sandbox.envs.scienceworld import ScienceWorldEngine\n"
            "try:\n    ScienceWorldEngine()\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    env = {**os.environ, "PATH": "/nonexistent", "JAVA_HOME": "/nonexistent"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert "JavaNotFoundError" in out.stdout, out.stdout + out.stderr
    assert "apt-get install openjdk-17-jre-headless" in out.stdout
    assert "JAVA_HOME='/nonexistent'" in out.stdout


@pytest.mark.slow
def test_check_sandbox_replay_backend():
    """The whole sandbox contract with the replay backend (two JVMs; valid actions on, so
    random walks change the world; gold paths drive the rest)."""
    from bpo.sandbox import check_sandbox, make_env

    report = check_sandbox(
        lambda: make_env("scienceworld", backend="replay", admissible=True),
        ["use-thermometer/var=4", "power-component/var=1"], max_steps=6, stress_nodes=10)
    assert report.backend == "replay" and report.restores > 0
    assert {p.name for p in report.properties} >= {"determinism", "restore", "tree"}
