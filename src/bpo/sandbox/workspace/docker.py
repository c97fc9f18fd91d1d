"""SWE-bench proper: instances loaded from a local file, run in their official Docker images,
with container snapshots (``docker commit``).

:func:`load_swebench` reads SWE-bench instances (the Hugging Face dataset's rows: JSON list,
JSON lines or parquet) into :class:`SweBenchTask`. :class:`DockerWorkspace` is a workspace whose
state is a container: ``snapshot`` commits it to an image, ``restore`` replaces the container by
a new one from that image, ``release`` removes the image. Files are read and written through the
container's root filesystem on the host (overlay2's ``MergedDir``; needs root, as Docker itself
does), so the code sandbox's tools work unchanged; commands run through ``docker exec`` in the
container started with ``--network none`` and memory, CPU and process limits. Grading uses the
official harness (the ``swebench`` package: its test spec's eval script and log parser), so the
verdict is SWE-bench's own.

Nothing here runs without a Docker engine and the instance's image; on this project's CI
machine there is neither (no registry is reachable), and the test skips, saying so.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bpo.sandbox.envs.code_tasks import SweInstance
from bpo.sandbox.workspace.jail import CommandResult, Limits
from bpo.sandbox.workspace.overlay import WorkspaceError

_KEYS = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch")


@dataclass(frozen=True)
class SweBenchTask(SweInstance):
    """One SWE-bench instance (test lists as tuples) and its dataset row."""

    split: str = "test"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def image(self) -> str:
        """The official evaluation image (SWE-bench's naming on Docker Hub)."""
        return f"swebench/sweb.eval.x86_64.{self.instance_id.replace('__', '_1776_')}:latest"


def load_swebench(path: str | Path) -> list[SweBenchTask]:
    """SWE-bench instances from a local ``.json`` (list), ``.jsonl`` or ``.parquet`` file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"no SWE-bench file at {str(p)!r}; export the dataset's rows to JSON lines or parquet"
        )
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq  # pyarrow ships with the `all` extra (via datasets)

        rows = pq.read_table(p).to_pylist()
    elif p.suffix == ".jsonl":
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    else:
        rows = json.loads(p.read_text())
    tasks = []
    for i, row in enumerate(rows):
        missing = [k for k in (*_KEYS, "FAIL_TO_PASS", "PASS_TO_PASS") if k not in row]
        if missing:
            raise ValueError(f"{p}: row {i} lacks SWE-bench keys {missing}")

        def tests(v: Any) -> tuple[str, ...]:  # the dataset stores these lists as JSON text
            return tuple(json.loads(v) if isinstance(v, str) else v)

        tasks.append(SweBenchTask(
            **{k: row[k] for k in _KEYS}, FAIL_TO_PASS=tests(row["FAIL_TO_PASS"]),
            PASS_TO_PASS=tests(row["PASS_TO_PASS"]), version=str(row.get("version", "")),
            raw=dict(row),
        ))  # fmt: skip
    return tasks


def docker_available() -> str | None:
    """None when a Docker engine answers, else why not (for skip messages and errors)."""
    if shutil.which("docker") is None:
        return "the docker CLI is not installed"
    done = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    if done.returncode != 0:
        return f"no Docker engine answers ({done.stderr.strip()[:200]})"
    return None


class DockerWorkspace:
    """A SWE-bench instance's container as a workspace (see the module docstring)."""

    kind = "docker"
    _serial = itertools.count()

    def __init__(self, image: str, limits: Limits | None = None, workdir: str = "/testbed") -> None:
        why = docker_available()
        if why is not None:
            raise WorkspaceError(f"the docker workspace needs a Docker engine: {why}")
        self.limits = limits or Limits()
        self.workdir = workdir
        self._images: set[str] = set()
        self._container = ""
        self._start(image)

    @property
    def path(self) -> Path:
        merged = _docker("inspect", "-f", "{{.GraphDriver.Data.MergedDir}}", self._container)
        return Path(merged.strip() + self.workdir)

    def _start(self, image: str) -> None:
        lim = self.limits
        self._container = _docker(
            "run", "-d", "--network", "none", f"--memory={lim.memory_mb}m",
            f"--pids-limit={lim.pids}", "--cpus=1", image, "sleep", "infinity",
        ).strip()  # fmt: skip

    def run(self, command: str, limits: Limits | None = None) -> CommandResult:
        lim = limits or self.limits
        argv = ["docker", "exec", "-w", self.workdir, self._container, "bash", "-c", command]
        try:
            done = subprocess.run(argv, capture_output=True, timeout=lim.wall_s)
        except subprocess.TimeoutExpired as e:
            _docker("restart", "-t", "0", self._container)  # stops what the command left
            out = (e.stdout or b"")[: lim.output_bytes].decode(errors="replace")
            return CommandResult(-9, out, False, True, lim.wall_s, "wall")
        data = done.stdout + done.stderr
        out = data[: lim.output_bytes].decode(errors="replace")
        return CommandResult(done.returncode, out, len(data) > lim.output_bytes, False, 0.0)

    def snapshot(self) -> str:
        tag = f"bpo-snap:{self._container[:12]}-{next(self._serial)}"
        _docker("commit", self._container, tag)
        self._images.add(tag)
        return tag

    def restore(self, state: str) -> None:
        if state not in self._images:
            raise WorkspaceError("the snapshot was released")
        _docker("rm", "-f", self._container)
        self._start(state)

    def release(self, state: str) -> None:
        self._images.discard(state)
        _docker("rmi", "-f", state)

    def info(self) -> dict[str, Any]:
        return {"layers": len(self._images), "live_refs": len(self._images)}

    def close(self) -> None:
        if self._container:
            subprocess.run(["docker", "rm", "-f", self._container], capture_output=True)
            self._container = ""
        for tag in list(self._images):
            subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)
        self._images.clear()


def swebench_judge(workspace: DockerWorkspace, task: SweBenchTask) -> bool:
    """SWE-bench's verdict: the official test spec's eval script (it applies the test patch
    and runs the instance's tests) and the official log grading; resolved when the harness
    says RESOLVED_FULL. Works with the harness's 3.x-4.x layout and its 5.x layout."""
    try:
        from swebench.harness.constants import ResolvedStatus
        from swebench.harness.grading import (
            get_eval_tests_report,
            get_logs_eval,
            get_resolution_status,
        )
    except ImportError as e:
        raise WorkspaceError(
            "grading SWE-bench instances needs the official harness: pip install 'bpo[swebench]'"
        ) from e
    try:
        from swebench.harness.utils import make_test_spec  # 5.x
    except ImportError:
        from swebench.harness.test_spec.test_spec import make_test_spec  # 3.x-4.x
    spec = make_test_spec(task.raw)
    script = getattr(spec, "eval_script", None) or "\n".join(spec.eval_script_list)
    res = workspace.run(script, Limits(wall_s=1800, output_bytes=50_000_000))
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as log:
        log.write(res.output)
    try:
        status, ok = get_logs_eval(spec, log.name)
    finally:
        os.unlink(log.name)
    if not ok:
        return False
    gold = {"FAIL_TO_PASS": list(task.FAIL_TO_PASS), "PASS_TO_PASS": list(task.PASS_TO_PASS)}
    report = get_eval_tests_report(status, gold)
    return get_resolution_status(report) == ResolvedStatus.FULL.value


def _docker(*args: str) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise WorkspaceError(f"docker {args[0]} failed: {done.stderr.strip()[:500]}")
    return done.stdout
