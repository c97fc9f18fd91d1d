"""SWE-bench-style code-repair tasks made offline from real PyPI projects: the projects, the
task format, the workspaces and the grader.

A task is one injected bug in a pristine source distribution whose own test suite exposes it,
in the SWE-bench instance format (``instance_id``, ``repo``, ``base_commit``,
``problem_statement``, ``patch``, ``test_patch``, ``FAIL_TO_PASS``, ``PASS_TO_PASS``) plus
what this project needs to rebuild and grade it without a network: the vendored ``sdist``, the
hidden ``bug_patch``, the ``test_command`` and the ``test_files`` the grader restores.
:mod:`bpo.sandbox.envs.code_generate` makes the tasks (``bpo tasks generate code``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from bpo.sandbox.workspace.jail import PYTHON_LIB, CommandResult, Jail

DATA_DIR = Path(__file__).parent / "code_data"
"""The vendored sdists, ``SOURCES.md`` and the shipped ``tasks.jsonl``."""
TASKS_FILE = DATA_DIR / "tasks.jsonl"

OUTPUT_BYTES = 4_000_000
"""Output kept from one test run: enough for ``-rA`` over a whole suite."""

PYTEST = (
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -rA --tb=short -p no:cacheprovider "
    "-o addopts="
)
"""The pytest invocation of every project: no plugins (no network, no coverage), no cache
files, the project's own ``addopts`` cleared (they name plugins that are not installed)."""
_PYTEST_CONFIGS = ("pyproject.toml", "setup.cfg", "tox.ini", "pytest.ini", ".pytest.ini")


class GenerationError(ValueError):
    """Bad input to the generator (unknown project, missing sdist); the message says the fix."""


# --- projects ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Project:
    """One vendored PyPI source distribution and how to test and mutate it."""

    name: str
    """PyPI name; also the task id prefix (``{name}__{name}-0007``)."""
    version: str
    sha256: str
    """Of the sdist as downloaded from PyPI."""
    library: tuple[str, ...]
    """Modules (paths in the sdist) where bugs are injected; never tests."""
    tests: tuple[str, ...]
    """Test directories or files given to pytest (the test directives)."""
    pythonpath: str = "."
    """Import root of the library, relative to the workspace ("src" for a src layout)."""

    @property
    def sdist(self) -> str:
        return f"{self.name}-{self.version}.tar.gz"

    @property
    def runner(self) -> str:
        """The test command without its directives: append node ids to run just those."""
        return f"PYTHONPATH={self.pythonpath}:$PYTHONPATH {PYTEST}"

    @property
    def test_command(self) -> str:
        return f"{self.runner} {' '.join(self.tests)}"


PROJECTS: dict[str, Project] = {
    p.name: p
    for p in (
        Project(
            "toolz", "1.2.0", "9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490",
            library=(
                "toolz/dicttoolz.py", "toolz/functoolz.py", "toolz/itertoolz.py",
                "toolz/recipes.py", "toolz/sandbox/core.py", "toolz/sandbox/parallel.py",
            ),
            tests=("toolz/tests", "toolz/sandbox/tests"),
        ),
        Project(
            "parse", "1.22.4", "706d458feed5a81b02768d3156e8070baf6cee7d150a3a3c0cd43101a875c3b5",
            library=("parse/__init__.py",),
            tests=("tests",),
        ),
        Project(
            "semver", "3.1.2", "bea193552413194252d33ff26ce0962b76669bd1c6fb17e8e203ac37f072feaf",
            library=("src/semver/version.py", "src/semver/_deprecated.py", "src/semver/cli.py"),
            tests=("tests",),
            pythonpath="src",
        ),
        Project(
            "tabulate", "0.10.0",
            "e2cfde8f79420f6deeffdeda9aaec3b6bc5abce947655d17ac662b126e48a60d",
            library=("tabulate/__init__.py",),
            tests=("test",),
        ),
    )
}  # fmt: skip


def project(name: str) -> Project:
    try:
        return PROJECTS[name]
    except KeyError:
        raise GenerationError(
            f"unknown project {name!r}; valid projects: {', '.join(PROJECTS)}"
        ) from None


