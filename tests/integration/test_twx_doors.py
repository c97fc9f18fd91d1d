"""``scripts/twx_doors.py`` (the README's split of held-out success by door games) on a run
directory it reads like a real one: the game's own expert decides which games need a door."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_splits_success_by_whether_the_gold_path_opens_a_door(tmp_path: Path) -> None:
    # coin seeds 0 and 2 (3 rooms) have a closed door on the expert's way; seed 1 does not
    before = {f"coin/seed={s}/numLocations=3": v for s, v in ((0, 0.0), (1, 0.5), (2, 0.5))}
    after = {f"coin/seed={s}/numLocations=3": v for s, v in ((0, 0.5), (1, 1.0), (2, 1.0))}
    run = tmp_path / "run"
    run.mkdir()
    summary = {"eval_before": {"per_task": before}, "eval_after": {"per_task": after}}
    (run / "summary.json").write_text(json.dumps(summary))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "twx_doors.py"), str(run)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"| {run} | 1, 0.500 -> 1.000 | 2, 0.250 -> 0.750 |" in proc.stdout

    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "twx_doors.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "no summary.json" in proc.stderr
