"""TextWorld games: task names, generation with TextWorld's own ``tw-make`` challenges, disk cache.

A task name says which game to generate::

    tw-cooking/level=2/split=train/seed=12
    tw-coin_collector/level=5/seed=3
    tw-treasure_hunter/level=10/seed=7
    tw-simple/level=1/split=test/seed=0

``split=`` appears only for challenges whose generator has distributions of its own
(tw-cooking: its official train/valid/test food splits; tw-simple: its train/test flag); it
may be left out of a tw-cooking name to draw from the joint distribution, as ``tw-make`` does.
:func:`task_names` additionally draws every split's seeds from a disjoint range
(:data:`SPLIT_SEED_OFFSET`), so the splits never share a game.

Games are generated in a child process with ``PYTHONHASHSEED=0``: TextWorld iterates over
Python sets while writing a game, so without a fixed hash seed the same seed gives a game with
the same rules but different bytes (and a different Z-machine fingerprint) in every process.
With it, a game is byte-identical wherever it is generated (1-3 s per game, plus about 2 s
to start the child; see :data:`GEN_TIMEOUT_S` for the slow hardest levels). Each game lives in
``$BPO_CACHE/textworld/tw-<version>/<task name>/`` (``game.z8``, ``game.json``, ``meta.json``
with their SHA-256), written to a temporary folder and renamed into place, so concurrent
generators never expose half-written games; a damaged file is reported by name.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bpo.registry import Registry
from bpo.sandbox.protocol import SandboxError

__all__ = [
    "CHALLENGES",
    "GEN_TIMEOUT_S",
    "SPLIT_SEED_OFFSET",
    "Challenge",
    "CorruptGameError",
    "GameFiles",
    "GameSpec",
    "cache_root",
    "ensure_games",
    "parse_task",
    "task_names",
]

SPLIT_SEED_OFFSET: Mapping[str, int] = {"train": 0, "valid": 1_000_000, "test": 2_000_000}
"""Seeds of split s are ``SPLIT_SEED_OFFSET[s] + i``: the splits never share a game."""

GEN_TIMEOUT_S = 600.0
"""Default time allowed per game to the generating child (the Inform 7 compiler included).
Most games take 1-3 s (tw-treasure_hunter 25-27: about 8 s), but TextWorld's quest search has
a heavy tail at the hardest levels: tw-treasure_hunter level 30 took 48 s (seed 0), over 70 s
(seed 1) and over 6 min (seed 5) of CPU here."""


class CorruptGameError(SandboxError):
    """A cached game file is missing or does not match the SHA-256 recorded when it was made."""


@dataclass(frozen=True)
class Challenge:
    """A ``tw-make`` challenge and how a difficulty level maps to its generator settings."""

    name: str
    levels: tuple[int, ...]
    settings: Callable[[int, str | None], dict[str, Any]]
    """``settings(level, generator_split) -> tw-make settings`` for TextWorld's ``make``."""
    splits: Mapping[str, str] | None = None
    """bpo split -> the generator's own split; None when the generator has no splits."""

    def check_level(self, level: int) -> None:
        if level not in self.levels:
            runs: list[str] = []
            for lv in self.levels:
                if runs and int(runs[-1].rpartition("-")[2]) == lv - 1:
                    runs[-1] = f"{runs[-1].partition('-')[0]}-{lv}"
                else:
                    runs.append(str(lv))
            raise ValueError(f"{self.name} has no level {level}; valid levels: {', '.join(runs)}")


CHALLENGES: Registry[Challenge] = Registry("TextWorld challenge")

# Levels modelled on GATA's cooking levels (Adhikari et al., 2020, "Learning Dynamic Belief
# Graphs to Generalize on Text-Based Games", table 3): 1 room and a cut ingredient; add
# cooking; 9 rooms with doors to open; 3 ingredients in 6 rooms, cut and cooked.
_COOKING_LEVELS: Mapping[int, dict[str, Any]] = {
    1: dict(recipe=1, take=1, go=1, open=False, cook=False, cut=True),
    2: dict(recipe=1, take=1, go=1, open=False, cook=True, cut=True),
    3: dict(recipe=1, take=1, go=9, open=True, cook=False, cut=False),
    4: dict(recipe=3, take=3, go=6, open=True, cook=True, cut=True),
}
_SIMPLE_LEVELS: Mapping[int, dict[str, str]] = {
    1: dict(rewards="dense", goal="detailed"),
    2: dict(rewards="balanced", goal="detailed"),
    3: dict(rewards="sparse", goal="brief"),
    4: dict(rewards="sparse", goal="none"),
}


def _cooking(level: int, split: str | None) -> dict[str, Any]:
    # recipe_seed is filled in per game (= the game seed) by the generator below.
    return dict(_COOKING_LEVELS[level], drop=False, split=split)


def _simple(level: int, split: str | None) -> dict[str, Any]:
    return dict(_SIMPLE_LEVELS[level], test=split == "test")


