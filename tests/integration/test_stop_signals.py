"""Stopping runs from outside: SIGTERM (a job scheduler's warning, ``kill``) stops ``bpo train``
as Ctrl-C does (the iteration in flight finishes, a checkpoint, exit 0); ``bpo compare`` passes
it on to its runs; and runs whose ``bpo compare`` was killed outright (SIGKILL) stop the same
way instead of running on as orphans that a rerun of the compare would race."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
SMALL = [
    "run.tasks_per_iteration=2", "sandbox.num_train_tasks=4", "sandbox.num_eval_tasks=2",
    "sft.epochs=1", "budget.amount=60", "run.max_steps=4",
]  # fmt: skip


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                kids.append(int(d.name))
    return kids


def _alive(pid: int) -> bool:
    """Running (a zombie has finished: the container's init may never reap it)."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]) != "Z"
    except OSError:
        return False


def _wait_for(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not in {path} after {timeout:g} s")


@pytest.mark.slow
def test_sigterm_stops_bpo_train_with_a_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "bpo.cli", "train", "--config", "configs/toy.yaml",
           "--out", str(run), "run.iterations=20", *SMALL]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("[iter 1/20]"):
            proc.send_signal(signal.SIGTERM)
    out = "".join(seen)
    assert proc.wait(timeout=120) == 0, out
    assert "send SIGTERM again to stop at once" in out, out
    assert f"continue with: bpo train --resume {run}" in out, out
    assert not (run / "summary.json").exists()
    assert sorted(p.name for p in (run / "checkpoints").glob("iter-*"))[-1] in (
        "iter-000001", "iter-000002",
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compare_runs_stop_with_their_compare(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "bpo.cli", "compare", "--config", "configs/toy.yaml",
           "--methods", "bpo,grpo", "--seeds", "1", "--jobs", "2", "--variance-batches", "0",
           "--out", str(out), "run.iterations=40", *SMALL]  # fmt: skip
    logs = [out / m / "seed0" / "log.txt" for m in ("bpo", "grpo")]

    # 1. SIGTERM to bpo compare: passed on, both runs checkpoint and stop, compare says so
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    for log in logs:
        _wait_for(log, "[iter 1/40]", 300)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, stdout
    assert "interrupted; run the same command to continue" in stdout, stdout
    for log in logs:
        assert "[interrupted] checkpoint saved at iteration" in log.read_text(), log

    # 2. the same command continues; then bpo compare is killed outright: its runs get
    # SIGTERM from the kernel, checkpoint and stop
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    for log in logs:
        _wait_for(log, "[resume] from iter-", 300)
    before = [log.read_text().count("[interrupted]") for log in logs]
    workers = [pid for pid in _children(proc.pid) if _alive(pid)]
    assert len(workers) >= 2, workers
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 180
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in workers if _alive(pid)], "runs outlived their compare"
    for log, n in zip(logs, before, strict=True):
        assert log.read_text().count("[interrupted]") == n + 1, log.read_text()[-2000:]
