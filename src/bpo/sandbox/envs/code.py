"""``code``: SWE-style code repair in a repository workspace, through a small tool language.

A task (``bpo.sandbox.envs.code_tasks``, SWE-bench's instance format) is a real project's
checkout with an injected bug, a problem statement written from the failing tests, and the
repository's own tests as the judge. The agent works through these commands, one per action
(the first line is the command; ``edit`` and ``create`` take the following lines as text):

| command | what it does |
| --- | --- |
| ``open PATH [LINE]`` | show a window of the file, with line numbers, around LINE |
| ``goto LINE`` / ``scroll_down`` / ``scroll_up`` | move the window in the open file |
| ``search TEXT [PATH]`` | lines containing TEXT (in PATH, a file or directory; default all) |
| ``edit [PATH] START:END`` + lines | replace lines START..END (1-based, inclusive) with the lines that follow; ``START:START-1`` inserts; an optional last line ``end_of_edit`` is dropped; a Python file that would no longer compile is left unchanged and the error shown |
| ``create PATH`` + lines | create (or overwrite) a file |
| ``run COMMAND`` | run a shell command in the workspace (sandboxed, see ``bpo.sandbox.workspace.jail``) |
| ``test [ARGS]`` | run the project's test command (with pytest ARGS, e.g. a test file) |
| ``submit`` | end the episode: the grader restores the test files and runs FAIL_TO_PASS and PASS_TO_PASS |

Reward: 1 at ``submit`` when every FAIL_TO_PASS and PASS_TO_PASS test passes, else 0. Unknown
commands and bad arguments are observations that say what is wrong. Observations longer than
``max_obs_chars`` are cut and say so. Test output is normalised (durations removed) so that an
episode is deterministic; commands whose output depends on the clock (``date``, ``ls -l`` of
files written by commands) are not, and a replayed snapshot of such an episode fails its check.

Snapshots are native: the workspace's own snapshot (an overlayfs layer stack, or tar+zstd where
overlayfs cannot be mounted; ``workspace=``) plus the tool state (open file, window).

SWE-bench proper: ``swebench_file=PATH`` (a local JSON, JSON-lines or parquet export of SWE-bench
Verified) runs the instances in their official Docker images with container snapshots and the
official harness's grading (``bpo.sandbox.workspace.docker``); it needs a Docker engine.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bpo.sandbox.envs import ENVS
from bpo.sandbox.envs import code_tasks as ct
from bpo.sandbox.envs.code_bases import base_for, gold_files, task_index
from bpo.sandbox.envs.code_tools import (
    UNENCODABLE,
    UsageError,
    body_lines,
    encodable,
    inside,
    render,
    syntax_error,
    walk_files,
    write_text,
)
from bpo.sandbox.protocol import EnvSpec, Observation, Sandbox, StepResult
from bpo.sandbox.workspace import Limits, open_workspace
from bpo.sandbox.workspace.jail import WORKSPACE

COMMANDS = (
    "open PATH [LINE]", "goto LINE", "scroll_down", "scroll_up", "search TEXT [PATH]",
    "edit [PATH] START:END (then the new lines)", "create PATH (then the lines)",
    "run COMMAND", "test [ARGS]", "submit",
)  # fmt: skip
HELP = "Commands: " + "; ".join(COMMANDS) + "."
_DURATION = re.compile(r" in \d+(?:\.\d+)?s(?: \(\d+:\d\d:\d\d\))?")
_EDIT = re.compile(r"(?:(\S+)\s+)?(\d+):(\d+)")


@dataclass(frozen=True)
class _View:
    """The tool state: the open file and the first line of its window (1-based)."""

    path: str | None = None
    top: int = 1


@dataclass(frozen=True)
class CodeState:
    """A native snapshot: the workspace's state and the tool state."""

    workspace: Any
    view: _View
    steps: int
    done: bool

    @property
    def nbytes(self) -> int:
        return int(getattr(self.workspace, "nbytes", 0))


