"""TextWorld engine: generated games pass the sandbox contract, native snapshots equal replays,
experts win, malformed and meta commands are observations, a damaged cache is named."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from bpo.sandbox import check_sandbox, list_tasks, make_env
from bpo.sandbox.envs.textworld import REFUSED, TextWorldEngine, clean_command
from bpo.sandbox.envs.textworld_games import (
    CorruptGameError,
    cache_root,
    ensure_games,
    parse_task,
    task_names,
)

pytestmark = pytest.mark.env

COOKING = "tw-cooking/level=1/split=train/seed=0"
TREASURE = "tw-treasure_hunter/level=5/seed=0"
CONTRACT_TASKS = (COOKING, TREASURE)
ALL_TASKS = (
    COOKING,
    TREASURE,
    "tw-coin_collector/level=5/seed=0",
    "tw-simple/level=1/split=train/seed=0",
)
JUNK = ("", "   ", "\n\n", "x" * 5000, "é🙂 日本語", "take\nknife", "))(({[", "xyzzy")
META = (
    "save",
    "restore",
    "restart",
    "quit",
    "undo",
    "script",
    "tw-trace-actions",
    "look. restart",
    "tw-extra-infos score",
)


@pytest.fixture(scope="module")
def games():
    """Generate (first run) or verify (later runs) every game used here, in one child."""
    return {g.spec.name: g for g in ensure_games(ALL_TASKS)}


@pytest.fixture
def engine(games):
    eng = TextWorldEngine(max_steps=40)
    yield eng
    eng.close()


def _play_expert(eng: TextWorldEngine, task: str) -> tuple[float, object]:
    eng.reset(task, 0)
    total, result = 0.0, None
    while (action := eng.expert_action()) is not None:
        result = eng.step(action)
        total += result.reward
    return total, result


def test_task_names_splits_and_errors():
    train = task_names("train", n=3, challenge="tw-cooking", level=2)
    assert train[0] == "tw-cooking/level=2/split=train/seed=0"
    assert [parse_task(t).name for t in train] == train
    splits = {
        s: set(task_names(s, n=50, challenge="tw-coin_collector", level=3))
        for s in ("train", "valid", "test")
    }
    assert not (splits["train"] & splits["valid"] or splits["valid"] & splits["test"])
    assert list_tasks("textworld", "test", n=1, challenge="tw-simple", max_steps=9) == [
        "tw-simple/level=1/split=test/seed=2000000"
    ]  # engine options are ignored
    with pytest.raises(ValueError, match="valid names: tw-coin_collector, tw-cooking, tw-simple"):
        parse_task("tw-zork/level=1/seed=0")
    with pytest.raises(ValueError, match="valid levels: 1-150, 201-233"):
        parse_task("tw-coin_collector/level=160/seed=0")
    with pytest.raises(ValueError, match="has no split 'train'"):
        parse_task("tw-treasure_hunter/level=1/split=train/seed=0")
    with pytest.raises(ValueError, match="needs level and seed"):
        parse_task("tw-cooking/level=1")


@pytest.mark.parametrize("backend", ["native", "replay"])
def test_check_sandbox(games, backend):
    report = check_sandbox(lambda: make_env("textworld", backend, max_steps=30), CONTRACT_TASKS)
    assert report.backend == backend and report.restores > 0


def test_native_restore_equals_replay_on_random_trajectories(games, tmp_path, monkeypatch):
    """States taken along random trajectories (admissible, expert, junk and meta commands),
    restored later, into this engine or another one holding another game, equal a replay."""
    monkeypatch.chdir(tmp_path)  # were a meta command let through, its files land here
    a, b, c = (TextWorldEngine(max_steps=40) for _ in range(3))
    rng = random.Random(0)

    def pick(eng: TextWorldEngine, obs) -> str:
        u = rng.random()
        if u < 0.1:
            return rng.choice(JUNK + META)
        if u < 0.4 and eng.expert_action():
            return eng.expert_action()
        return rng.choice(obs.admissible)

    try:
        compared = 0
        for n, task in enumerate(CONTRACT_TASKS * 2):
            obs, actions, saved = a.reset(task, n), [], []
            for _ in range(25):
                if rng.random() < 0.3:
                    saved.append((len(actions), a.get_state(), a.fingerprint()))
                if obs.done:
                    break
                actions.append(pick(a, obs))
                obs = a.step(actions[-1]).observation
            c.reset(CONTRACT_TASKS[1 - n % 2], 0)  # c holds the other game
            for k, state, fp in rng.sample(saved, len(saved)):
                target = rng.choice([a, c])
                target.set_state(state)
                b.reset(task, n)
                for action in actions[:k]:
                    b.step(action)
                assert target.fingerprint() == b.fingerprint() == fp
                for _ in range(5):
                    assert target.expert_action() == b.expert_action()
                    action = rng.choice([*JUNK[:3], *META[:3], target.expert_action() or "look"])
                    ra, rb = target.step(action), b.step(action)
                    assert ra == rb
                    assert target.fingerprint() == b.fingerprint()
                compared += 1
        assert compared >= 8
    finally:
        for eng in (a, b, c):
            eng.close()


@pytest.mark.parametrize("task", ALL_TASKS)
def test_expert_wins_with_reward_one(games, task):
    eng = TextWorldEngine(max_steps=60)
    try:
        total, last = _play_expert(eng, task)
        assert total == 1.0
        assert last.terminated and not last.truncated and last.info["won"]
        assert last.observation.done and eng.expert_action() is None
        for mode, want in (("normalized", 1.0), ("score", float(last.info["max_score"]))):
            eng.reward_mode = mode
            assert _play_expert(eng, task)[0] == pytest.approx(want)
    finally:
        eng.close()


def test_malformed_and_meta_commands_are_observations(engine, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "save" and "script" would write files here
    obs = engine.reset(COOKING, 0)
    assert obs.instruction.startswith("You are hungry!") and "_" not in obs.text[:20]
    assert len(clean_command("go " * 700)) <= 180 and clean_command("é\tb\n") == "e b"
    for action in JUNK + META:
        fp = engine.fingerprint()
        result = engine.step(action)
        assert isinstance(result.observation.text, str) and result.observation.text
        assert not result.terminated and result.reward == 0.0
        assert engine.fingerprint() != fp  # the step counter moved
        if action in META:
            assert result.observation.text == REFUSED
    assert list(tmp_path.iterdir()) == []
    while (action := engine.expert_action()) is not None:  # quest tracking is intact
        result = engine.step(action)
    assert result.info["won"] and result.reward == 1.0


def test_losing_ends_the_episode_without_reward(engine):
    engine.reset(COOKING, 0)
    taken = engine.step("take red potato from counter")  # a recipe ingredient: +1 point
    assert taken.info["score"] == 1 and taken.reward == 0.0  # reward "win": only on winning
    lost = engine.step("eat red potato")
    assert lost.terminated and lost.info["lost"] and not lost.info["won"]
    assert lost.reward == 0.0 and "You lost" in lost.observation.text
    assert engine.expert_action() is None


def test_truncation_and_a_finished_episode(games):
    eng = TextWorldEngine(max_steps=2)
    try:
        eng.reset(TREASURE, 0)
        first = eng.step("look")
        assert not first.truncated and not first.observation.done
        second = eng.step("look")
        assert second.truncated and not second.terminated and second.observation.done
        fp = eng.fingerprint()
        again = eng.step(eng.get_state().observation.admissible[0])
        assert again.truncated and again.reward == 0.0 and again.observation == second.observation
        assert eng.fingerprint() == fp and eng.expert_action() is None
        assert 10_000 < eng.get_state().nbytes < 1_000_000
    finally:
        eng.close()


def test_lean_engine_without_expert_or_admissible_still_ends_and_restores(games):
    expert, lean = TextWorldEngine(), TextWorldEngine(expert=False, admissible=False)
    try:
        expert.reset(TREASURE, 0)
        obs = lean.reset(TREASURE, 0)
        assert obs.admissible is None and lean.expert_action() is None
        state, fp = lean.get_state(), lean.fingerprint()
        while (action := expert.expert_action()) is not None:
            expert.step(action)
            result = lean.step(action)
        assert result.terminated and result.reward == 1.0 and result.info["won"]
        lean.set_state(state)
        assert lean.fingerprint() == fp
    finally:
        expert.close()
        lean.close()


_SERIAL = slice(0x12, 0x18)
"""The Z-machine header's serial number: six ASCII digits, the compile date (YYMMDD)."""