def sdist_path(proj: Project, data_dir: Path = DATA_DIR) -> Path:
    """The vendored sdist, checked against its sha256."""
    path = Path(data_dir) / proj.sdist
    fetch = f"`pip download --no-deps --no-binary :all: {proj.name}=={proj.version} -d {data_dir}`"
    if not path.is_file():
        raise GenerationError(f"sdist {proj.sdist} not found in {data_dir}; fetch it with {fetch}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != proj.sha256:
        raise GenerationError(
            f"{path} has sha256 {digest}, expected {proj.sha256} (the PyPI file); "
            f"replace it with {fetch}"
        )
    return path


def _read_sdist(path: Path) -> dict[str, bytes]:
    """Regular files of an sdist by path without its top directory."""
    files = {}
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            name = _strip_top(m.name)
            if m.isfile() and name:
                files[name] = tar.extractfile(m).read()  # type: ignore[union-attr]
    return files


def _strip_top(name: str) -> str:
    return "/".join(PurePosixPath(name).parts[1:])


# --- tasks ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweInstance:
    """The keys of a SWE-bench instance that the code sandbox uses (shared by the generated
    tasks here and by real SWE-bench instances, ``bpo.sandbox.workspace.docker``)."""

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str
    """The gold fix, a unified diff (``git apply``)."""
    test_patch: str
    FAIL_TO_PASS: Sequence[str]
    PASS_TO_PASS: Sequence[str]
    version: str


@dataclass(frozen=True)
class Task(SweInstance):
    """One generated code-repair task: SWE-bench's keys (``repo`` is "pypi/{name}",
    ``base_commit`` the commit :func:`prepare_workspace` builds, ``patch`` a diff against that
    buggy workspace, ``test_patch`` always "": the project's own tests expose the bug, and the
    test lists are lists), then this project's extras."""

    sdist: str
    """File name in ``code_data/``."""
    bug_patch: str
    """The injected bug as a diff against the pristine sdist (hidden from the agent)."""
    mutation: dict[str, Any]
    """{"kind", "file", "line"} of the injected bug."""
    test_command: str
    """The whole suite, run from the workspace root: ``test_runner`` + ``test_directives``."""
    test_directives: list[str]
    test_files: list[str]
    """Test files and pytest configuration, restored from the sdist before grading."""
    split: str
    """"train" or "test" (held out)."""

    @property
    def project(self) -> str:
        return self.repo.removeprefix("pypi/")

    @property
    def test_runner(self) -> str:
        """``test_command`` without its directives; append node ids to run just those."""
        return self.test_command.removesuffix(" ".join(self.test_directives)).rstrip()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, ensure_ascii=True)


def load_tasks(path: str | os.PathLike[str] = TASKS_FILE) -> list[Task]:
    """Tasks from a JSON-lines file (by default the shipped set)."""
    names = {f.name for f in dataclasses.fields(Task)}
    tasks = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if set(record) != names:
            raise ValueError(
                f"{path}:{n}: keys differ from Task's: missing {sorted(names - set(record))}, "
                f"unknown {sorted(set(record) - names)}"
            )
        tasks.append(Task(**record))
    return tasks


def save_tasks(tasks: Sequence[Task], path: str | os.PathLike[str]) -> None:
    Path(path).write_text("".join(t.to_json() + "\n" for t in tasks))


# --- workspaces -------------------------------------------------------------------------------

_GIT_DATE = "2000-01-01T00:00:00+0000"
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "bpo",
    "GIT_AUTHOR_EMAIL": "bpo@localhost",
    "GIT_AUTHOR_DATE": _GIT_DATE,
    "GIT_COMMITTER_NAME": "bpo",
    "GIT_COMMITTER_EMAIL": "bpo@localhost",
    "GIT_COMMITTER_DATE": _GIT_DATE,
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_TERMINAL_PROMPT": "0",
}
_GIT_OPTS = ("-c", "core.autocrlf=false", "-c", "commit.gpgsign=false", "-c", "core.hooksPath=")


