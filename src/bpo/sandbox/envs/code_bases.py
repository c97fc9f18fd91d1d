"""The code sandbox's task data (:mod:`bpo.sandbox.envs.code`): the task index, each task's
prepared buggy checkout (built once, cached on disk, never modified) and the files as the gold
patch leaves them."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bpo.sandbox.envs import code_tasks as ct

__all__ = ["base_for", "gold_files", "task_index"]


@functools.lru_cache(maxsize=8)
def _index(path: str) -> dict[str, Any]:
    return {t.instance_id: t for t in ct.load_tasks(path)}


def task_index(tasks_file: str | None = None) -> dict[str, Any]:
    """instance id -> task, from ``tasks_file`` (default: the shipped set)."""
    return _index(str(Path(tasks_file or ct.TASKS_FILE).resolve()))


def _cache_root() -> Path:
    root = Path(os.environ.get("BPO_CODE_CACHE", Path(tempfile.gettempdir()) / "bpo-code-bases"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def base_for(task: Any) -> Path:
    """The task's prepared buggy checkout (cached on disk by instance id and base commit;
    built atomically, so concurrent builders do not see a half-built one). Never modified:
    workspaces start from a copy or an overlay of it."""
    dest = _cache_root() / f"{task.instance_id}-{task.base_commit[:12]}"
    if dest.is_dir():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=dest.parent))
    try:
        ct.prepare_workspace(task, tmp / "w")
        try:
            os.rename(tmp / "w", dest)
        except OSError:  # another process built it first
            if not dest.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


@functools.lru_cache(maxsize=256)
def _gold_cached(instance_id: str, base: str, patch: str) -> dict[str, tuple[str, ...]]:
    with tempfile.TemporaryDirectory(prefix="bpo-gold-") as tmp:
        work = Path(tmp) / "w"
        subprocess.run(["cp", "-a", base, str(work)], check=True)
        done = subprocess.run(
            ["git", "apply", "--numstat", "--apply", "-"], input=patch, text=True,
            cwd=work, capture_output=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise ValueError(f"the gold patch of {instance_id} does not apply: {done.stderr}")
        files = [line.split("\t", 2)[2] for line in done.stdout.splitlines() if line.strip()]
        return {
            rel: tuple(
                (work / rel).read_bytes().decode("utf-8", "surrogateescape").splitlines(True)
            )
            for rel in files
            if (work / rel).exists()
        }


def gold_files(task: Any) -> dict[str, list[str]]:
    """Files the gold patch changes -> their lines after it."""
    cached = _gold_cached(task.instance_id, str(base_for(task)), task.patch)
    return {rel: list(lines) for rel, lines in cached.items()}
