"""The code sandbox's file tools (:mod:`bpo.sandbox.envs.code`): path resolution that never
follows a link out of the workspace, edit bodies, the syntax check before a Python file is
written, and how a command's result reads as an observation."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = [
    "UNENCODABLE",
    "UsageError",
    "body_lines",
    "encodable",
    "inside",
    "render",
    "syntax_error",
    "walk_files",
    "write_text",
]


class UsageError(Exception):
    """A tool was called wrongly: the message becomes the observation."""


UNENCODABLE = "Invalid action: it holds characters that are not valid text (lone surrogates)."


def encodable(text: str) -> bool:
    """False for text that cannot be written as UTF-8 (paths, command lines, files)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def inside(root: Path, rel: str) -> Path:
    """``root/rel`` with every symlink on the way resolved inside ``root``. This process reads
    and writes the files as the host (through ``/proc/<pid>/root`` for overlay workspaces), so
    a link the agent made to ``/etc/shadow`` must not be followed: absolute links and links
    that climb out of the workspace are refused."""
    if Path(rel).is_absolute():
        raise UsageError(f"{rel!r} is not a path inside the workspace.")
    parts = list(Path(rel).parts)
    done: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not done:
                raise UsageError(f"{rel!r} points outside the workspace.")
            done.pop()
            continue
        path = root.joinpath(*done, part)
        if path.is_symlink():
            hops += 1
            target = os.readlink(path)
            if hops > 40 or target.startswith("/"):
                raise UsageError(f"{rel!r} is a link that points outside the workspace.")
            parts = list(Path(target).parts) + parts
            continue
        done.append(part)
    return root.joinpath(*done)


def body_lines(body: str) -> list[str]:
    lines = body.splitlines(keepends=True)
    if lines and lines[-1].strip() == "end_of_edit":
        lines.pop()
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return lines


def syntax_error(rel: str, text: str) -> str | None:
    if not rel.endswith(".py"):
        return None
    try:
        compile(text, rel, "exec", dont_inherit=True)
    except SyntaxError as e:
        return f"{e.msg} (line {e.lineno})"
    except ValueError as e:  # null bytes
        return str(e)
    return None


def write_text(path: Path, text: str) -> None:
    with open(path, "wb") as f:  # in place: keeps the file's mode
        f.write(text.encode("utf-8", "surrogateescape"))


def walk_files(start: Path) -> list[Path]:
    out = []
    for dirpath, dirs, files in os.walk(start):
        dirs[:] = sorted(d for d in dirs if d != ".git")
        out += [Path(dirpath) / f for f in sorted(files)]
    return out


def render(res: Any) -> str:
    text = res.output.rstrip("\n")
    status = f"(exit code {res.returncode})" if res.returncode else ""
    return (text + ("\n" if text and status else "") + status) or "(no output)"
