"""Fault-injection soak of ``bpo train``: the same run with and without injected sandbox faults
(same config and seed), side by side. Prints the table in RELIABILITY.md.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/soak.py [--rate 0.05] [--iterations 10]
        [--config configs/toy.yaml] [--out DIR] [override ...]

Faults (``sandbox.faults``, bpo.sandbox.faults): a step that raises, one that returns a
malformed result, one that hangs (a real sleep, then the timeout error), a restore that fails,
and a sandbox that dies for good, drawn uniformly at ``--rate`` per call. Both runs go to
``--out`` (default: a temporary directory) as ordinary run directories.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bpo.sandbox.faults import soak_overrides

ROOT = Path(__file__).resolve().parents[1]


def _run(out: Path, args: list[str]) -> tuple[float, list[dict], dict]:
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "bpo.cli", "train", "--out", str(out), *args],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"bpo train failed ({out}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    return wall, rows, json.loads((out / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/toy.yaml")
    ap.add_argument("--rate", type=float, default=0.05)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--out", help="where the two runs go (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="bpo-soak-"))
    common = ["--config", a.config, f"run.iterations={a.iterations}", *a.overrides]
    clean = _run(out / "clean", common)
    faulty = _run(out / "faulty", [*common, *soak_overrides(a.rate)])
    print(f"config {a.config}, {a.iterations} iterations, fault rate {a.rate}, runs in {out}\n")
    print("| run | wall s | faults injected | rollouts restarted | rollouts lost | trees lost "
          "| live snapshots after trees | held-out success before -> after |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, (wall, rows, summary) in (("fault-free", clean), ("faulty", faulty)):
        injected = {
            k.removeprefix("faults/injected_"): int(v)
            for k, v in rows[-1].items()
            if k.startswith("faults/injected_")
        }
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(injected.items())) or "none"
        total = sum(injected.values())
        print(
            f"| {name} | {wall:.0f} | {total} ({kinds}) | "
            f"{sum(r['rollout/retries'] for r in rows):.0f} | "
            f"{sum(r['rollout/failed_episodes'] for r in rows):.0f} | "
            f"{sum(r['rollout/failed_trees'] for r in rows):.0f} | "
            f"{sum(r['snapshot/live_after_tree'] for r in rows):.0f} | "
            f"{summary['eval_before']['success']:.3f} -> {summary['eval_after']['success']:.3f} |"
        )


if __name__ == "__main__":
    main()
