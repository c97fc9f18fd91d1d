"""TextWorld-Express engine: task names and seed splits, gold paths, determinism, replay."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from bpo.sandbox.envs.twx import FOLD_SEEDS, GAMES, TwxEngine, parse_task, tasks

pytestmark = pytest.mark.env


@pytest.fixture(scope="module")
def engine():
    eng = TwxEngine()
    yield eng
    eng.close()


def test_task_names_parse_and_errors_list_valid_names():
    assert parse_task("coin/seed=5").key == "coin/seed=5"
    assert parse_task("coin", seed=20003).fold == "test"
    assert parse_task("coin", seed=123456).fold == "train"  # any seed works
    task = parse_task("cookingworld/seed=3/fold=dev/numLocations=5")
    assert (task.fold, task.params_str) == ("dev", "numLocations=5")
    assert parse_task(task.key) == task
    with pytest.raises(ValueError, match="valid games: cookingworld, twc, coin"):
        parse_task("zork/seed=1")
    with pytest.raises(ValueError, match="expected '<game>/seed=<n>"):
        parse_task("coin/seed=five")
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31\)"):
        parse_task("coin", seed=-1)


def test_seed_splits_and_cookingworld_gold_path_match_the_library(engine):
    from textworld_express import TextWorldExpressEnv

    env = TextWorldExpressEnv()
    try:
        for game in GAMES:
            env.load(game, "")
            assert env.getValidSeedsTrain() == list(FOLD_SEEDS["train"]), game
            assert env.getValidSeedsDev() == list(FOLD_SEEDS["dev"]), game
            assert env.getValidSeedsTest() == list(FOLD_SEEDS["test"]), game
        # the library seeds cookingworld's gold agent as we do: the paths are equal
        env.reset(seed=12, gameFold="train", gameName="cookingworld", generateGoldPath=True)
        library_gold = tuple(env.getGoldActionSequence())
    finally:
        env.close()
    engine.reset("cookingworld/seed=12", 0)
    assert engine.gold_path() == library_gold
    assert tasks("valid", games=["twc"], per_game=2) == ["twc/seed=10000", "twc/seed=10001"]
    assert len(tasks("test")) == 8 * 1000


def test_gold_paths_solve_every_game(engine):
    for game in GAMES:
        obs = engine.reset(f"{game}/seed=7", 0)
        assert obs.instruction and obs.admissible and not obs.done
        total, result = 0.0, None
        while (action := engine.expert_action()) is not None:
            result = engine.step(action)
            total += result.reward
        assert result is not None and result.terminated and result.info["success"], game
        assert total == pytest.approx(1.0) and result.observation.done, game


def test_failure_terminates_and_returns_progress_to_zero(engine):
    engine.reset("arithmetic/seed=1", 0)
    gold = engine.gold_path()  # ..., read the problem, take the right item, put it in the box
    progress = 0.0
    for action in gold[:-2]:
        progress += engine.step(action).reward
    wrong = next(a for a in engine.step("look around").observation.admissible or ()
                 if a.startswith("take ") and a not in (gold[-2], "take math problem"))
    engine.step(wrong)
    result = engine.step(f"put {wrong[len('take '):]} in box")
    assert result.terminated and result.info["failed"] and not result.info["success"]
    assert result.info["score"] == -1.0
    assert result.reward == pytest.approx(-progress)  # the return falls back to 0
    assert engine.expert_action() is None


def test_invalid_actions_are_observations(engine):
    engine.reset("coin/seed=3", 0)
    for action in ["", "xyzzy", "héllo ☃", "x" * 3000, "take coin\ntake coin"]:
        result = engine.step(action)
        assert result.observation.text and result.reward == 0.0 and not result.terminated


def test_fast_replay_equals_stepping(engine):
    engine.reset("cookingworld/seed=4", 0)
    actions = [*engine.gold_path()[:10], "eat the fridge"]
    for a in actions:
        last = engine.step(a).observation
    fingerprint = engine.fingerprint()
    assert engine.replay("cookingworld/seed=4", 0, actions) == last
    assert engine.fingerprint() == fingerprint
    first = engine.reset("cookingworld/seed=4", 0)
    assert engine.replay("cookingworld", 4, []) == first


def _walk(engine: TwxEngine, task: str, actions: list[str]) -> list[tuple]:
    trace = [engine.reset(task, 0), engine.fingerprint()]
    for a in actions:
        r = engine.step(a)
        trace.append((r.observation, r.reward, r.terminated, engine.fingerprint()))
    return trace


def test_deterministic_across_engines_and_reloads(engine):
    rng = random.Random(0)
    walks = {}
    for game in GAMES:
        task = f"{game}/seed={rng.randrange(1000)}"
        obs, actions = engine.reset(task, 0), []
        for _ in range(15):
            actions.append(rng.choice(obs.admissible or ("look around",)))
            obs = engine.step(actions[-1]).observation
        walks[task] = actions
    first = {task: _walk(engine, task, acts) for task, acts in walks.items()}
    other = TwxEngine()
    try:
        for task in reversed(list(walks)):  # another JVM, another generation order
            assert _walk(other, task, walks[task]) == first[task], task
            engine.reset(task, 0)  # gold paths (seeded random walks) agree across JVMs
            assert other.gold_path() == engine.gold_path(), task
    finally:
        other.close()
    for task, acts in walks.items():
        assert _walk(engine, task, acts) == first[task], task


def test_missing_java_names_the_package():
    code = ("from bpo.sandbox.envs.twx import TwxEngine\n"
            "try:\n    TwxEngine()\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    env = {**os.environ, "PATH": "/nonexistent"}
    env.pop("JAVA_HOME", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert "JavaNotFoundError" in out.stdout, out.stdout + out.stderr
    assert "apt-get install openjdk-17-jre-headless" in out.stdout


def test_check_sandbox_replay_backend():
    from bpo.sandbox import check_sandbox, make_env

    report = check_sandbox(lambda: make_env("twx", backend="replay"),
                           ["cookingworld/seed=4", "twc/seed=10002"], max_steps=30,
                           stress_nodes=60)
    assert report.backend == "replay" and report.restores > 0
    assert {p.name for p in report.properties} >= {"determinism", "restore", "tree"}


def test_only_replay_backends_are_offered():
    from bpo.sandbox import make_env

    with pytest.raises(ValueError, match="cannot snapshot an engine that runs in a JVM"):
        make_env("twx", backend="fork")


def test_a_jvm_that_fails_to_start_says_why():
    from textworld_express.constants import JAR_PATH

    from bpo.sandbox.envs.java import Jvm
    from bpo.sandbox.protocol import SandboxError

    with pytest.raises(SandboxError, match=r"did not start .*Unrecognized VM option 'NoSuch'"):
        Jvm(JAR_PATH, extra_opts=["-XX:+NoSuch"])