def git(workspace: Path, *args: str, stdin: str | None = None) -> str:
    """Run git in ``workspace`` with a fixed identity and date and no user configuration."""
    env = {**os.environ, **_GIT_ENV}
    proc = subprocess.run(
        ["git", *_GIT_OPTS, *args], cwd=workspace, env=env, input=stdin, text=True,
        capture_output=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {workspace}: {proc.stderr.strip()}")
    return proc.stdout


def extract_sdist(sdist: Path, dest: Path) -> None:
    """Extract ``sdist`` into ``dest`` without its top directory."""

    def strip(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
        name = _strip_top(member.name)
        if not name:
            return None
        link = member.linkname
        if member.islnk():
            link = _strip_top(link)
        return tarfile.data_filter(member.replace(name=name, linkname=link, deep=False), path)

    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter=strip)


def prepare_workspace(task: Task, dest: Path, data_dir: Path = DATA_DIR) -> None:
    """The buggy workspace of ``task`` at ``dest``: the sdist with ``bug_patch`` applied, as one
    git commit whose hash is ``task.base_commit`` (for a task made by this generator)."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"workspace {dest} is not empty")
    extract_sdist(sdist_path(project(task.project), data_dir), dest)
    git(dest, "-c", "init.defaultBranch=main", "init", "-q")
    if task.bug_patch:
        git(dest, "apply", "-", stdin=task.bug_patch)
    git(dest, "add", "-A", "-f")
    git(dest, "commit", "-q", "--no-verify", "-m", f"{task.project} {task.version}")


def restore_test_files(task: Task, workspace: Path, data_dir: Path = DATA_DIR) -> None:
    """Rewrite ``task.test_files`` from the pristine sdist and delete any ``conftest.py`` it
    does not have, so edits to the tests cannot make them pass."""
    workspace = Path(workspace)
    pristine = _read_sdist(sdist_path(project(task.project), data_dir))
    for name in task.test_files:
        path = workspace / name
        # this process writes as the host: a directory on the way that the agent replaced by
        # a link (tests -> /etc) must not be followed
        for i in range(1, len(PurePosixPath(name).parts)):
            parent = workspace.joinpath(*PurePosixPath(name).parts[:i])
            if parent.is_symlink() or (parent.exists() and not parent.is_dir()):
                parent.unlink()
        if path.is_symlink() or path.is_dir():
            _remove(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pristine[name])
    for path in sorted(workspace.rglob("conftest.py")):
        rel = path.relative_to(workspace).as_posix()
        if not rel.startswith(".git/") and rel not in pristine:
            _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _test_files(proj: Project, files: dict[str, bytes]) -> list[str]:
    def is_test(name: str) -> bool:
        return (
            any(name == d or name.startswith(d.rstrip("/") + "/") for d in proj.tests)
            or name in _PYTEST_CONFIGS
            or PurePosixPath(name).name == "conftest.py"
        )

    return sorted(n for n in files if is_test(n))


# --- running tests ----------------------------------------------------------------------------

_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "XFAIL": "skipped"}
_STATUS |= {"XPASS": "passed"}
_RANK = {"skipped": 0, "passed": 1, "failed": 2, "error": 3}
_SUMMARY = re.compile(r"^=+ short test summary info =+$")


def parse_summary(output: str) -> dict[str, str]:
    """node id -> "passed"/"failed"/"error"/"skipped" from pytest's ``-rA`` short summary.

    A test reported twice (passed, then an error in teardown) keeps the worse status; skipped
    tests appear only if pytest names them (xfail), since ``SKIPPED`` lines give locations."""
    statuses: dict[str, str] = {}
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if _SUMMARY.match(line)), len(lines))
    for line in lines[start + 1 :]:
        word, _, rest = line.partition(" ")
        status = _STATUS.get(word)
        if status is None or not rest:
            continue
        node = _node_id(rest)
        if _RANK[status] >= _RANK.get(statuses.get(node, "skipped"), 0):
            statuses[node] = status
    return statuses


def _node_id(rest: str) -> str:
    """The node id at the start of a summary line's remainder, before " - message"; a " - "
    inside a parametrization's brackets is part of the id."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        elif depth == 0 and rest.startswith(" - ", i):
            return rest[:i]
    return rest


def pytest_command(task: Task, node_ids: Sequence[str] | None = None) -> str:
    """The whole suite, or just ``node_ids``."""
    if node_ids is None:
        return task.test_command
    return f"{task.test_runner} {' '.join(shlex.quote(n) for n in node_ids)}"


def _run(jail: Jail, workspace: Path, command: str, wall_s: float | None = None) -> CommandResult:
    """``jail.run`` keeping enough output for the summary of a whole suite."""
    limits = dataclasses.replace(
        jail.limits,
        output_bytes=max(jail.limits.output_bytes, OUTPUT_BYTES),
        wall_s=wall_s or jail.limits.wall_s,
    )
    return jail.run(command, workspace, limits=limits)


def run_tests(
    jail: Jail, workspace: Path, task: Task, node_ids: Sequence[str] | None = None
) -> dict[str, str]:
    """Run the task's tests (all, or ``node_ids``) in ``jail``; node id -> status. A test the
    run did not report (it was stopped by a limit, collection failed) is absent."""
    return parse_summary(_run(jail, workspace, pytest_command(task, node_ids)).output)


def hardened(command: str) -> str:
    """The grader's form of a test command: ``python -S -P`` with the jail's own packages first
    on the path, so that files the agent adds to the workspace (a ``pytest.py``, a
    ``sitecustomize.py``) cannot stand in for pytest or run before it. The library's own code
    still runs inside the test process; like SWE-bench's harness, the grader trusts that code
    not to rewrite pytest's report."""
    return command.replace("python -m pytest", "python -S -P -m pytest").replace(
        "PYTHONPATH=", f"PYTHONPATH={PYTHON_LIB}:", 1
    )


def judge(jail: Jail, workspace: Path, task: Task) -> bool:
    """True when every FAIL_TO_PASS and PASS_TO_PASS test passes. Call
    :func:`restore_test_files` first."""
    statuses = parse_summary(_run(jail, workspace, hardened(pytest_command(task))).output)
    return all(statuses.get(n) == "passed" for n in [*task.FAIL_TO_PASS, *task.PASS_TO_PASS])