class _Runner:
    """Adapts a workspace to the ``jail.run(command, workdir)`` shape the task module uses."""

    def __init__(self, workspace: Any, limits: Limits) -> None:
        self.workspace = workspace
        self.limits = limits

    def run(self, command: str, workdir: object = None, *, limits: Limits | None = None) -> Any:
        return self.workspace.run(command, limits)


class CodeEngine:
    """The code sandbox's engine (``bpo.sandbox.protocol.Engine`` with native state)."""

    def __init__(
        self,
        tasks_file: str | None = None,
        workspace: str = "auto",
        swebench_file: str | None = None,
        max_steps: int = 30,
        window: int = 50,
        max_obs_chars: int = 4000,
        command_timeout: float = 30.0,
        test_timeout: float = 120.0,
        memory_mb: int = 1024,
    ) -> None:
        if swebench_file is not None:  # SWE-bench proper, in its Docker images
            from bpo.sandbox.workspace.docker import load_swebench

            self.tasks: dict[str, Any] = {t.instance_id: t for t in load_swebench(swebench_file)}
            workspace = "docker"
        else:
            self.tasks = task_index(tasks_file)
        self.workspace_kind = workspace
        self.max_steps = max_steps
        self.window = window
        self.max_obs_chars = max_obs_chars
        self.limits = Limits(
            wall_s=command_timeout, cpu_s=int(max(command_timeout, test_timeout)) + 5,
            memory_mb=memory_mb, output_bytes=max_obs_chars,
        )  # fmt: skip
        self.test_limits = Limits(
            wall_s=test_timeout, cpu_s=int(test_timeout) + 5, memory_mb=memory_mb,
            output_bytes=max(max_obs_chars, 200_000),
        )  # fmt: skip
        self._ws: Any = None
        self._ws_task: str | None = None
        self._pristine: Any = None
        self._task: Any = None
        self._view = _View()
        self._steps = 0
        self._done = False
        self._digests: dict[str, tuple[int, int, str]] = {}

    # -- episode -------------------------------------------------------------------------
    def reset(self, task: str, seed: int = 0) -> Observation:
        t = self._lookup(task)
        if self._ws_task != task:
            self._close_workspace()
            self._ws = self._open_workspace(t)
            self._pristine = self._ws.snapshot()
            self._ws_task = task
        else:
            self._ws.restore(self._pristine)
        self._task = t
        self._view = _View()
        self._steps = 0
        self._done = False
        intro = (
            f"You are in the repository {t.repo} at {WORKSPACE}. Fix the issue below so "
            f"that the project's tests pass, then submit.\n{HELP}"
        )
        return Observation(intro, instruction=t.problem_statement)

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("reset() the code engine before step()")
        if self._done:
            return self._result("The episode is over (submitted).", 0.0, True)
        self._steps += 1
        if not encodable(action):
            return self._result(UNENCODABLE, 0.0, False, self._steps >= self.max_steps)
        head, _, body = action.partition("\n")
        words = head.strip().split(maxsplit=1)
        cmd, arg = (words[0], words[1] if len(words) > 1 else "") if words else ("", "")
        reward, terminated = 0.0, False
        try:
            if cmd == "submit":
                text, reward = self._submit()
                terminated = True
            elif cmd in _TOOLS:
                text = _TOOLS[cmd](self, arg.strip(), body)
            else:
                shown = (head.strip()[:60] + "...") if len(head.strip()) > 60 else head.strip()
                text = f"Unknown command {shown!r}. {HELP}"
        except UsageError as e:
            text = f"{e} {HELP}"
        except (OSError, UnicodeError) as e:  # e.g. create under a path that is a file
            text = f"{cmd} failed: {getattr(e, 'strerror', None) or e}."
        self._done = terminated
        truncated = not terminated and self._steps >= self.max_steps
        return self._result(text, reward, terminated, truncated)

    def _result(
        self, text: str, reward: float, terminated: bool, truncated: bool = False
    ) -> StepResult:
        text = self._cut(text)
        obs = Observation(text, self._task.problem_statement, done=terminated or truncated)
        return StepResult(obs, reward, terminated, truncated, {"steps": self._steps})

    def _cut(self, text: str) -> str:
        n = self.max_obs_chars
        if len(text) <= n:
            return text
        head, tail = text[: n * 2 // 3], text[-(n // 3) :]
        return f"{head}\n[... {len(text) - len(head) - len(tail)} characters cut ...]\n{tail}"

    # -- tools ---------------------------------------------------------------------------
    def _file(self, rel: str) -> Path:
        """``rel`` (relative to the workspace, or under /workspace) as a path here; refuses
        paths that leave the workspace."""
        rel = rel.strip().strip("'\"")
        if rel.startswith(WORKSPACE + "/"):
            rel = rel[len(WORKSPACE) + 1 :]
        if not rel or rel.startswith("/") or ".." in Path(rel).parts:
            raise UsageError(f"{rel or 'an empty path'!r} is not a path inside the workspace.")
        return inside(Path(self._ws.path), rel)

    def _read(self, rel: str) -> list[str]:
        path = self._file(rel)
        if not path.is_file():
            raise UsageError(f"No file {rel!r}.")
        return path.read_bytes().decode("utf-8", "surrogateescape").splitlines(keepends=True)

    def _show(self, rel: str, top: int) -> str:
        lines = self._read(rel)
        n = len(lines)
        top = max(1, min(top, max(1, n - self.window + 1)))
        self._view = _View(rel, top)
        end = min(n, top + self.window - 1)
        out = [f"[File: {rel} ({n} lines total)]"]
        if top > 1:
            out.append(f"({top - 1} more lines above)")
        out += [f"{i}:{lines[i - 1].rstrip(chr(10))}" for i in range(top, end + 1)]
        if end < n:
            out.append(f"({n - end} more lines below)")
        return "\n".join(out)

    def _open(self, arg: str, body: str) -> str:
        parts = arg.split()
        if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
            raise UsageError("Usage: open PATH [LINE].")
        line = int(parts[1]) if len(parts) == 2 else 1
        return self._show(parts[0], line - self.window // 2 if len(parts) == 2 else 1)

    def _goto(self, arg: str, body: str) -> str:
        if self._view.path is None:
            raise UsageError("No file is open; use open PATH first.")
        if not arg.isdigit():
            raise UsageError("Usage: goto LINE.")
        return self._show(self._view.path, int(arg) - self.window // 2)

    def _scroll(self, delta: int) -> str:
        if self._view.path is None:
            raise UsageError("No file is open; use open PATH first.")
        return self._show(self._view.path, self._view.top + delta)

    def _search(self, arg: str, body: str) -> str:
        try:
            parts = shlex.split(arg)
        except ValueError:
            parts = arg.split()
        if not parts or len(parts) > 2:
            raise UsageError('Usage: search TEXT [PATH] (quote TEXT with spaces: search "a b").')
        needle = parts[0]
        start = self._file(parts[1]) if len(parts) == 2 else Path(self._ws.path)
        root = Path(self._ws.path)
        files = [start] if start.is_file() else walk_files(start)
        hits: list[str] = []
        total = 0
        for f in files:
            if f.is_symlink():  # never followed (see inside)
                continue
            try:
                text = f.read_bytes().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for i, line in enumerate(text.splitlines(), 1):
                if needle in line:
                    total += 1
                    if len(hits) < 40:
                        hits.append(f"{f.relative_to(root)}:{i}:{line.strip()[:160]}")
        if not hits:
            return f"No matches for {needle!r}."
        more = f"\n({total - len(hits)} more matches not shown)" if total > len(hits) else ""
        return f"{total} matches for {needle!r}:\n" + "\n".join(hits) + more

    def _edit(self, arg: str, body: str) -> str:
        m = _EDIT.fullmatch(arg)
        if m is None:
            raise UsageError("Usage: edit [PATH] START:END, then the new lines.")
        rel = m.group(1) or self._view.path
        if rel is None:
            raise UsageError("No file is open: name it, as in edit PATH START:END.")
        start, end = int(m.group(2)), int(m.group(3))
        lines = self._read(rel)
        if start < 1 or end < start - 1 or end > len(lines):
            raise UsageError(f"Lines {start}:{end} are not in {rel} (1 to {len(lines)}).")
        new = body_lines(body)
        text = "".join(lines[: start - 1] + new + lines[end:])
        error = syntax_error(rel, text)
        if error:
            return f"Your edit was not applied: it would make {rel} invalid Python: {error}"
        write_text(self._file(rel), text)
        return self._show(rel, start - self.window // 2)

    def _create(self, arg: str, body: str) -> str:
        if not arg or len(arg.split()) != 1:
            raise UsageError("Usage: create PATH, then the lines of the file.")
        path = self._file(arg)
        if path.is_dir():
            raise UsageError(f"{arg!r} is a directory.")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, "".join(body_lines(body)))
        return f"Created {arg} ({len(body_lines(body))} lines)."

    def _run(self, arg: str, body: str) -> str:
        command = (arg + ("\n" + body if body else "")).strip()
        if not command:
            raise UsageError("Usage: run COMMAND.")
        res = self._ws.run(command, self.limits)
        return render(res)

    def _test(self, arg: str, body: str) -> str:
        if not getattr(self._task, "test_command", ""):
            raise UsageError("This task has no test command; run the tests with run COMMAND.")
        res = self._ws.run(f"{self._task.test_command} {arg}".strip(), self.test_limits)
        return _DURATION.sub("", render(res))

    def _submit(self) -> tuple[str, float]:
        if self.workspace_kind == "docker":
            from bpo.sandbox.workspace.docker import swebench_judge

            ok = swebench_judge(self._ws, self._task)
            return ("Submitted: the tests pass." if ok else "Submitted: tests still fail."), float(
                ok
            )
        ct.restore_test_files(self._task, Path(self._ws.path))
        ok = ct.judge(_Runner(self._ws, self.test_limits), Path(self._ws.path), self._task)
        return ("Submitted: the tests pass." if ok else "Submitted: tests still fail."), float(ok)

    # -- expert ---------------------------------------------------------------------------
    def expert_action(self) -> str | None:
        """The gold patch through the tool language: ``open`` a patched file where it differs,
        one ``edit`` per differing block, then ``submit``."""
        if self._task is None or self._done or self.workspace_kind == "docker":
            return None  # SWE-bench proper: no expert in the container
        for rel, want in sorted(gold_files(self._task).items()):
            try:
                have = self._read(rel)
            except UsageError:
                return f"create {rel}\n" + "".join(want)
            if have != want:
                ops = difflib.SequenceMatcher(a=have, b=want, autojunk=False).get_opcodes()
                _, i1, i2, j1, j2 = next(op for op in ops if op[0] != "equal")
                if self._view.path != rel:  # look before editing, as a person would
                    return f"open {rel} {i1 + 1}"
                return f"edit {i1 + 1}:{i2}\n" + "".join(want[j1:j2])
        return "submit"

    # -- state ---------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """A digest of the workspace's content (paths, types, modes, bytes, link targets; not
        timestamps, which are wall-clock for files that commands write) and the tool state."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((self._ws_task, self._view, self._steps, self._done)).encode())
        root = str(self._ws.path)
        seen: dict[str, tuple[int, int, str]] = {}
        for dirpath, dirs, files in os.walk(root):
            dirs.sort()
            rel_dir = os.path.relpath(dirpath, root)
            h.update(f"D {rel_dir} {os.lstat(dirpath).st_mode:o}\n".encode())
            for name in sorted(
                files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]
            ):
                p = os.path.join(dirpath, name)
                st = os.lstat(p)
                if os.path.islink(p):
                    h.update(f"L {rel_dir}/{name} {os.readlink(p)}\n".encode())
                    continue
                key = (st.st_size, st.st_mtime_ns)
                cached = self._digests.get(p)
                if cached is not None and cached[:2] == key:
                    digest = cached[2]
                else:
                    digest = hashlib.blake2b(Path(p).read_bytes(), digest_size=16).hexdigest()
                seen[p] = (*key, digest)
                h.update(f"F {rel_dir}/{name} {st.st_mode:o} {digest}\n".encode())
        self._digests = seen
        return h.hexdigest()

    def get_state(self) -> CodeState:
        return CodeState(self._ws.snapshot(), self._view, self._steps, self._done)

    def set_state(self, state: CodeState) -> None:
        self._ws.restore(state.workspace)
        self._view, self._steps, self._done = state.view, state.steps, state.done

    def release_state(self, state: CodeState) -> None:
        """Free the workspace layers only this snapshot held."""
        if self._ws is not None:
            self._ws.release(state.workspace)

    def close(self) -> None:
        self._close_workspace()

    def _close_workspace(self) -> None:
        if self._ws is not None:
            self._ws.close()
        self._ws = self._ws_task = self._pristine = None
        self._digests = {}

    def _open_workspace(self, task: Any) -> Any:
        if self.workspace_kind == "docker":
            from bpo.sandbox.workspace.docker import DockerWorkspace

            return DockerWorkspace(task.image, self.limits)
        return open_workspace(base_for(task), self.workspace_kind, self.limits)

    def _lookup(self, task: str) -> Any:
        try:
            return self.tasks[task]
        except KeyError:
            raise ValueError(
                f"unknown code task {task!r}; `bpo check-sandbox code --list-tasks` or "
                "bpo.sandbox.envs.code_tasks.load_tasks() lists them"
            ) from None


_TOOLS = {
    "open": CodeEngine._open,
    "goto": CodeEngine._goto,
    "scroll_down": lambda self, arg, body: self._scroll(self.window),
    "scroll_up": lambda self, arg, body: self._scroll(-self.window),
    "search": CodeEngine._search,
    "edit": CodeEngine._edit,
    "create": CodeEngine._create,
    "run": CodeEngine._run,
    "test": CodeEngine._test,
}


# -- registration ----------------------------------------------------------------------------
def make(*, backend: str = "auto", **options: Any) -> Sandbox:
    """A code sandbox; ``options`` go to :class:`CodeEngine`. Snapshots are native (the
    workspace's layers): the fork backend would share one workspace between forks."""
    from bpo.sandbox import make_sandbox

    if backend not in ("auto", "native", "replay"):
        raise ValueError(
            f"the code sandbox supports backends auto, native and replay, not {backend!r}: "
            "its state is a workspace on disk, which fork and pickle snapshots do not copy"
        )
    return make_sandbox(functools.partial(CodeEngine, **options), backend=backend)


def tasks(
    split: str = "train",
    tasks_file: str | None = None,
    swebench_file: str | None = None,
    **_: Any,
) -> Sequence[str]:
    """Instance ids of ``split`` ("train" or "test"; a SWE-bench file is all "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"code tasks have splits 'train' and 'test', not {split!r}")
    if swebench_file is not None:
        from bpo.sandbox.workspace.docker import load_swebench

        return [t.instance_id for t in load_swebench(swebench_file) if t.split == split]
    return [i for i, t in sorted(task_index(tasks_file).items()) if t.split == split]


ENVS.register("code")(
    EnvSpec(
        name="code",
        make=make,
        tasks=tasks,
        description="SWE-style repair of real PyPI projects with injected bugs; bubblewrap-isolated "
        "commands; overlayfs (or tar+zstd) workspace snapshots",
    )
)
