"""The generator of :mod:`bpo.sandbox.envs.code_tasks`' task set (``bpo tasks generate code``).

Per project:

1. extracts the pristine sdist (``code_data/``, listed in :data:`PROJECTS`) and runs its test
   suite in the jail twice: every test must pass, with the same ids both times;
2. enumerates mutation sites in the library modules with :mod:`ast` (:func:`mutants`:
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

import ast
import dataclasses
import difflib
import itertools
import random
import re
import shlex
import shutil
import sys
import tempfile
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

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

KINDS = ("operator_swap", "off_by_one", "dropped_condition", "wrong_default")
"""Mutation kinds, in the order that breaks ties when choosing the next kind to try."""
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


# --- mutations --------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Mutant:
    """One injected bug: replace bytes ``start:end`` of ``file`` with ``new``."""

    file: str
    start: int
    end: int
    new: str
    kind: str
    line: int
    scope: str
    """The enclosing function (qualified), for spreading tasks over functions."""

    def apply(self, source: bytes) -> bytes:
        return source[: self.start] + self.new.encode() + source[self.end :]


_SWAPS: dict[type, tuple[type, str]] = {
    ast.Add: (ast.Sub, "-"), ast.Sub: (ast.Add, "+"),
    ast.Lt: (ast.LtE, "<="), ast.LtE: (ast.Lt, "<"), ast.Gt: (ast.GtE, ">="),
    ast.GtE: (ast.Gt, ">"), ast.Eq: (ast.NotEq, "!="), ast.NotEq: (ast.Eq, "=="),
    ast.Is: (ast.IsNot, "is not"), ast.IsNot: (ast.Is, "is"),
    ast.In: (ast.NotIn, "not in"), ast.NotIn: (ast.In, "in"),
    ast.And: (ast.Or, "or"), ast.Or: (ast.And, "and"),
}  # fmt: skip
_OP_TEXT = {"+", "-", "<", "<=", ">", ">=", "==", "!=", "is", "is not", "in", "not in"}
_OP_TEXT |= {"and", "or", "+=", "-="}


class _Source:
    """A module's bytes with ast positions turned into byte offsets."""

    def __init__(self, path: str, data: bytes) -> None:
        self.path, self.data = path, data
        self.starts = [0]
        for line in data.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def at(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (
            self.at(node.lineno, node.col_offset),  # type: ignore[attr-defined]
            self.at(node.end_lineno, node.end_col_offset),  # type: ignore[attr-defined]
        )

    def line_of(self, offset: int) -> int:
        return next(i for i, s in enumerate(self.starts) if s > offset)

    def op_between(self, lo: int, hi: int) -> tuple[int, int] | None:
        """The operator token between two operands: all that is not space, parentheses,
        line continuation or comment."""
        seg = re.sub(rb"#[^\n]*", lambda m: b" " * len(m.group()), self.data[lo:hi])
        seg = re.sub(rb"[()\\]", b" ", seg)
        m = re.search(rb"\S(?:.*\S)?", seg, re.S)
        if m is None or b" ".join(m.group().split()).decode() not in _OP_TEXT:
            return None
        return lo + m.start(), lo + m.end()

    def unparen(self, lo: int, hi: int) -> tuple[int, int]:
        """Widen a span over the parentheses that enclose exactly it."""
        while True:
            i, j = lo - 1, hi
            while i >= 0 and self.data[i : i + 1] in b" \t\r\n":
                i -= 1
            while j < len(self.data) and self.data[j : j + 1] in b" \t\r\n":
                j += 1
            if i < 0 or self.data[i : i + 1] != b"(" or self.data[j : j + 1] != b")":
                return lo, hi
            lo, hi = i, j + 1


def _scoped(tree: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """Every node with its enclosing function or class, skipping ``if __name__ == ...`` and
    ``if TYPE_CHECKING`` blocks (never run by the tests)."""

    def walk(node: ast.AST, scope: str) -> Iterator[tuple[ast.AST, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and re.search(
                r"__name__|TYPE_CHECKING", ast.unparse(child.test)
            ):
                continue
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = child.name if scope == "<module>" else f"{scope}.{child.name}"
            yield child, inner
            yield from walk(child, inner)

    return walk(tree, "<module>")


def _int_constants(node: ast.AST, negated: bool = False) -> Iterator[tuple[ast.Constant, bool]]:
    """Int literals of an operand, through arithmetic only (``len(x) - 1``, ``-1``)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        yield node, negated
    elif isinstance(node, ast.BinOp):
        yield from _int_constants(node.left)
        yield from _int_constants(node.right)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        yield from _int_constants(node.operand, isinstance(node.op, ast.USub))


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


def _other_defaults(value: object) -> list[str]:
    """Plausible wrong values for a default."""
    if isinstance(value, bool):
        return [repr(not value)]
    if isinstance(value, int):
        return [str(value + 1)] + ([str(value - 1)] if value > 0 else [])
    if isinstance(value, float):
        return [repr(value * 2) if value else "1.0"]
    if isinstance(value, str):
        return ['""'] if value else ['" "']
    return []


def mutants(path: str, data: bytes) -> list[Mutant]:
    """Every mutation site of one module, as edits that still parse, sorted."""
    src = _Source(path, data)
    tree = ast.parse(data)
    edits: list[tuple[str, str, int, int, str]] = []  # kind, scope, start, end, new

    def op_swaps(scope: str, op: ast.AST, operands: Sequence[ast.AST]) -> None:
        if type(op) not in _SWAPS:
            return
        for left, right in itertools.pairwise(operands):
            span = src.op_between(src.span(left)[1], src.span(right)[0])
            if span:
                edits.append(("operator_swap", scope, *span, _SWAPS[type(op)][1]))

    def off_by_one(scope: str, operand: ast.AST | None) -> None:
        for const, negated in _int_constants(operand) if operand is not None else ():
            n = const.value
            for new in (n + 1, n - 1):
                if new >= 0 and not (negated and new == 0):
                    edits.append(("off_by_one", scope, *src.span(const), str(new)))

    for node, scope in _scoped(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            if not (_is_text(node.left) or _is_text(node.right)):  # "a" - "b" is no bug
                op_swaps(scope, node.op, [node.left, node.right])
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Add, ast.Sub)):
            span = src.op_between(src.span(node.target)[1], src.span(node.value)[0])
            if span:
                new = "-=" if isinstance(node.op, ast.Add) else "+="
                edits.append(("operator_swap", scope, *span, new))
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                op_swaps(scope, op, operands[i : i + 2])
            for operand in operands:
                off_by_one(scope, operand)
        elif isinstance(node, ast.BoolOp):
            pairs = itertools.pairwise(node.values)
            spans = [src.op_between(src.span(a)[1], src.span(b)[0]) for a, b in pairs]
            if all(spans):  # swap every and/or token of this node, not of nested ones
                lo, hi = spans[0][0], spans[-1][1]  # type: ignore[index]
                text, word = data[lo:hi], _SWAPS[type(node.op)][1].encode()
                for a, b in reversed(spans):  # type: ignore[misc]
                    text = text[: a - lo] + word + text[b - lo :]
                edits.append(("operator_swap", scope, lo, hi, text.decode()))
            values = [src.unparen(*src.span(v)) for v in node.values]
            for i in range(len(values)):  # drop one clause
                lo, hi = (values[i][0], values[i + 1][0]) if i + 1 < len(values) else (
                    values[i - 1][1], values[i][1])  # fmt: skip
                edits.append(("dropped_condition", scope, lo, hi, ""))
        elif isinstance(node, ast.Subscript):
            if isinstance(node.slice, ast.Slice):
                off_by_one(scope, node.slice.lower)
                off_by_one(scope, node.slice.upper)
            else:
                off_by_one(scope, node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "range":
                for arg in node.args:
                    off_by_one(scope, arg)
        elif isinstance(node, ast.If) and not isinstance(node.test, ast.Constant):
            for new in ("True", "False"):
                edits.append(("dropped_condition", scope, *src.span(node.test), new))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            for default in [*args.defaults, *args.kw_defaults]:
                if default is None:
                    continue
                try:
                    value = ast.literal_eval(default)
                except ValueError:
                    continue
                for new in _other_defaults(value):
                    edits.append(("wrong_default", scope, *src.span(default), new))

    found = set()
    for kind, scope, lo, hi, new in edits:
        m = Mutant(path, lo, hi, new, kind, src.line_of(lo), scope)
        mutated = m.apply(data)
        if mutated == data:
            continue
        try:
            changed = ast.dump(ast.parse(mutated)) != ast.dump(tree)
        except SyntaxError:
            continue
        if changed:
            found.add(m)
    return sorted(found)


def schedule_queues(sites: Sequence[Mutant], rng: random.Random) -> dict[str, deque[Mutant]]:
    """Per kind, the order to try its mutants: functions in a shuffled order, taken round
    robin, each function's mutants shuffled, so consecutive tries hit different code."""
    queues = {}
    for kind in KINDS:
        groups: dict[tuple[str, str], list[Mutant]] = {}
        for m in sorted(s for s in sites if s.kind == kind):
            groups.setdefault((m.file, m.scope), []).append(m)
        order = [groups[k] for k in sorted(groups)]
        rng.shuffle(order)
        for g in order:
            rng.shuffle(g)
        queue: deque[Mutant] = deque()
        for i in range(max((len(g) for g in order), default=0)):
            queue.extend(g[i] for g in order if i < len(g))
        queues[kind] = queue
    return queues


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