def _without_serial(story: bytes) -> bytes:
    return story[: _SERIAL.start] + story[_SERIAL.stop :]


def test_corrupt_cache_file_is_named_and_regenerates_identically(games, tmp_path):
    original = games[TREASURE]
    copy = cache_root(tmp_path) / TREASURE
    shutil.copytree(original.folder, copy)
    z8 = copy / "game.z8"
    data = bytearray(z8.read_bytes())
    data[len(data) // 2] ^= 0xFF
    z8.write_bytes(bytes(data))
    with pytest.raises(CorruptGameError, match="delete") as err:
        ensure_games([TREASURE], cache_dir=tmp_path)
    assert str(z8) in str(err.value)
    eng = TextWorldEngine(cache_dir=str(tmp_path))
    try:
        with pytest.raises(CorruptGameError, match=r"game\.z8"):
            eng.reset(TREASURE, 0)
    finally:
        eng.close()
    (copy / "meta.json").unlink()
    with pytest.raises(CorruptGameError, match=r"meta\.json"):
        ensure_games([TREASURE], cache_dir=tmp_path)
    # Regenerated in a fresh child process: byte-identical to the first generation, but for
    # the story file's serial number, which Inform sets to the compile date (a cache made the
    # day before differs there: this failed in a run that crossed midnight UTC)
    (regenerated,) = ensure_games([TREASURE], cache_dir=tmp_path, on_corrupt="regenerate")
    new, old = regenerated.z8.read_bytes(), original.z8.read_bytes()
    assert _without_serial(new) == _without_serial(old)
    assert new[_SERIAL].isdigit() and old[_SERIAL].isdigit()
    # the JSON records where textworld's grammar files are installed (the venv's path); the
    # rest must be identical
    assert _without_install_paths(regenerated.json) == _without_install_paths(original.json)


def _without_install_paths(path):
    """A game's JSON with the ``text_grammars_path`` entries (install locations) removed."""

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "text_grammars_path"}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return strip(json.loads(path.read_text()))
