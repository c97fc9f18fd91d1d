"""`bpo compare --quick` end to end: every method trained from one shared warm start per seed,
summary.json with per-method curves, confidence intervals, the variance study and ratios."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_compare_quick_writes_summary_with_curves_and_ratios(tmp_path):
    out = tmp_path / "cmp"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(
        [sys.executable, "-m", "bpo.cli", "compare", "--quick", "--seeds", "2",
         "--variance-batches", "2", "--jobs", "2", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    methods = ["bpo", "grpo", "rloo", "gigpo", "ppo"]
    assert list(summary["methods"]) == methods
    for m in methods:
        r = summary["methods"][m]
        assert len(r["final_success"]["per_seed"]) == 2
        assert 0.0 <= r["final_success"]["mean"] <= 1.0
        assert r["final_success"]["ci95"] >= 0.0
        assert len(summary["curves"][m]) == 2  # one curve per seed
        assert all(len(rows) == 2 for rows in summary["curves"][m])  # two iterations each
        assert r["generated_tokens"] > 0
    assert summary["ratios"]["best_baseline"] in methods[1:]
    for key in ("success", "grad_norm_var", "updates_to_match", "generated_tokens"):
        assert key in summary["ratios"]
    # two runs at once, each in its own process writing its own log; the warm start's
    # held-out score is computed once per seed and is every method's score before RL
    assert "finished bpo seed 1" in proc.stdout
    for s in (0, 1):
        before = json.loads((out / f"sft-seed{s}" / "eval_before.json").read_text())
        for m in methods:
            run = out / m / f"seed{s}"
            assert json.loads((run / "summary.json").read_text())["eval_before"] == before
            assert "[iter 2/2]" in (run / "log.txt").read_text()
    study = summary["variance_study"]
    assert set(study) == set(methods)
    for m in methods:  # each method's part of the study is its own job, saved for a rerun
        assert f"finished variance {m}" in proc.stdout
        assert (out / "variance" / f"{m}.npz").stat().st_size > 0
    assert all(s["batches"] == 2 for s in study.values())
    report = (out / "report.md").read_text()
    assert "held-out success" in report and "Estimator variance" in report
    assert (out / "success_vs_updates.png").stat().st_size > 1000
