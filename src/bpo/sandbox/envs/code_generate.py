"""The generator of :mod:`bpo.sandbox.envs.code_tasks`' task set (``bpo tasks generate code``).

Per project:

1. extracts the pristine sdist (``code_data/``, listed in :data:`PROJECTS`) and runs its test
   suite in the jail twice: every test must pass, with the same ids both times;
2. enumerates mutation sites in the library modules with :mod:`ast`
   (:func:`bpo.sandbox.envs.code_mutants.mutants`:
   operator swap, off-by-one, dropped condition, wrong default), each a one-span text edit;
3. tries them in a seeded order that always picks next from the kind with the fewest kept
   tasks, and keeps a mutant when 1 to :data:`MAX_FAILING` tests fail, every other test still
   passes, nothing errors, and the failures repeat on a rerun of just those tests;
4. writes the problem statement from that rerun's failure reports (test names, the test-side
   traceback lines, the assertion and exception messages), never from the diff.

The choice of the next mutant never depends on how many tasks are asked for, so
``--per-project 3`` yields exactly the first three tasks of the shipped set, byte for byte.
"""

from __future__ import annotations

import dataclasses
import difflib
import random
import re
import shlex
import shutil
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from bpo.sandbox.envs.code_mutants import KINDS, Mutant, mutants, schedule_queues
from bpo.sandbox.envs.code_tasks import (
    DATA_DIR,
    PROJECTS,
    GenerationError,
    Project,
    Task,
    _read_sdist,
    _run,
    _test_files,
    extract_sdist,
    git,
    parse_summary,
    prepare_workspace,
    project,
    sdist_path,
)
from bpo.sandbox.workspace.jail import Jail, Limits

PER_PROJECT = 16
"""Tasks per project in the shipped set."""
MAX_FAILING = 8
"""A mutant that fails more tests than this is too blunt to be a useful task."""
MAX_TRIES = 400
"""Mutants tried per project before giving up on reaching ``per_project``."""
TEST_EVERY = 4
"""Every fourth task of a project (index 3, 7, ...) is held out: split "test"."""
WALL_FACTOR, MIN_WALL_S = 10.0, 20.0
"""A mutant's suite may take this many times the pristine suite's time (at least so many
seconds): longer means it loops, and it is dropped."""


# --- diffs and problem statements -------------------------------------------------------------


def unified_diff(path: str, old: str, new: str) -> str:
    """A ``git apply``-able diff of one file (``a/`` and ``b/`` prefixes)."""

    def lines(text: str) -> list[str]:
        parts = text.split("\n")
        return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])

    out = [f"diff --git a/{path} b/{path}\n"]
    for line in difflib.unified_diff(lines(old), lines(new), f"a/{path}", f"b/{path}", n=3):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


_BLOCK = re.compile(r"^_{3,} (.+?) _{3,}$")
_SECTION = re.compile(r"^={3,} (.+?) ={3,}$")
_FRAME = re.compile(r"^(\S+?):(\d+): in \S+")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_TMP = re.compile(r"/tmp/(?:pytest-of-[^/\s]+/pytest-\d+/|[^/\s]+/)?")
DETAILED = 3
"""Failing tests whose reports the problem statement quotes (the rest are listed by name)."""
_E_LINES = 12


