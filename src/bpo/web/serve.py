"""``bpo serve-shop``: the shop on a real server (uvicorn) for a person or an agent, and
:func:`start_server`, which runs one in a subprocess for tests, the Ray pool and benchmarks.

The server is one process with sessions in memory (the state endpoints need them in one
place), so it runs a single uvicorn worker; a search takes milliseconds (see the benchmarks in
``bpo.web``'s report), which is plenty for dozens of concurrent agents.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from bpo.web.catalog import DEFAULT_PRODUCTS


class Server(NamedTuple):
    """A running shop: its base URL (no trailing slash) and how to stop it."""

    url: str
    stop: Callable[[], None]


def create_app(
    products: int = DEFAULT_PRODUCTS, seed: int = 0, cache_dir: str | None = None,
    n_train: int | None = None, n_test: int | None = None,
):  # fmt: skip
    """The shop's ASGI app over the (cached) catalogue for (products, seed)."""
    from bpo.web import goals as g
    from bpo.web.app import make_app
    from bpo.web.catalog import Catalog

    catalog = Catalog.open(products, seed, cache_dir)
    goals = g.make_goals(catalog, n_train or g.DEFAULT_TRAIN, n_test or g.DEFAULT_TEST)
    return make_app(catalog, goals)


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bpo serve-shop",
        description="Serve the local web shop (WebShop-style; the web sandbox's site).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8800, help="port (0: any free port)")
    parser.add_argument("--products", type=int, default=DEFAULT_PRODUCTS,
                        help="catalogue size (built once, then cached)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="catalogue and goal seed")
    parser.add_argument("--cache-dir", default=None, help="default: $BPO_CACHE/web")
    parser.add_argument("--log-level", default="info", help="uvicorn's log level")
    parser.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.exit_with_parent:
        _exit_with_parent()

    import uvicorn

    t0 = time.perf_counter()
    app = create_app(args.products, args.seed, args.cache_dir)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say
    # so, and with Nagle on, every response waits ~40 ms for the client's delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"bpo serve-shop: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    print(f"bpo shop ({args.products} products, ready in {time.perf_counter() - t0:.1f}s) "
          f"at http://{host}:{port}/", flush=True)  # fmt: skip
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level == "debug")
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def start_server(
    port: int = 0, products: int = DEFAULT_PRODUCTS, *, seed: int = 0, host: str = "127.0.0.1",
    cache_dir: str | None = None, timeout: float = 600.0,
) -> Server:  # fmt: skip
    """Start ``bpo serve-shop`` in a subprocess, wait until it answers ``/healthz`` and return
    its URL and a ``stop()`` that ends it. The subprocess also exits when this process does."""
    import httpx

    cmd = [sys.executable, "-m", "bpo.web.serve", "--host", host, "--port", str(port),
           "--products", str(products), "--seed", str(seed), "--log-level", "warning",
           "--exit-with-parent"]  # fmt: skip
    if cache_dir is not None:
        cmd += ["--cache-dir", str(cache_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    tail: collections.deque[str] = collections.deque(maxlen=50)
    found: list[str] = []
    ready = threading.Event()

    def drain() -> None:  # read the child's output so that it never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            m = re.search(r"at (http://\S+?)/?$", line.strip())
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True, name="shop-output").start()

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    deadline = time.monotonic() + timeout
    ready.wait(timeout)
    while found and time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{found[0]}/healthz", timeout=5).status_code == 200:
                return Server(found[0], stop)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop()
    raise RuntimeError(
        f"the shop did not start (exit code {proc.poll()}): " + "".join(tail)[-2000:]
    )


if __name__ == "__main__":
    sys.exit(main())
