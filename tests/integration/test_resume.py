"""``bpo train --resume`` reproduces the uninterrupted run exactly (CPU, same seed).

One run goes straight through; a second run with the same config is stopped twice: Ctrl-C
(SIGINT) after its first iteration (it must finish the iteration in flight, save a checkpoint,
say how to resume and exit 0), then, once resumed, SIGKILL right after its next checkpoint,
while the following iteration is in flight. What a crash between logging and checkpointing
leaves behind (a metrics row and a tree of the lost iteration, lines cut in the middle, an
unfinished checkpoint directory) is added before the final resume. The resumed run must log the
same metrics (timings aside) and the same sampled trees, and end with the same weights and
optimizer state.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

BPO = [sys.executable, "-m", "bpo.cli", "train"]
ARGS = [
    "--config", "configs/toy.yaml",
    "run.iterations=4", "run.tasks_per_iteration=2", "sandbox.num_train_tasks=4",
    "sandbox.num_eval_tasks=2", "sft.epochs=1", "budget.amount=100", "run.max_steps=5",
    # an entropy bonus and a large step: every update changes the weights and later samples,
    # even when every return is 0 (a tiny model rarely succeeds), so a missed RNG stream or
    # a stale state shows up in the numbers
    "learner.entropy_coef=0.01", "learner.lr=0.001",
    # the KL reference (the warm-started policy) must come back from the kept iteration-0
    # checkpoint, and the warm-up and the decay from the update count
    "learner.kl_coef=0.05", "learner.warmup_updates=3", "learner.lr_schedule=cosine",
]  # fmt: skip
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
ROOT = Path(__file__).resolve().parents[2]


def _timing(key: str) -> bool:
    return (
        key.startswith("time/")
        or key.endswith("_seconds")
        or key in ("learner/seconds", "snapshot/time_frac")
    )


def _same(a: Any, b: Any, where: str) -> None:
    """Equal JSON values: integral numbers exactly, other floats to 1e-6."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and not float(a).is_integer():
        assert isinstance(b, (int, float)), f"{where}: {a!r} vs {b!r}"
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6), f"{where}: {a!r} vs {b!r}"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _rows(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not _timing(k)} for r in rows]


def _trees(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "trees.jsonl").read_text().splitlines()]


