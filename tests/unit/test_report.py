"""Run reports: series extraction, mean and 95% bands over seeds (hand-computed), the figures
and report.md of a run directory, and ``bpo report``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from bpo.cli import main as cli_main
from bpo.metrics import MetricsLogger, tree_metrics
from bpo.report import (
    draw_curves,
    held_out_rows,
    load_run,
    mean_ci,
    plot_curves,
    series,
    write_run_report,
)
from bpo.rollout.budget import Compute
from bpo.tree import Tree, Turn

ROWS = [
    {"iteration": 1, "compute/generated_tokens": 10.0, "rollout/success": 0.5},
    {"iteration": 2, "compute/generated_tokens": 20.0},
    {"iteration": 3, "compute/generated_tokens": 5.0, "rollout/success": 1.0, "eval/success": math.nan},
]  # fmt: skip


def test_series_sums_counters_over_iterations_and_skips_missing_values():
    x, y = series(ROWS, "compute/generated_tokens", "rollout/success")
    assert x.tolist() == [10.0, 35.0] and y.tolist() == [0.5, 1.0]
    x, _ = series(ROWS, "compute/generated_tokens", "rollout/success", cumulative=False)
    assert x.tolist() == [10.0, 5.0]
    x, y = series(ROWS, "iteration", "rollout/success")
    assert x.tolist() == [1.0, 3.0]
    assert series(ROWS, "iteration", "eval/success")[0].tolist() == []  # NaN is not a value


def test_mean_ci_is_the_student_t_interval_over_runs():
    a = (np.array([1.0, 2.0]), np.array([0.0, 1.0]))
    b = (np.array([1.0, 2.0]), np.array([1.0, 1.0]))
    x, mean, lo, hi = mean_ci([a, b])
    # n=2: t(0.975, 1) = 12.7062; sd = [0.7071, 0]; half = 12.7062 * 0.7071 / sqrt(2)
    assert x.tolist() == [1.0, 2.0]
    assert mean.tolist() == [0.5, 1.0]
    assert lo.tolist() == pytest.approx([0.5 - 6.35310, 1.0], abs=1e-4)
    assert hi.tolist() == pytest.approx([0.5 + 6.35310, 1.0], abs=1e-4)
    c = (np.array([1.0, 2.0]), np.array([2.0, 1.0]))
    _, mean, lo, _ = mean_ci([a, b, c])
    # n=3 at x=1: y = 0, 1, 2; sd = 1; half = t(0.975, 2) / sqrt(3) = 4.30265 / 1.73205
    assert mean[0] == pytest.approx(1.0) and lo[0] == pytest.approx(1.0 - 2.48414, abs=1e-4)


def test_mean_ci_interpolates_runs_logged_at_different_x():
    a = (np.array([0.0, 10.0]), np.array([0.0, 1.0]))
    b = (np.array([0.0, 20.0]), np.array([1.0, 1.0]))
    x, mean, _, _ = mean_ci([a, b], points=3)
    assert x.tolist() == [0.0, 5.0, 10.0]  # the range both runs cover
    assert mean.tolist() == pytest.approx([0.5, 0.75, 1.0])
    x, mean, lo, hi = mean_ci([a])
    assert lo.tolist() == hi.tolist() == mean.tolist() == [0.0, 1.0]
    assert len(mean_ci([])[0]) == 0


def test_curves_draw_one_line_per_method_and_a_band_when_there_are_several_runs(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    seeds = [[{"iteration": i, "rollout/success": s * 0.1 + i * 0.2} for i in (1, 2, 3)]
             for s in range(3)]  # fmt: skip
    runs = {"bpo": seeds, "rloo": seeds[:1]}
    fig, ax = plt.subplots()
    assert draw_curves(ax, runs, "iteration", "rollout/success") == 2
    assert [line.get_label() for line in ax.lines] == ["bpo (n=3)", "rloo"]
    assert ax.lines[0].get_ydata().tolist() == pytest.approx([0.3, 0.5, 0.7])
    assert len(ax.collections) == 1  # the band of the 3-seed method only
    plt.close(fig)
    path = plot_curves(runs, "iteration", "rollout/success", tmp_path / "c.png")
    with Image.open(path) as img:
        assert img.size == (640, 400)


def _turn(reward: float, done: bool) -> Turn:
    return Turn((1, 2), (-0.5, -0.5), (1.0, 1.0), "go", reward, terminated=done)


def _tree(win: bool) -> Tree:
    t = Tree("t")
    t.add_root([1], "start")
    a = t.add_child(0, _turn(0.0, False), [2], "hall")
    t.add_child(a, _turn(1.0 if win else 0.0, True), [3], "end")
    t.add_child(a, _turn(0.0, True), [3], "end")
    t.nodes[a].entropy = 1.0
    t.meta["compute"] = Compute(generated_tokens=6, sandbox_steps=3, wall_seconds=1.5)
    return t


def make_run(run_dir: Path, finished: bool = True) -> None:
    run_dir.mkdir()
    cfg = {"sandbox": {"name": "toy"}, "estimator": {"name": "bpo"},
           "tree": {"rule": "entropy_quantile", "k": 3, "root_width": 2},
           "budget": {"unit": "tokens", "amount": 400.0}}  # fmt: skip
    (run_dir / "config.yaml").write_text(json.dumps(cfg))
    log = MetricsLogger(run_dir, tensorboard=False)
    for it in (1, 2, 3):
        extra = {"learner/grad_norm": 2.0 / it, "loss/pg": 0.1, "time/iteration_s": 4.0}
        if it == 2:
            extra["eval/success"] = 0.2
        log.log(it, {**tree_metrics([_tree(win=it > 1), _tree(win=True)]), **extra})
    log.close()
    if finished:
        summary = {"eval_before": {"success": 0.1}, "eval_after": {"success": 0.35},
                   "iterations": 3, "policy_updates": 6}  # fmt: skip
        (run_dir / "summary.json").write_text(json.dumps(summary))


def test_held_out_curve_runs_from_the_score_before_rl_to_the_final_one(tmp_path):
    make_run(tmp_path / "run")
    rows = held_out_rows(load_run(tmp_path / "run"))
    assert series(rows, "iteration", "eval/success")[0].tolist() == [0.0, 2.0, 3.0]
    assert series(rows, "iteration", "eval/success")[1].tolist() == [0.1, 0.2, 0.35]
    x, _ = series(rows, "compute/generated_tokens", "eval/success")
    assert x.tolist() == [0.0, 24.0, 36.0]  # two trees of 6 tokens per iteration


def test_write_run_report_draws_every_figure_and_the_summary(tmp_path):
    from PIL import Image

    make_run(tmp_path / "run")
    path = write_run_report(tmp_path / "run")
    text = path.read_text()
    assert path == tmp_path / "run" / "report.md"
    assert "budget 400 tokens per task" in text
    assert "| held-out success before RL | 0.100 |" in text
    assert "| held-out success after RL | 0.350 (+0.250) |" in text
    assert "| policy updates | 6 |" in text
    assert "| generated tokens | 36 |" in text
    assert "| train leaf success (last iteration) | 0.500 |" in text  # 2 of 4 leaves win
    # the winning leaf is each tree's first-child path: both episodes win
    assert "| train episode success (last iteration) | 1 |" in text
    images = [
        line.split("](")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")
    ]
    assert len(images) == 7
    for rel in images:
        with Image.open(tmp_path / "run" / rel) as img:
            pixels = np.asarray(img.convert("RGB")).reshape(-1, 3)
            assert len(np.unique(pixels, axis=0)) > 50, f"{rel} looks blank"
    assert "not finished" not in text


def test_report_of_an_unfinished_run_says_so(tmp_path):
    make_run(tmp_path / "run", finished=False)
    text = write_run_report(tmp_path / "run").read_text()
    assert "**The run has not finished**" in text
    assert "| held-out success before RL | n/a |" in text


def test_bpo_report_command(tmp_path, capsys):
    make_run(tmp_path / "run")
    assert cli_main(["report", str(tmp_path / "run")]) == 0
    assert str(tmp_path / "run" / "report.md") in capsys.readouterr().out
    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    assert "not a bpo run directory" in capsys.readouterr().out
