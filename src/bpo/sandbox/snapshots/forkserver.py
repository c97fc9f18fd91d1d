"""The child side of the fork server, and how it starts.

Processes (``P`` is the process that owns the sandbox):

* ``S``, the server, forked from ``P``: a child subreaper that reaps every engine process,
  dies with ``P`` (``PR_SET_PDEATHSIG``, or end-of-file on a control pipe that only ``P``
  writes) and then kills the engine processes' process group. It never runs engine code.
* the *active* engine process, forked from ``S`` (the first one builds the engine with the
  factory): serves reset/step/fingerprint/... over its channel. On ``snapshot`` it forks a
  *frozen* copy of itself (``gc.freeze()`` first, so that the collector does not write to
  the objects the copies share; ``reset`` unfreezes them, so that garbage is still collected
  once per episode).
* a *frozen* process waits on its own channel; on ``fork`` it forks a new active process.

Every engine-side process exits when ``P`` closes its channel (release, close, or ``P``
dying). The roles are a trampoline (:func:`_run`), so that the stack does not grow with the
number of snapshot/restore generations. Python's global ``random`` is reseeded in forked
children by the ``random`` module; its state is carried across each fork so that snapshots
stay exact.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import random
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from bpo.sandbox.protocol import Engine
from bpo.sandbox.snapshots.procs import (
    PARENT_FDS,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_PDEATHSIG,
    Channel,
    ChannelClosed,
    close_inherited,
    prctl,
    rss_bytes,
)
from bpo.sandbox.snapshots.replay import replay


@dataclass
class Server:
    """``P``'s handle on a started fork server."""

    pid: int
    """The server process ``S`` (a child of ``P``)."""
    ctl_fd: int
    """Write end of the control pipe: closing it shuts the server and its engines down."""
    first: Channel
    """Channel to the first engine process (its first message: ("ok", pid) or an error)."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Kill every engine process of this server, reap them, and reap the server."""
        if self.ctl_fd >= 0:
            PARENT_FDS.pop(self.ctl_fd, None)
            os.close(self.ctl_fd)
            self.ctl_fd = -1
        _wait_exit(self.pid, timeout)


def start(factory: Callable[[], Engine]) -> Server:
    """Fork the server ``S``, which forks the first engine process; returns at once."""
    chan, far = Channel.pair()
    ctl_r, ctl_w = os.pipe()
    PARENT_FDS[ctl_w] = None
    pdeath = threading.current_thread() is threading.main_thread()
    owner = os.getpid()
    _flush()
    pid = os.fork()
    if pid == 0:  # S
        try:
            close_inherited(keep=(ctl_r, far.fileno()))
            _server(ctl_r, far, factory, owner, pdeath)
        finally:
            os._exit(70)
    os.close(ctl_r)
    far.close()
    return Server(pid, ctl_w, chan)


def _server(
    ctl_r: int, far: socket.socket, factory: Callable[[], Engine], owner: int, pdeath: bool
) -> NoReturn:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the owner
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    group = [0]

    def shutdown(*_: object) -> NoReturn:
        if group[0]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group[0], signal.SIGKILL)
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                os._exit(0)

    signal.signal(signal.SIGTERM, shutdown)
    if pdeath:  # only a main thread outlives its forks; other threads may end early
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != owner:
        shutdown()
    gc.freeze()
    first = os.fork()
    if first == 0:  # the first engine process: leader of the engines' process group
        try:
            os.setpgid(0, 0)
            os.close(ctl_r)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _engine_main(Channel(far), factory)
        finally:
            os._exit(70)
    with contextlib.suppress(OSError):
        os.setpgid(first, first)
    group[0] = first
    far.close()
    signal.signal(signal.SIGCHLD, lambda *_: _reap_any())
    while os.read(ctl_r, 64):
        pass
    shutdown()


def _engine_main(chan: Channel, factory: Callable[[], Engine]) -> NoReturn:
    try:
        engine = factory()
    except BaseException as e:
        chan.send(_error(e))
        os._exit(1)
    chan.send(("ok", os.getpid()))
    _run(chan, engine)


def _run(chan: Channel, engine: Engine) -> NoReturn:
    role = "engine"
    while True:
        if role == "engine":
            chan, role = _serve_engine(chan, engine)
        else:
            chan, role = _serve_frozen(chan)


def _reset(engine: Engine, task: str, seed: int) -> Any:
    # objects frozen for earlier snapshots become collectable again at an episode boundary
    # (frozen objects are never collected: cyclic garbage among them would pile up)
    gc.unfreeze()
    return engine.reset(task, seed)


_CALLS: dict[str, Callable[..., Any]] = {
    "reset": _reset,
    "step": lambda e, action: e.step(action),
    "fingerprint": lambda e: e.fingerprint(),
    "expert": lambda e: e.expert_action(),
    "replay": lambda e, *args: replay(e, *args),
    "ping": lambda e: os.getpid(),
}


def _serve_engine(chan: Channel, engine: Engine) -> tuple[Channel, str]:
    children: set[int] = set()  # this process's frozen copies, reaped as they exit
    while True:
        _reap(children)
        msg, fds = _next(chan)
        op = msg[0]
        if op == "snapshot":
            try:  # the first frozen copy is taken before any reset: no fingerprint yet
                fingerprint = engine.fingerprint() if msg[1] else ""
            except Exception as e:
                _close_all(fds)
                chan.send(_error(e))
                continue
            gc.freeze()
            pid = _fork()
            if pid == 0:  # the frozen copy
                signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # auto-reap the processes it forks
                chan.drop_in_child()
                return Channel(socket.socket(fileno=fds[0])), "frozen"
            os.close(fds[0])
            children.add(pid)
            chan.send(("ok", (pid, fingerprint, rss_bytes())))
        elif op == "exit":
            os._exit(0)
        else:
            try:
                reply = ("ok", _CALLS[op](engine, *msg[1:]))
            except Exception as e:
                reply = _error(e)
            try:
                chan.send(reply)
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                chan.send(_error(e))


def _serve_frozen(chan: Channel) -> tuple[Channel, str]:
    while True:
        msg, fds = _next(chan)
        if msg[0] == "fork":
            pid = _fork()
            if pid == 0:  # the new active engine process
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                chan.drop_in_child()
                return Channel(socket.socket(fileno=fds[0])), "engine"
            os.close(fds[0])
            chan.send(("ok", pid))
        else:
            _close_all(fds)
            os._exit(0)


def _fork() -> int:
    """``os.fork`` that carries the global ``random`` state into the child (the ``random``
    module reseeds itself there, which would make restored engines diverge)."""
    state = random.getstate()
    _flush()
    pid = os.fork()
    if pid == 0:
        random.setstate(state)
    return pid


def _next(chan: Channel) -> tuple[Any, list[int]]:
    try:
        return chan.recv()
    except (ChannelClosed, OSError):
        os._exit(0)  # the owner released us, closed the sandbox, or died


def _error(e: BaseException) -> tuple[str, str, bytes | None, str]:
    try:
        blob: bytes | None = pickle.dumps(e)
    except Exception:
        blob = None
    return ("err", repr(e), blob, traceback.format_exc())


def _reap(pids: set[int]) -> None:
    for pid in list(pids):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            pids.discard(pid)


def _reap_any() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _wait_exit(pid: int, timeout: float) -> None:
    """Reap child ``pid``; SIGKILL it if it has not exited within ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.001)
