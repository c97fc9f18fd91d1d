"""Snapshot and restore latency, and bytes held, per backend (DESIGN section 8).

Two engines: the built-in toy game (a small state), and the same game carrying ``--ballast-mb``
megabytes of Python objects that every step rewrites a little (a large in-process state, the
fork server's case). For each, the sandbox walks ``--depth`` steps into an episode, then
repeats: snapshot, three steps, restore, release. Latencies are medians over the repeats;
bytes are what one live snapshot holds after those three steps (fork: the frozen copy's
private pages, i.e. what the active engine has since dirtied). Prints a markdown table.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/snapshots.py
"""

from __future__ import annotations

import argparse
import statistics
import time

from bpo.sandbox import make_env
from bpo.sandbox.snapshots.procs import rss_bytes

TASK = "keydoor-4"
WALK = ["look", "inventory"]  # steps that keep the episode going (never terminal)


def measure(backend: str, ballast_mb: float, depth: int, repeats: int) -> dict[str, float]:
    options = {"memory_budget": None} if backend == "fork" else {}
    built = time.perf_counter()
    sb = make_env("toy", backend, max_steps=10**6, ballast_mb=ballast_mb, **options)
    built = time.perf_counter() - built
    try:
        sb.reset(TASK, 0)
        for i in range(depth):
            sb.step(WALK[i % 2])
        snap_ms, restore_ms, held = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            snap = sb.snapshot()
            snap_ms.append(1e3 * (time.perf_counter() - t0))
            for i in range(3):
                sb.step(WALK[i % 2])
            held.append(sb.stats().live_bytes)
            t0 = time.perf_counter()
            sb.restore(snap)
            restore_ms.append(1e3 * (time.perf_counter() - t0))
            sb.release(snap)
        rss = rss_bytes(sb.engine_pid) if backend == "fork" else 0  # type: ignore[attr-defined]
        return {
            "snapshot_ms": statistics.median(snap_ms),
            "restore_ms": statistics.median(restore_ms),
            "bytes": statistics.median(held),
            "build_s": built,
            "rss": rss,
        }
    finally:
        sb.close()


def _bytes(n: float) -> str:
    for unit, size in (("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--ballast-mb", type=float, default=50.0)
    p.add_argument("--depths", default="10,40", help="episode depths for the small state")
    args = p.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    rows = []
    for backend in ("native", "pickle", "replay", "fork"):
        for depth in depths if backend == "replay" else depths[:1]:
            rows.append(("toy", backend, depth, measure(backend, 0.0, depth, args.repeats)))
    big = f"toy + {args.ballast_mb:g} MB of Python objects"
    for backend in ("fork", "native", "pickle", "replay"):
        reps = (
            args.repeats if backend in ("fork", "native", "replay") else max(3, args.repeats // 6)
        )
        rows.append((big, backend, depths[0], measure(backend, args.ballast_mb, depths[0], reps)))
    rss = {engine: m["rss"] for engine, backend, _, m in rows if backend == "fork"}
    print("fork engine process RSS: " + ", ".join(f"{e}: {_bytes(r)}" for e, r in rss.items()))
    print()
    print("| engine | backend | depth | snapshot ms | restore ms | bytes per snapshot |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for engine, backend, depth, m in rows:
        print(
            f"| {engine} | {backend} | {depth} | {m['snapshot_ms']:.3f} | "
            f"{m['restore_ms']:.3f} | {_bytes(m['bytes'])} |"
        )
    print(
        f"\nmedians over {args.repeats} snapshot/restore pairs (pickle on the large state: "
        f"{max(3, args.repeats // 6)}); each restore follows 3 steps."
    )


if __name__ == "__main__":
    main()
