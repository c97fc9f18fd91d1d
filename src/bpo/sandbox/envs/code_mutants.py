"""Mutation sites for the code sandbox's task generator (:mod:`bpo.sandbox.envs.code_generate`):
each a one-span text edit of a library module found with :mod:`ast` (operator swap,
off-by-one, dropped condition, wrong default), and the seeded order in which the generator
tries them."""

from __future__ import annotations

import ast
import itertools
import random
import re
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["KINDS", "Mutant", "mutants", "schedule_queues"]

KINDS = ("operator_swap", "off_by_one", "dropped_condition", "wrong_default")
"""Mutation kinds, in the order that breaks ties when choosing the next kind to try."""


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