def _coin_rooms(level: int) -> int:
    return ((level - 1) // 100 + 1) * ((level - 1) % 100 + 1)


CHALLENGES.register("tw-cooking")(
    Challenge(
        "tw-cooking",
        tuple(_COOKING_LEVELS),
        _cooking,
        {"train": "train", "valid": "valid", "test": "test"},
    )
)
CHALLENGES.register("tw-simple")(
    # tw-simple has a train and a test distribution; valid draws held-out train-distribution seeds.
    Challenge(
        "tw-simple",
        tuple(_SIMPLE_LEVELS),
        _simple,
        {"train": "train", "valid": "train", "test": "test"},
    )
)
CHALLENGES.register("tw-coin_collector")(
    # Level L: quest length (L-1) % 100 + 1 with (L-1) // 100 distractor rooms per step;
    # TextWorld 1.7 (Z-machine only) caps a game at 100 rooms.
    Challenge(
        "tw-coin_collector",
        tuple(lv for lv in range(1, 301) if _coin_rooms(lv) <= 100),
        lambda level, split: dict(level=level),
    )
)
CHALLENGES.register("tw-treasure_hunter")(
    # Levels 1-10 easy (5 rooms), 11-20 medium (10 rooms, doors), 21-30 hard (20 rooms, keys).
    Challenge("tw-treasure_hunter", tuple(range(1, 31)), lambda level, split: dict(level=level))
)


@dataclass(frozen=True)
class GameSpec:
    """One game: challenge, difficulty level, the generator's split (if any) and seed."""

    challenge: str
    level: int
    seed: int
    split: str | None = None

    @property
    def name(self) -> str:
        """The canonical task name (also the game's folder under the cache root)."""
        split = f"/split={self.split}" if self.split is not None else ""
        return f"{self.challenge}/level={self.level}{split}/seed={self.seed}"

    def settings(self) -> dict[str, Any]:
        """The ``tw-make`` settings for this game."""
        settings = CHALLENGES.get(self.challenge).settings(self.level, self.split)
        if self.challenge == "tw-cooking":
            settings["recipe_seed"] = self.seed
        return settings


_TASK_FORMAT = "<challenge>/level=<int>[/split=<train|valid|test>]/seed=<int>"


def parse_task(task: str) -> GameSpec:
    """Parse and validate a task name such as ``tw-cooking/level=1/split=train/seed=12``."""
    challenge_name, *parts = task.strip().strip("/").split("/")
    challenge = CHALLENGES.get(challenge_name)  # unknown names list the valid ones
    fields: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in ("level", "split", "seed") or key in fields:
            raise ValueError(f"bad TextWorld task {task!r} at {part!r}; expected {_TASK_FORMAT}")
        fields[key] = value
    if "level" not in fields or "seed" not in fields:
        raise ValueError(f"bad TextWorld task {task!r}: needs level and seed; {_TASK_FORMAT}")
    try:
        level, seed = int(fields["level"]), int(fields["seed"])
    except ValueError:
        raise ValueError(f"bad TextWorld task {task!r}: level and seed are integers") from None
    challenge.check_level(level)
    if seed < 0:
        raise ValueError(f"bad TextWorld task {task!r}: seed must be >= 0")
    split = fields.get("split")
    if split is not None:
        valid = sorted(set(challenge.splits.values())) if challenge.splits else []
        if split not in valid:
            raise ValueError(
                f"{challenge.name} has no split {split!r}; valid: {valid or 'none (omit split=)'}"
            )
    return GameSpec(challenge.name, level, seed, split)


def task_names(
    split: str,
    n: int = 100,
    challenge: str = "tw-cooking",
    level: int = 1,
    start: int = 0,
) -> list[str]:
    """``n`` task names of one challenge and level for ``split`` (train, valid or test).

    Seeds are ``SPLIT_SEED_OFFSET[split] + start + i``; where the generator has its own
    distributions (tw-cooking, tw-simple) the name also carries the generator's split.
    """
    if split not in SPLIT_SEED_OFFSET:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLIT_SEED_OFFSET)}")
    spec = CHALLENGES.get(challenge)
    gen_split = spec.splits[split] if spec.splits else None
    offset = SPLIT_SEED_OFFSET[split] + start
    names = [GameSpec(spec.name, level, offset + i, gen_split).name for i in range(n)]
    if names:
        parse_task(names[0])  # validates the level
    return names


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where games live: ``cache_dir`` or ``$BPO_CACHE`` (default ~/.cache/bpo) /textworld/..."""
    import textworld  # lazily: listing environments must not import TextWorld

    base = cache_dir or os.environ.get("BPO_CACHE") or Path.home() / ".cache" / "bpo"
    return Path(base).expanduser() / "textworld" / f"tw-{textworld.__version__}"


@dataclass(frozen=True)
class GameFiles:
    """A generated, verified game on disk."""

    spec: GameSpec
    folder: Path

    @property
    def z8(self) -> Path:
        return self.folder / "game.z8"

    @property
    def json(self) -> Path:
        return self.folder / "game.json"


_FILES = ("game.z8", "game.json")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify(files: GameFiles) -> GameFiles:
    """Check ``files`` against ``meta.json``; raise :class:`CorruptGameError` naming the file."""
    meta_path = files.folder / "meta.json"
    fix = f"delete {files.folder} to have it regenerated (or pass on_corrupt='regenerate')"
    try:
        meta = json.loads(meta_path.read_text())
        recorded = meta["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptGameError(
            f"corrupt TextWorld game cache: {meta_path} unreadable; {fix}", exc
        ) from exc
    for name in _FILES:
        path = files.folder / name
        if not path.is_file():
            raise CorruptGameError(f"corrupt TextWorld game cache: {path} is missing; {fix}")
        if _sha256(path) != recorded.get(name):
            raise CorruptGameError(
                f"corrupt TextWorld game cache: {path} does not match the SHA-256 in "
                f"{meta_path}; {fix}"
            )
    return files


def ensure_games(
    tasks: Sequence[str],
    cache_dir: str | os.PathLike[str] | None = None,
    on_corrupt: str = "raise",
    timeout_per_game: float = GEN_TIMEOUT_S,
) -> list[GameFiles]:
    """Generate every missing game of ``tasks`` (one child process for all), verify all.

    ``on_corrupt``: "raise" (:class:`CorruptGameError` naming the file) or "regenerate".
    """
    if on_corrupt not in ("raise", "regenerate"):
        raise ValueError(f"on_corrupt must be 'raise' or 'regenerate', not {on_corrupt!r}")
    root = cache_root(cache_dir)
    games = [GameFiles(spec, root / spec.name) for spec in map(parse_task, tasks)]
    if on_corrupt == "regenerate":
        for game in games:
            if game.folder.exists():
                try:
                    verify(game)
                except CorruptGameError:
                    shutil.rmtree(game.folder)
    missing = sorted({g.spec.name for g in games if not g.folder.exists()})
    if missing:
        _generate_in_child(missing, root, 30.0 + timeout_per_game * len(missing))
    return [verify(game) for game in games]


def _generate_in_child(tasks: Sequence[str], root: Path, timeout: float) -> None:
    env = dict(os.environ, PYTHONHASHSEED="0")
    cmd = [sys.executable, "-m", __name__, "--root", str(root), *tasks]
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except BaseException as exc:  # timeout or interrupt: stop the child, drop its work
            proc.kill()
            proc.wait()
            for task in tasks:
                final = root / task
                for tmp in final.parent.glob(f".{final.name}.{proc.pid}.*"):
                    shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise SandboxError(
                    f"generating TextWorld games {list(tasks)} took more than "
                    f"{timeout:.0f} s (raise timeout_per_game)"
                ) from exc
            raise
    if proc.returncode != 0:
        raise SandboxError(
            f"generating TextWorld games {list(tasks)} failed (exit {proc.returncode}):\n"
            f"{stderr[-3000:]}"
        )


def _generate_one(spec: GameSpec, root: Path) -> None:
    """Make one game with TextWorld's challenge generator; runs in the child process."""
    import textworld
    import textworld.challenges
    from textworld.generator import compile_game

    final = root / spec.name
    if final.exists():
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    # named after this process, so that a parent that kills it can remove it
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}.", dir=final.parent))
    try:
        textworld.g_rng.set_seed(spec.seed)  # some generator paths draw from the global rng
        options = textworld.GameOptions()
        options.seeds = spec.seed
        options.path = str(tmp / "game.z8")
        options.file_ext = ".z8"
        options.force_recompile = True
        _, make, _ = textworld.challenges.CHALLENGES[spec.challenge]
        game = make(settings=spec.settings(), options=options)
        compile_game(game, options)
        (tmp / "game.ni").unlink(missing_ok=True)  # the Inform 7 source; not needed to play
        meta = {
            "task": spec.name,
            "textworld": textworld.__version__,
            "settings": spec.settings(),
            "sha256": {name: _sha256(tmp / name) for name in _FILES},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            # Another process made the same (byte-identical) game first: keep theirs.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m bpo.sandbox.envs.textworld_games [--cache-dir DIR] TASK...``: generate (and
    verify) games ahead of a run; ``--root`` is the child-process mode used internally."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", help="default: $BPO_CACHE or ~/.cache/bpo")
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("tasks", nargs="+", help="task names, e.g. " + _TASK_FORMAT)
    args = parser.parse_args(argv)
    if args.root is None:
        for game in ensure_games(args.tasks, cache_dir=args.cache_dir):
            print(game.folder)
        return
    if os.environ.get("PYTHONHASHSEED") != "0":
        parser.error("--root needs PYTHONHASHSEED=0 (games are byte-identical only then)")
    for task in args.tasks:
        _generate_one(parse_task(task), args.root)


if __name__ == "__main__":
    main()
