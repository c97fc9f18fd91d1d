"""``bpo train`` and ``bpo compare`` on the code and web sandboxes at a tiny scale, through
the real command line: they complete and write their run directories; the code sandbox leaves
no workspace server, layer directory or cgroup behind, the web sandbox no shop server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bpo.sandbox.workspace import overlay_supported

ROOT = Path(__file__).resolve().parents[2]


def _bpo(command: str, config: str, *args: str) -> subprocess.CompletedProcess:
    """``bpo COMMAND --config configs/CONFIG ARGS`` in a subprocess; asserts it succeeded."""
    cmd = [sys.executable, "-m", "bpo.cli", command, "--config", str(ROOT / "configs" / config),
           *args]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=1200,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _bpo_leftovers() -> set[str]:
    tmp = Path("/tmp")
    dirs = {str(p) for p in tmp.glob("bw*") if p.is_dir()} | {str(p) for p in tmp.glob("bpo-ws-*")}
    cgroups = (
        {str(p) for p in Path("/sys/fs/cgroup").rglob("bpo-jail-*")}
        if overlay_supported()
        else set()
    )
    return dirs | cgroups


@pytest.mark.slow
def test_bpo_train_on_code_tasks(tmp_path: Path) -> None:
    before = _bpo_leftovers()
    out = tmp_path / "run"
    proc = _bpo(
        "train", "code.yaml", "--out", str(out), "run.iterations=1",
        "sandbox.num_train_tasks=6", "sandbox.num_eval_tasks=2", "sft.epochs=2",
    )  # fmt: skip
    assert "held-out success: before" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert row["compute/sandbox_steps"] > 0 and row["compute/snapshots"] > 0
    assert row["snapshot/live_after_tree"] == 0
    assert (out / "checkpoints" / "iter-000001").is_dir()
    trees = [json.loads(line) for line in (out / "trees.jsonl").read_text().splitlines()]
    assert trees, "no sampled trees recorded"
    assert _bpo_leftovers() <= before, "workspace layers, servers or cgroups left behind"


@pytest.mark.slow
def test_bpo_compare_on_code_tasks(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    _bpo(
        "compare", "code.yaml", "--quick", "--methods", "bpo,grpo", "--seeds", "2",
        "--variance-batches", "0", "--out", str(out), "run.iterations=1",
        "sandbox.num_train_tasks=4", "sandbox.num_eval_tasks=2", "sft.epochs=1",
    )  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["curves"]) == {"bpo", "grpo"} and "ratios" in summary


@pytest.mark.slow
def test_bpo_train_and_compare_on_web_tasks(tmp_path: Path) -> None:
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    small = ["run.iterations=1", "sandbox.num_train_tasks=6", "sandbox.num_eval_tasks=2",
             "sft.epochs=2", "run.tasks_per_iteration=4"]  # fmt: skip
    _bpo("train", "web.yaml", "--out", str(tmp_path / "run"), *small)
    _bpo("compare", "web.yaml", "--quick", "--methods", "bpo,grpo", "--seeds", "2",
         "--variance-batches", "0", "--out", str(tmp_path / "cmp"), *small)  # fmt: skip
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and json.loads(rows[0])["compute/sandbox_steps"] > 0
    assert "ratios" in json.loads((tmp_path / "cmp" / "summary.json").read_text())
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, f"processes left behind: {left}"
