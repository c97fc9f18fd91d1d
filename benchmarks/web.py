"""The web sandbox: steps/s with the shop on loopback, snapshot and restore latency, and search
latency at two catalogue sizes.

For each size (``--products``, default 5,000 and 50,000) the shop is started in its own process
(uvicorn on a free loopback port; the catalogue's build time is reported separately, as
``build``), then:

* search: ``--queries`` searches through the client (``search[...]`` on the home page: an HTTP
  round trip, the FTS5 query with BM25 ranking, the page rendered and parsed), median ms;
* steps/s: the expert's episodes (search, product, options, buy) replayed action by action;
* snapshot and restore: native snapshots (the session's state exported and imported) taken on
  a product page and restored, median ms, against replay restores.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/web.py
"""

from __future__ import annotations

import argparse
import statistics
import time

from bpo.sandbox.envs import web
from bpo.web.serve import start_server


def measure(products: int, queries: int, episodes: int) -> dict[str, float]:
    t0 = time.perf_counter()
    url, stop = start_server(products=products)
    started = time.perf_counter() - t0
    try:
        goals = web.tasks("train", url=url)[:episodes]
        native = web.make(backend="native", url=url)
        replay = web.make(backend="replay", url=url)
        search_ms, steps, step_s = [], 0, 0.0
        snap_ms, restore_ms, replay_ms = [], [], []
        for goal in goals:
            native.reset(goal, 0)
            actions = []
            while (a := native.expert_action()) is not None:
                actions.append(a)
                native.step(a)
            for sb in (native, replay):
                sb.reset(goal, 0)
            for j, a in enumerate(actions):
                t = time.perf_counter()
                native.step(a)
                dt = time.perf_counter() - t
                steps, step_s = steps + 1, step_s + dt
                if j == 0:
                    search_ms.append(1e3 * dt)
                replay.step(a)
                if j == 1:  # on the product page
                    for sb, restores in ((native, restore_ms), (replay, replay_ms)):
                        t = time.perf_counter()
                        snap = sb.snapshot()
                        if sb is native:
                            snap_ms.append(1e3 * (time.perf_counter() - t))
                        t = time.perf_counter()
                        sb.restore(snap)
                        restores.append(1e3 * (time.perf_counter() - t))
                        sb.release(snap)
        probe = web.WebEngine(url=url)
        probe.reset(goals[0], 0)
        home = probe.get_state()
        for q in range(queries):
            probe.set_state(home)
            t = time.perf_counter()
            probe.step(
                f"search[{['cotton shirt', 'gluten free snack', 'usb cable', 'red mug'][q % 4]} {q}]"
            )
            search_ms.append(1e3 * (time.perf_counter() - t))
        probe.close()
        native.close()
        replay.close()
    finally:
        stop()
    return {
        "start_s": started,
        "search_ms": statistics.median(search_ms),
        "steps_per_s": steps / step_s,
        "snapshot_ms": statistics.median(snap_ms),
        "restore_ms": statistics.median(restore_ms),
        "replay_restore_ms": statistics.median(replay_ms),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--products", type=int, nargs="+", default=[5000, 50000])
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--episodes", type=int, default=20)
    args = ap.parse_args()
    print("| products | server start incl. catalogue (s) | search (ms) | steps/s | "
          "snapshot (ms) | restore (ms) | replay restore (ms) |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in args.products:
        r = measure(n, args.queries, args.episodes)
        print(
            f"| {n:,} | {r['start_s']:.1f} | {r['search_ms']:.1f} | {r['steps_per_s']:.0f} | "
            f"{r['snapshot_ms']:.2f} | {r['restore_ms']:.2f} | {r['replay_restore_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
