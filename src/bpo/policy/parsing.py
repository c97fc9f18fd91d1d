"""Turn a model's action text into one command for the sandbox, tolerating chat noise.

Handles ``<action>go north</action>``, ``Action: go north``, ``> take key``, quotes and
backticks, code fences, bullets, bold markers, trailing punctuation and several lines (the
explicitly marked line wins, else the first line that is not a labelled thought). Optionally
snaps the command to the admissible list (exact, then case- and whitespace-insensitive match).
Text that parses to nothing useful passes through as text: the sandbox turns an invalid command
into an observation, never an exception. Never raises.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_TAG = re.compile(r"<action>(.*?)(?:</action>|$)", re.IGNORECASE | re.DOTALL)
_FENCE = re.compile(r"```[^\n`]*\n?(.*?)(?:```|$)", re.DOTALL)
_MARKED = re.compile(
    r"^\W*(?:next\s+|final\s+)?(?:action|command|answer)[^\w:：=-]*[:：=-]\s*(.*)$", re.IGNORECASE
)
_LABEL = re.compile(
    r"^\W*(?:thought|thinking|reasoning|observation|explanation|plan)\s*[:：]", re.I
)
_LEAD = re.compile(
    r"^(?:[>$#]+\s*|[-*•]\s+|\d+[.)]\s+|(?:i\s+will|i'll|i\s+want\s+to|let's|let\s+me)\s+)",
    re.IGNORECASE,
)
_SPECIAL = re.compile(r"<\|[^<>|\s]{1,40}\|>|</s>|<eos>|<end_of_turn>|<start_of_turn>")
_ROLES = {"assistant", "user", "system"}
_WRAP = "\"'`*_“”‘’"
_TRAIL = ".!;,"
MAX_CHARS = 200
"""Commands are cut to this many characters."""


@dataclass(frozen=True)
class ParsedAction:
    """A parsed command."""

    text: str
    """The command for the sandbox: one line, stripped, at most ``MAX_CHARS`` characters;
    empty only when ``raw`` is blank."""
    raw: str
    """The model's text."""
    snapped: bool
    """True when ``text`` is an element of the admissible list."""


def parse_action(
    raw: str, admissible: Sequence[str] | None = None, snap: bool = True
) -> ParsedAction:
    """Extract the command from ``raw``; snap it to ``admissible`` when ``snap`` and it matches."""
    raw = raw if isinstance(raw, str) else str(raw)
    candidates = _candidates(raw)
    text = candidates[0] if candidates else " ".join(raw.split())[:MAX_CHARS]  # pass through
    if snap and admissible:
        lookup = {_norm(a): a for a in reversed(list(admissible))}
        exact = set(admissible)
        for cand in candidates:  # the chosen command first, then the other lines
            if cand in exact:
                return ParsedAction(cand, raw, True)
            hit = lookup.get(_norm(cand))
            if hit is not None:
                return ParsedAction(hit, raw, True)
    # text that passed through unchanged (nothing was left after cleaning) may still be listed
    return ParsedAction(text, raw, bool(snap and admissible) and text in set(admissible or ()))


def _candidates(raw: str) -> list[str]:
    """Cleaned command candidates, best first."""
    body = raw
    tag = _TAG.search(body)
    if tag:
        body = tag.group(1)
    fence = _FENCE.search(body)
    if fence and fence.group(1).strip():
        body = fence.group(1)
    lines = [ln.strip() for ln in body.replace("\r", "\n").split("\n")]
    lines = [ln for ln in lines if ln and ln.strip("`") != ""]
    marked: list[str] = []
    for i, ln in enumerate(lines):
        m = _MARKED.match(ln)
        if m:
            rest = m.group(1).strip()
            if not rest and i + 1 < len(lines):
                rest = lines[i + 1]
            marked.append(rest)
    plain = [ln for ln in lines if not _LABEL.match(ln) and not _MARKED.match(ln)]
    out: dict[str, None] = {}  # ordered, O(1) membership: linear time on many lines
    for cand in [*marked, *plain, *lines]:
        c = _clean(cand)
        if c and c not in out and c.lower() not in _ROLES:
            out[c] = None
    return list(out)


def _clean(text: str) -> str:
    """Strip leaders, wrappers and trailing punctuation until nothing changes."""
    text = " ".join(_SPECIAL.sub(" ", text).split())
    for _ in range(8):
        before = text
        m = _MARKED.match(text)
        if m:
            text = m.group(1)
        text = _LEAD.sub("", text).strip()
        text = text.strip(_WRAP).strip()
        text = text.rstrip(_TRAIL).strip()
        if text == before:
            break
    return text[:MAX_CHARS].strip()


def _norm(text: str) -> str:
    return " ".join(text.lower().split())