def _until(cmd: list[str], marker: str, sig: int) -> tuple[int, str, str]:
    """Run ``cmd``, send ``sig`` when a stdout line starts with ``marker``; returns the exit
    code, that line and the whole output."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen, hit = [], ""
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if not hit and line.startswith(marker):
            hit = line
            proc.send_signal(sig)
    rc = proc.wait(timeout=300)
    return rc, hit, "".join(seen)


def _latest(run: Path) -> str:
    return max(p.name for p in (run / "checkpoints").glob("iter-*") if ".tmp" not in p.name)


@pytest.mark.slow
def test_resume_after_sigint_and_sigkill_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    # the uninterrupted run, in the background while the other one is stopped and resumed
    straight = subprocess.Popen(
        [*BPO, "--out", str(a), *ARGS], cwd=ROOT, env=ENV,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip

    # 1. Ctrl-C during iteration 2 (or just before it starts): a checkpoint, a clear line, 0
    rc, _, out = _until([*BPO, "--out", str(b), *ARGS], "[iter 1/4]", signal.SIGINT)
    assert rc == 0, out
    stopped = int(_latest(b)[len("iter-") :])
    assert stopped in (1, 2), out
    assert (
        f"[interrupted] checkpoint saved at iteration {stopped}/4; continue with: "
        f"bpo train --resume {b}" in out
    ), out
    assert not (b / "summary.json").exists(), "an interrupted run is not finished"
    assert [r["iteration"] for r in _rows(b)] == list(range(1, stopped + 1))

    # 2. resumed, then killed right after its next checkpoint, with the next iteration in flight
    rc, line, out = _until([*BPO, "--resume", str(b)], "[iter ", signal.SIGKILL)
    assert rc == -signal.SIGKILL, out
    assert f"[resume] from iter-{stopped:06d}" in out, out
    killed = stopped + 1
    assert line.startswith(f"[iter {killed}/4]"), out
    assert _latest(b) == f"iter-{killed:06d}", "killed after this checkpoint, before the next"
    # what a crash between logging iteration killed + 1 and its checkpoint leaves behind
    lost = {"iteration": killed + 1, "rollout/success": 7.0}
    with open(b / "metrics.jsonl", "a") as f:
        f.write(json.dumps(lost) + '\n{"iteration": ')
    with open(b / "trees.jsonl", "a") as f:
        f.write(json.dumps({**_trees(b)[-1], "iteration": killed + 1}) + '\n{"task": "keyd')
    partial = b / "checkpoints" / f"iter-{killed + 1:06d}.tmp-12345"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"cut")

    # 3. resumed to the end
    done = subprocess.run(
        [*BPO, "--resume", str(b)], cwd=ROOT, env=ENV, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"[resume] from iter-{killed:06d} (iteration {killed})" in done.stdout
    out_a, _ = straight.communicate(timeout=300)
    assert straight.returncode == 0, out_a

    rows_a, rows_b = _rows(a), _rows(b)
    assert [r["iteration"] for r in rows_b] == [1, 2, 3, 4]
    assert all(r["learner/grad_norm"] > 0 for r in rows_a), "updates must change the weights"
    assert all(r["loss/kl"] > 0 for r in rows_a[1:]), "the policy moved away from the reference"
    for ra, rb in zip(rows_a, rows_b, strict=True):
        _same(ra, rb, f"metrics.jsonl iteration {ra['iteration']}")
    trees_a, trees_b = _trees(a), _trees(b)
    assert [t["iteration"] for t in trees_b] == [t["iteration"] for t in trees_a]
    _same(trees_a, trees_b, "trees.jsonl")
    _same(
        json.loads((a / "summary.json").read_text()),
        json.loads((b / "summary.json").read_text()),
        "summary.json",
    )
    wa = load_file(str(a / "checkpoints/iter-000004/model.safetensors"))
    wb = load_file(str(b / "checkpoints/iter-000004/model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "final weights differ"
    oa = torch.load(a / "checkpoints/iter-000004/optimizer.pt", weights_only=False)["state"]
    ob = torch.load(b / "checkpoints/iter-000004/optimizer.pt", weights_only=False)["state"]
    assert oa.keys() == ob.keys()
    for k in oa:
        assert all(torch.equal(oa[k][n], ob[k][n]) for n in oa[k]), f"optimizer state {k}"


@pytest.mark.slow
def test_sigkill_at_any_moment_then_resume_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    """SIGKILL at moments spread over a whole run (during the warm start, the rollouts, the
    update, a checkpoint write or the final evaluation, wherever they fall), then ``--resume``:
    each resumed run ends with the uninterrupted run's metrics, trees and weights."""
    ref = tmp_path / "ref"
    t0 = time.perf_counter()
    done = subprocess.run([*BPO, "--out", str(ref), *ARGS], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    wall = time.perf_counter() - t0
    assert done.returncode == 0, done.stdout + done.stderr
    for frac in (0.3, 0.55, 0.8):
        run = tmp_path / f"kill-{frac}"
        proc = subprocess.Popen([*BPO, "--out", str(run), *ARGS], cwd=ROOT, env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            proc.wait(timeout=frac * wall)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        ckpts = (
            sorted((run / "checkpoints").glob("iter-*")) if (run / "checkpoints").exists() else []
        )
        resumed = subprocess.run(
            [*BPO, "--resume", str(run)] if (run / "config.yaml").exists()
            else [*BPO, "--out", str(run), *ARGS],
            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        where = f"killed at {frac:.2f} of {wall:.0f} s ({[p.name for p in ckpts]})"
        assert resumed.returncode == 0, where + resumed.stdout + resumed.stderr
        for ra, rb in zip(_rows(ref), _rows(run), strict=True):
            _same(ra, rb, f"{where}: metrics.jsonl iteration {ra['iteration']}")
        _same(_trees(ref), _trees(run), f"{where}: trees.jsonl")
        wa = load_file(str(ref / "checkpoints/iter-000004/model.safetensors"))
        wb = load_file(str(run / "checkpoints/iter-000004/model.safetensors"))
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f"{where}: final weights differ"
