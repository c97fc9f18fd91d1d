"""``bpo compare``'s job runner: its warm starts and method runs, one after another in this
process or several at once in spawned processes (each with a log file and its share of the CPU
threads), with Ctrl-C and SIGTERM passed on to the runs, and SIGTERM sent to them when ``bpo
compare`` dies."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from bpo.config import Config

__all__ = ["Job", "Jobs", "default_jobs", "in_child", "term_with_parent"]


class Job(NamedTuple):
    """One of compare's jobs: ``fn(*args)`` with its output in ``log``."""

    label: str
    log: Path
    fn: Callable[..., Any]
    args: tuple
    after: str | None = None
    """The label of an earlier job that must finish first (a run after its warm start)."""


def in_child(log: Path, threads: int, parent: int, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` in a pool process: its output (file descriptors 1 and 2, so a sandbox's
    subprocesses too) goes to ``log``, and torch gets ``threads`` threads. When ``bpo
    compare`` (process ``parent``) dies, even by SIGKILL, the run gets SIGTERM: it checkpoints
    and stops, instead of running on as an orphan that a rerun would race."""
    term_with_parent(parent)
    import torch

    torch.set_num_threads(threads)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    return fn(*args)


def term_with_parent(parent: int) -> None:
    """SIGTERM to this process, once, when its parent dies (Linux ``PR_SET_PDEATHSIG``;
    elsewhere nothing: Ctrl-C still reaches every run, a kill of the parent alone does not).
    The kernel sends the death signal again each time the child passes to another thread of
    the dying parent, and a second SIGTERM stops ``bpo train`` at once, without its
    checkpoint: so the death signal is SIGUSR1, turned into one SIGTERM here, by a handler
    that acts once (setting SIGUSR1 to ignored after the first is not enough: a second
    delivery can trip Python's handler again before the first call has run)."""
    if sys.platform.startswith("linux"):
        import ctypes

        fired: list[bool] = []

        def on_parent_death(signum: int, frame: Any) -> None:
            if fired:
                return
            fired.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGUSR1, on_parent_death)
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGUSR1)
    if os.getppid() != parent:  # it died before the request took effect
        raise SystemExit("bpo compare stopped before this run started")


class Jobs:
    """Runs compare's jobs in this process (``jobs=1``: live progress, Ctrl-C as in ``bpo
    train``) or in ``jobs`` fresh processes at once, each with ``cpu_count // jobs`` torch
    threads and its output in a log file (the runs are independent: on a CPU machine, where a
    tiny model's kernels do not use many cores well, two runs on one core each finish sooner
    than two runs in a row on two). Ctrl-C reaches every child, which checkpoints and stops as
    ``bpo train`` does; ``bpo compare`` then continues where they stopped. SIGTERM to ``bpo
    compare`` is passed on to the runs (the same clean stop), and a run whose ``bpo compare``
    died gets one (:func:`term_with_parent`)."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.threads = max(1, (os.cpu_count() or 1) // jobs)
        self.pool: Any = None
        if jobs > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            os.environ.setdefault("OMP_NUM_THREADS", str(self.threads))  # read at child start
            self.pool = ProcessPoolExecutor(
                jobs, mp_context=mp.get_context("spawn"), max_tasks_per_child=1
            )

    def map(self, jobs: list[Job]) -> list[Any]:
        """Run ``jobs``; results in order. At most ``self.jobs`` run at once; a free process
        takes the first job in list order whose ``after`` has finished, so the list order is
        the priority (long runs first, short jobs last to fill the gaps). In this process
        (``jobs=1``) they run in list order, and a run that returns ``{"interrupted": True}``
        (Ctrl-C) ends the list: the jobs after it are not run (their results are None)."""
        labels = [j.label for j in jobs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"job labels must be unique: {labels}")
        for i, j in enumerate(jobs):
            if j.after is not None and j.after not in labels[:i]:
                raise ValueError(f"job {j.label!r} waits for {j.after!r}, not an earlier job")
        if self.pool is None:
            results: list[Any] = [None] * len(jobs)
            for i, j in enumerate(jobs):
                print(f"[compare] {j.label}")
                results[i] = j.fn(*j.args)
                if isinstance(results[i], dict) and results[i].get("interrupted"):
                    break
            return results
        import multiprocessing as mp
        from concurrent.futures import FIRST_COMPLETED, wait

        def on_term(signum: int, frame: Any) -> None:
            for child in mp.active_children():  # the pool's processes
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGTERM)  # type: ignore[arg-type]
            raise KeyboardInterrupt

        t0 = time.perf_counter()
        waiting = list(jobs)
        running: dict[Any, str] = {}
        done_by_label: dict[str, Any] = {}

        def start_ready() -> None:
            for j in list(waiting):
                if len(running) >= self.jobs:
                    return
                if j.after is not None and j.after not in done_by_label:
                    continue
                fut = self.pool.submit(in_child, j.log, self.threads, os.getpid(), j.fn, *j.args)
                running[fut] = j.label
                waiting.remove(j)
                print(f"[compare] started {j.label} (output: {j.log})")

        old = signal.signal(signal.SIGTERM, on_term)
        try:
            start_ready()
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    label = running.pop(fut)
                    done_by_label[label] = fut.result()
                    print(f"[compare] finished {label} ({len(done_by_label)}/{len(jobs)}, "
                          f"{time.perf_counter() - t0:.0f}s)")  # fmt: skip
                start_ready()
        finally:
            signal.signal(signal.SIGTERM, old)
        return [done_by_label[label] for label in labels]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def default_jobs(cfg: Config) -> int:
    """Runs at once when ``--jobs`` is not given: one per CPU core, at most 8, on a CPU-only
    config; 1 when it uses a GPU or a Ray cluster."""
    import torch

    device = cfg.policy.device
    gpu = torch.cuda.is_available() if device == "auto" else not device.startswith("cpu")
    if cfg.cluster.address or gpu:
        return 1
    return max(1, min(8, os.cpu_count() or 1))
