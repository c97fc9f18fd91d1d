"""Code-sandbox workspaces: snapshot and restore latency per kind, and the jail's start-up cost.

Builds a workspace of ``--files`` files totalling ``--mb`` megabytes (issue 7's target shape:
2,000 files, 50 MB, a few directories deep, plus a git repository), then repeats: change one
file, snapshot, change three more, restore, release. Medians over ``--repeats``. The overlay
kind's times include the round trip to its mount-namespace server (a pipe); the system calls
themselves are a part of that. Then times ``true`` run in the jail (bubblewrap, cgroup, rlimits)
against ``bash -c true`` run directly: the difference is the jail's start-up overhead.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/workspace.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bpo.sandbox.workspace import Jail, Limits, open_workspace, overlay_supported


def build(root: Path, files: int, mb: float) -> None:
    size = int(mb * (1 << 20) / files)
    rng = os.urandom(size)
    for i in range(files):
        d = root / f"pkg{i % 20}" / f"sub{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i}.py").write_bytes(rng[i % 97 :] + rng[: i % 97])
    subprocess.run(["git", "init", "-q", str(root)], check=True)


def measure(base: Path, kind: str, repeats: int) -> dict[str, float]:
    t0 = time.perf_counter()
    ws = open_workspace(base, kind)
    opened = time.perf_counter() - t0
    root = Path(ws.path)
    target = next(root.glob("pkg0/sub0/*.py"))
    snap_ms, restore_ms, held = [], [], []
    try:
        for i in range(repeats):
            target.write_text(f"changed {i}\n")
            t0 = time.perf_counter()
            state = ws.snapshot()
            snap_ms.append(1e3 * (time.perf_counter() - t0))
            held.append(getattr(state, "nbytes", 0))
            for j in range(3):
                (root / f"pkg{j}" / f"new{i}.txt").write_text("x")
            t0 = time.perf_counter()
            ws.restore(state)
            restore_ms.append(1e3 * (time.perf_counter() - t0))
            ws.release(state)
    finally:
        ws.close()
    return {
        "open_s": opened,
        "snapshot_ms": statistics.median(snap_ms),
        "restore_ms": statistics.median(restore_ms),
        "held_kb": statistics.median(held) / 1024,
    }


def jail_overhead(work: Path, repeats: int) -> tuple[float, float]:
    with Jail(Limits()) as jail:
        jail.run("true", work)  # warm
        t0 = time.perf_counter()
        for _ in range(repeats):
            jail.run("true", work)
        jailed = (time.perf_counter() - t0) / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        subprocess.run(["bash", "-c", "true"], cwd=work, check=True)
    plain = (time.perf_counter() - t0) / repeats
    return 1e3 * jailed, 1e3 * plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--mb", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bpo-bench-ws-") as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        build(base, args.files, args.mb)
        kinds = (["overlay"] if overlay_supported() else []) + ["tar"]
        print(f"workspace: {args.files} files, {args.mb:g} MB; medians of {args.repeats} repeats\n")
        print("| kind | open (s) | snapshot (ms) | restore (ms) | held per snapshot (KB) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for kind in kinds:
            reps = args.repeats if kind == "overlay" else max(3, args.repeats // 10)
            r = measure(base, kind, reps)
            print(
                f"| {kind} | {r['open_s']:.2f} | {r['snapshot_ms']:.2f} | {r['restore_ms']:.2f} "
                f"| {r['held_kb']:.1f} |"
            )
        jailed, plain = jail_overhead(base, args.repeats)
        print(
            f"\njail start-up: `true` in the jail {jailed:.1f} ms, `bash -c true` directly "
            f"{plain:.1f} ms: overhead {jailed - plain:.1f} ms per command"
        )


if __name__ == "__main__":
    main()
