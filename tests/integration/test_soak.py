"""Fault-injection soak of ``bpo train`` (the toy game, a tiny model): sandbox steps that raise,
return malformed results or hang, restores that fail and sandboxes that die, at 5% per call.
The run completes every iteration, counts what was injected and what it cost, leaks no
snapshot, and ends within noise of the fault-free run with the same seed (20 held-out tasks:
a standard error of up to 0.11 per run, so differences up to 0.3 are noise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bpo.sandbox.faults import soak_overrides

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
ARGS = [
    "--config", "configs/toy.yaml", "run.iterations=4", "run.tasks_per_iteration=4",
    "sandbox.num_train_tasks=8", "sft.epochs=2", "budget.amount=150", "run.max_steps=6",
    "run.log_trees=1",
]  # fmt: skip
FAULTS = soak_overrides(0.05)


@pytest.mark.slow
def test_bpo_train_survives_injected_faults(tmp_path: Path) -> None:
    runs = {}
    procs = {}
    for name, extra in (("clean", []), ("faulty", FAULTS)):
        cmd = [sys.executable, "-m", "bpo.cli", "train", "--out", str(tmp_path / name), *ARGS]
        procs[name] = subprocess.Popen(
            [*cmd, *extra], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name}: {out[-3000:]}"
        rows = [
            json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().split("\n") if x
        ]
        runs[name] = (rows, json.loads((tmp_path / name / "summary.json").read_text()))
    rows, summary = runs["faulty"]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    last = rows[-1]
    injected = {k: v for k, v in last.items() if k.startswith("faults/injected_")}
    assert sum(injected.values()) >= 5, injected
    assert sum(r["rollout/retries"] for r in rows) > 0
    assert all(r["snapshot/live_after_tree"] == 0 for r in rows)
    clean_rows, clean = runs["clean"]
    assert all(r["rollout/retries"] == 0 for r in clean_rows)
    before = summary["eval_before"]["success"]
    assert before == clean["eval_before"]["success"], "faults never touch the warm start"
    assert abs(summary["eval_after"]["success"] - clean["eval_after"]["success"]) <= 0.3