def failure_reports(output: str, test_files: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(title, report) per failure of a ``--tb=short`` run, in pytest's order. The title is
    pytest's (``Class.test[param]``); the report is reduced to what a user sees from the test
    side: the test files' frames and the error lines (``E ...``). Frames inside the library
    are left out: where the bug is, is the task."""
    tests = set(test_files)
    reports: list[tuple[str, list[str]]] = []
    report: list[str] | None = None
    in_failures = keep_source = False
    for line in output.splitlines():
        line = _TMP.sub("<tmp>/", _ADDRESS.sub("0x...", line.replace("/workspace/", "")))
        section = _SECTION.match(line)
        if section:
            in_failures = section.group(1) == "FAILURES"
            report = None
            continue
        if not in_failures:
            continue
        if block := _BLOCK.match(line):
            report = []
            reports.append((block.group(1), report))
            keep_source = False
        elif report is None:
            continue
        elif line.startswith("---"):
            keep_source = False
        elif frame := _FRAME.match(line):
            keep_source = frame.group(1) in tests
            if keep_source:
                report.append(line)
        elif line.startswith("E "):
            if sum(x.startswith("E ") for x in report) < _E_LINES:
                report.append(line.rstrip())
        elif keep_source and line.startswith(" "):
            report.append(line.rstrip())
    return reports


def report_of(node_id: str, reports: Sequence[tuple[str, list[str]]]) -> list[str]:
    """The report of one test: its title matches and, among equal titles (the same test name
    in two files), its first frame is in the test's file."""
    path, *names = node_id.split("::")
    same = [r for title, r in reports if title == ".".join(names)]
    return next((r for r in same if r and r[0].startswith(f"{path}:")), same[0] if same else [])


def problem_statement(
    proj: Project, failed: Sequence[str], total: int, reports: Sequence[tuple[str, list[str]]]
) -> str:
    """A bug report written from the failing tests alone."""
    n = len(failed)
    parts = [
        f"After a recent change to `{proj.name}` ({proj.version}), {n} of the {total} tests "
        f"in its own suite {'fails' if n == 1 else 'fail'}; the others still pass.",
        "",
        "Failing:",
        *(f"- `{t}`" for t in failed),
        "",
    ]
    for test in failed[:DETAILED]:
        parts += [f"`{test}` reports:", "", "```", *report_of(test, reports), "```", ""]
    parts += [
        "The tests describe the intended behaviour. Fix the library so that the whole suite "
        "passes; do not edit the tests. The suite runs from the repository root with:",
        "",
        f"    {proj.test_command}",
    ]
    return "\n".join(parts) + "\n"


# --- the generator ----------------------------------------------------------------------------


class _Verdict(NamedTuple):
    kept: bool
    reason: str
    failed: tuple[str, ...] = ()
    report_output: str = ""


@dataclass
class _Jails:
    """One jail per worker thread (a jail is not shared between threads)."""

    limits: Limits
    _local: threading.local = field(default_factory=threading.local)
    _all: list[Jail] = field(default_factory=list)

    def get(self) -> Jail:
        jail = getattr(self._local, "jail", None)
        if jail is None:
            jail = self._local.jail = Jail(self.limits)
            self._all.append(jail)
        return jail

    def close(self) -> None:
        for jail in self._all:
            jail.close()


class _ProjectRun:
    """Generation state of one project: its pristine tree and the suite's baseline."""

    def __init__(self, proj: Project, data_dir: Path, tmp: Path, jails: _Jails) -> None:
        self.proj, self.tmp, self.jails = proj, tmp, jails
        self.sdist = sdist_path(proj, data_dir)
        self.files = _read_sdist(self.sdist)
        self.pristine = tmp / "pristine"
        extract_sdist(self.sdist, self.pristine)
        result = _run(jails.get(), self.pristine, proj.test_command)
        statuses = parse_summary(result.output)
        bad = sorted(n for n, s in statuses.items() if s in ("failed", "error"))
        if result.limit or bad or not statuses:
            raise GenerationError(
                f"the pristine test suite of {proj.name} {proj.version} does not pass "
                f"({result.limit or 'failing: ' + ', '.join(bad[:5])}):\n{result.output[-3000:]}"
            )
        again = parse_summary(_run(jails.get(), self.pristine, proj.test_command).output)
        if again != statuses:
            changed = sorted(set(again.items()) ^ set(statuses.items()))[:5]
            raise GenerationError(
                f"two runs of the pristine test suite of {proj.name} {proj.version} differ "
                f"(test ids or results, e.g. {changed}); tasks need a deterministic suite"
            )
        self.passing = frozenset(n for n, s in statuses.items() if s == "passed")
        self.wall_s = max(MIN_WALL_S, WALL_FACTOR * result.seconds)
        self.test_files = _test_files(proj, self.files)

    def evaluate(self, mutant: Mutant) -> _Verdict:
        """Run the suite on the mutant; keep it when a few tests fail, reproducibly."""
        jail = self.jails.get()
        with tempfile.TemporaryDirectory(dir=self.tmp) as tmp:
            ws = Path(tmp) / "ws"
            shutil.copytree(self.pristine, ws, symlinks=True)
            (ws / mutant.file).write_bytes(mutant.apply(self.files[mutant.file]))
            result = _run(jail, ws, self.proj.test_command, self.wall_s)
            if result.limit:
                return _Verdict(False, f"limit: {result.limit}")
            statuses = parse_summary(result.output)
            if any(s == "error" for s in statuses.values()):
                return _Verdict(False, "errors")
            if {n for n, s in statuses.items() if s != "skipped"} != self.passing:
                return _Verdict(False, "different tests")
            failed = tuple(sorted(n for n, s in statuses.items() if s == "failed"))
            if not 1 <= len(failed) <= MAX_FAILING:
                return _Verdict(False, f"{len(failed)} failing")
            command = f"{self.proj.runner} {' '.join(map(shlex.quote, failed))}"
            rerun = _run(jail, ws, command, self.wall_s)
            again = parse_summary(rerun.output)
            if rerun.limit or any(again.get(n) != "failed" for n in failed):
                return _Verdict(False, "not reproducible")
            return _Verdict(True, "kept", failed, rerun.output)

    def task(self, index: int, mutant: Mutant, verdict: _Verdict) -> Task:
        proj = self.proj
        old = self.files[mutant.file].decode()
        new = mutant.apply(self.files[mutant.file]).decode()
        reports = failure_reports(verdict.report_output, self.test_files)
        task = Task(
            instance_id=f"{proj.name}__{proj.name}-{index:04d}",
            repo=f"pypi/{proj.name}",
            base_commit="",
            problem_statement=problem_statement(proj, verdict.failed, len(self.passing), reports),
            patch=unified_diff(mutant.file, new, old),
            test_patch="",
            FAIL_TO_PASS=list(verdict.failed),
            PASS_TO_PASS=sorted(self.passing - set(verdict.failed)),
            version=proj.version,
            sdist=proj.sdist,
            bug_patch=unified_diff(mutant.file, old, new),
            mutation={"kind": mutant.kind, "file": mutant.file, "line": mutant.line},
            test_command=proj.test_command,
            test_directives=list(proj.tests),
            test_files=self.test_files,
            split="test" if index % TEST_EVERY == TEST_EVERY - 1 else "train",
        )
        with tempfile.TemporaryDirectory(dir=self.tmp) as tmp:
            ws = Path(tmp) / "ws"
            prepare_workspace(task, ws, self.sdist.parent)
            head = git(ws, "rev-parse", "HEAD").strip()
        return dataclasses.replace(task, base_commit=head)


def _choose(
    run: _ProjectRun, n: int, jobs: int, log: Callable[[str], None]
) -> list[tuple[Mutant, _Verdict]]:
    """The first ``n`` kept mutants in the schedule: next always from the kind with the fewest
    kept (ties: :data:`KINDS` order), one per source line. Mutants are tried ``jobs`` at a time,
    ahead of need; a result that is not needed is dropped, so the choice never depends on
    ``jobs`` or ``n``."""
    proj = run.proj
    sites = [m for f in proj.library for m in mutants(f, run.files[f])]
    queues = schedule_queues(sites, random.Random(f"{proj.name}=={proj.version}"))
    kept: list[tuple[Mutant, _Verdict]] = []
    counts: Counter[str] = Counter()
    lines: set[tuple[str, int]] = set()
    tried = 0
    futures: dict[Mutant, Future[_Verdict]] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        while len(kept) < n and tried < MAX_TRIES:
            for q in queues.values():
                while q and (q[0].file, q[0].line) in lines:
                    q.popleft()
            kinds = sorted(
                (k for k in KINDS if queues[k]), key=lambda k: (counts[k], KINDS.index(k))
            )
            if not kinds:
                break
            ahead = [q[i] for i in range(jobs) for k in kinds if i < len(q := queues[k])]
            busy = sum(not f.done() for f in futures.values())
            for i, m in enumerate(ahead):
                if m not in futures and (i == 0 or busy < jobs):
                    futures[m] = pool.submit(run.evaluate, m)
                    busy += 1
            mutant = queues[kinds[0]].popleft()
            verdict = futures.pop(mutant).result()
            tried += 1
            if verdict.kept:
                kept.append((mutant, verdict))
                counts[mutant.kind] += 1
                lines.add((mutant.file, mutant.line))
        for f in futures.values():
            f.cancel()
    log(
        f"{proj.name}: kept {len(kept)} of {tried} tried ({len(sites)} sites); "
        + ", ".join(f"{k} {counts[k]}" for k in KINDS)
    )
    return kept


def generate(
    projects: Sequence[str] | None = None,
    per_project: int = PER_PROJECT,
    jobs: int = 2,
    data_dir: Path = DATA_DIR,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> list[Task]:
    """The task set: ``per_project`` tasks of each project (all of :data:`PROJECTS` by
    default), in registry order. Deterministic; a smaller ``per_project`` gives a prefix."""
    names = list(PROJECTS) if projects is None else list(projects)
    chosen = [project(n) for n in names]
    for proj in chosen:
        sdist_path(proj, data_dir)
    if per_project < 1 or jobs < 1:
        raise GenerationError("per_project and jobs must be at least 1")
    tasks = []
    jails = _Jails(Limits(wall_s=120, cpu_s=240, memory_mb=2048, pids=256))
    try:
        for proj in sorted(chosen, key=lambda p: list(PROJECTS).index(p.name)):
            with tempfile.TemporaryDirectory(prefix=f"bpo-{proj.name}-") as tmp:
                run = _ProjectRun(proj, Path(data_dir), Path(tmp), jails)
                for i, (mutant, verdict) in enumerate(_choose(run, per_project, jobs, log)):
                    tasks.append(run.task(i, mutant, verdict))
    finally:
        jails.close()
    return tasks
