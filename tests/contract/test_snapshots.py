"""Snapshot backends on real engines: the built-in toy game, an engine whose state lives in
the C library (libc's rand), one using Python's global random, and engines that misbehave
(slow, raising, crashing, nondeterministic). Fork-server tests look at the real processes."""

from __future__ import annotations

import ctypes
import gc
import os
import random
import subprocess
import sys
import textwrap
import time
import weakref
from typing import ClassVar

import psutil
import pytest

from bpo.registry import UnknownNameError
from bpo.sandbox import (
    Observation,
    SandboxError,
    SnapshotError,
    StepResult,
    make_env,
    make_sandbox,
    rebuild,
)
from bpo.sandbox.envs.toy import INSTRUCTION

BACKENDS = ["native", "replay", "pickle", "fork"]
LIBC = ctypes.CDLL(None)


class LibcRandEngine:
    """Its randomness is libc's rand(): state outside Python, one per process."""

    def reset(self, task: str, seed: int) -> Observation:
        LIBC.srand(seed)
        self.history: list[int] = []
        return Observation(f"{task} begins", "guess numbers", ("roll",))

    def step(self, action: str) -> StepResult:
        self.history.append(LIBC.rand() % 1000)
        return StepResult(
            Observation(f"{action}: {self.history[-1]}", "guess numbers", ("roll",)), 0.0, False
        )

    def fingerprint(self) -> str:
        return repr(self.history)

    def expert_action(self) -> str | None:
        return "roll"

    def close(self) -> None:
        pass


class GlobalRandomEngine(LibcRandEngine):
    """Its randomness is Python's global ``random`` (which reseeds itself in forked children)."""

    def reset(self, task: str, seed: int) -> Observation:
        random.seed(seed)
        self.history = []
        return Observation(f"{task} begins", "guess numbers", ("roll",))

    def step(self, action: str) -> StepResult:
        self.history.append(random.randrange(1000))
        return StepResult(
            Observation(f"{action}: {self.history[-1]}", "guess", ("roll",)), 0.0, False
        )


class Misbehaving(LibcRandEngine):
    """'sleep' hangs, 'boom' raises, 'crash' kills the process; step 3 depends on resets."""

    resets = 0

    def reset(self, task: str, seed: int) -> Observation:
        self.resets += 1
        self.n = 0
        return Observation("ready", "misbehave")

    def step(self, action: str) -> StepResult:
        self.n += 1
        if action == "sleep":
            time.sleep(30)
        if action == "boom":
            raise ValueError("kaboom")
        if action == "crash":
            os._exit(3)
        text = f"{action} #{self.n}" + (f" after {self.resets} resets" if self.n == 3 else "")
        return StepResult(Observation(text, "misbehave"), 0.0, False)

    def fingerprint(self) -> str:
        return str(self.n)


def descendants() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    """Pids still running (zombies count as running) after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [
            p
            for p in pids
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_DEAD
        ]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def _no_leftover_processes():
    before = {p.pid for p in descendants()}
    yield
    assert wait_gone([p.pid for p in descendants() if p.pid not in before]) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_toy_snapshot_restore_is_exact(backend):
    with make_env("toy", backend) as sb:
        obs = sb.reset("keydoor-0", 0)
        assert obs == Observation(
            "You are in the pantry. Exits: west, east. A locked door leads east. You see a lamp.",
            INSTRUCTION,
            ("go west", "inventory", "look", "take lamp"),
        )
        sb.step("go west")
        snap = sb.snapshot()
        assert (snap.backend, snap.step, snap.task, snap.seed, snap.actions) == (
            backend,
            1,
            "keydoor-0",
            0,
            ("go west",),
        )
        assert sb.step("take key").observation.text == "You take the key."
        fingerprint = sb.fingerprint()
        for _ in range(3):  # one snapshot, restored many times
            assert sb.restore(snap).text == "You are in the study. Exits: east. You see a key."
            assert sb.observation().text == "You are in the study. Exits: east. You see a key."
            assert sb.fingerprint() == snap.fingerprint
            assert sb.step("take key").observation.text == "You take the key."
            assert sb.fingerprint() == fingerprint
        walk = ["go east", "unlock door with key", "open door", "go east", "take treasure"]
        texts = [sb.step(a).observation.text for a in walk]
        assert texts[1] == "You unlock the door. Somewhere, water drips."  # the seeded rng
        assert sb.observation().done and sb.stats().live == 1
        sb.release(snap)
        st = sb.stats()
        assert (st.live, st.live_bytes, st.taken, st.restored) == (0, 0, 1, 3)
        assert st.replayed == (3 if backend == "replay" else 0)
        with pytest.raises(SnapshotError, match="snapshot 1 was released"):
            sb.restore(snap)
        with pytest.raises(SnapshotError, match="already released"):
            sb.release(snap)


@pytest.mark.parametrize("backend", BACKENDS)
def test_foreign_snapshot_is_refused_but_rebuilds_by_replay(backend):
    with make_env("toy", backend) as a, make_env("toy", "native") as b:
        a.reset("keydoor-4", 7)
        for _ in range(4):
            a.step(a.expert_action())
        snap = a.snapshot()
        b.reset("keydoor-1", 0)
        with pytest.raises(SnapshotError, match="belongs to another sandbox"):
            b.restore(snap)
        assert rebuild(b, snap) == a.observation()
        assert b.fingerprint() == a.fingerprint() == snap.fingerprint
        a.release(snap)


def test_replay_names_the_step_where_it_diverges():
    with make_sandbox(Misbehaving, "replay") as sb:
        sb.reset("t", 0)
        for action in ("a", "b", "c", "d"):
            sb.step(action)
        assert sb.observation().text == "d #4"
        snap = sb.snapshot()
        with pytest.raises(SnapshotError, match=r"diverged at step 3 of 4 \(action 'c'\)"):
            sb.restore(snap)
        with pytest.raises(SandboxError, match="state is unknown"):
            sb.step("e")


@pytest.mark.parametrize("backend", ["native", "fork"])
def test_engine_errors_become_sandbox_errors_with_cause(backend):
    factory = Misbehaving if backend == "fork" else LibcRandEngine
    if backend == "native":
        with pytest.raises(ValueError, match="get_state"):
            make_sandbox(factory, "native")
        return
    with make_sandbox(factory, "fork") as sb:
        sb.reset("t", 0)
        sb.step("a")
        with pytest.raises(SandboxError, match=r"raised in step\('boom'\)") as info:
            sb.step("boom")
        assert isinstance(info.value.cause, ValueError) and str(info.value.cause) == "kaboom"
        with pytest.raises(SandboxError, match="state is unknown"):
            sb.step("a")
        assert sb.reset("t", 0).text == "ready"
        assert sb.step("a").observation.text == "a #1"


def test_bad_arguments_name_the_fix():
    with pytest.raises(UnknownNameError, match="valid names: auto, fork, native, pickle"):
        make_sandbox(LibcRandEngine, "nope")
    with pytest.raises(ValueError, match="step_timeout needs backend='fork'"):
        make_sandbox(LibcRandEngine, "replay", step_timeout=1.0)
    with pytest.raises(UnknownNameError, match=r"valid names: .*toy"):
        make_env("no-such-env")
    with make_env("toy") as sb:
        assert sb.backend == "native"  # auto picks native for NativeState engines
        with pytest.raises(SandboxError, match="call reset"):
            sb.step("look")
        with pytest.raises(TypeError, match="action is text"):
            sb.reset("keydoor-0", 0) and sb.step(3)  # type: ignore[arg-type]
    assert make_sandbox(LibcRandEngine).backend == "replay"  # auto without native state


# -- the fork server --------------------------------------------------------------------------


def test_fork_is_exact_for_c_library_state():
    """libc's rand() state is invisible to Python: only the fork server snapshots it."""
    with make_sandbox(LibcRandEngine, "fork") as sb, make_sandbox(LibcRandEngine, "fork") as b:
        sb.reset("t", 5), b.reset("t", 5)
        first = [sb.step("roll").observation.text for _ in range(3)]
        assert [b.step("roll").observation.text for _ in range(3)] == first  # own process each
        snap = sb.snapshot()
        later = [sb.step("roll").observation.text for _ in range(3)]
        for _ in range(2):
            sb.restore(snap)
            assert [sb.step("roll").observation.text for _ in range(3)] == later
        sb.release(snap)
    with make_sandbox(LibcRandEngine, "pickle") as sb:
        sb.reset("t", 5)
        snap = sb.snapshot()
        again = [sb.step("roll").observation.text for _ in range(3)]
        sb.restore(snap)
        assert [sb.step("roll").observation.text for _ in range(3)] != again


def test_fork_keeps_the_global_random_state():
    with make_sandbox(GlobalRandomEngine, "fork") as sb:
        sb.reset("t", 1)
        snap = sb.snapshot()
        want = [sb.step("roll").observation.text for _ in range(4)]
        random.seed(1)
        assert want == [f"roll: {random.randrange(1000)}" for _ in range(4)]
        for _ in range(2):
            sb.restore(snap)
            assert [sb.step("roll").observation.text for _ in range(4)] == want


def test_fork_processes_restore_release_and_close():
    # children of this process from earlier tests are not this sandbox's (the web sandbox's
    # shared local shop, bpo.sandbox.envs.web._local_shop, lives until this process exits)
    before = {p.pid for p in descendants()}
    sb = make_env("toy", "fork")
    server, first = sb.server_pid, sb.engine_pid
    assert psutil.Process(first).ppid() == server
    assert psutil.Process(server).ppid() == os.getpid()
    sb.reset("keydoor-3", 0)
    snaps = []
    for _ in range(4):
        sb.step(sb.expert_action())
        snaps.append(sb.snapshot())
    frozen = sb.frozen_pids()
    assert len(frozen) == 4 and all(psutil.Process(p).ppid() == first for p in frozen)
    assert sb.restore(snaps[1]).text == "You open the chest. Inside is a key."
    engine = sb.engine_pid
    assert engine not in (first, *frozen) and psutil.Process(engine).ppid() == frozen[1]
    assert wait_gone([first]) == []  # the replaced engine process exits and is reaped
    assert all(psutil.Process(p).ppid() == server for p in frozen)  # the subreaper adopts them
    for s in snaps:
        sb.release(s)
    assert wait_gone(frozen) == []
    assert sb.stats().live == 0 and sb.frozen_pids() == []
    assert {p.pid for p in descendants()} - before >= {server, engine}  # + the pristine copy
    assert sb.step("look").observation.text.startswith("You are in the kitchen.")
    sb.close()
    assert wait_gone([server, engine], timeout=0.5) == []
    assert {p.pid for p in descendants()} - before == set()


def test_fork_step_timeout_kills_the_engine_and_recovers():
    with make_sandbox(Misbehaving, "fork", step_timeout=0.5) as sb:
        sb.reset("t", 0)
        sb.step("a")
        snap = sb.snapshot()
        hung = sb.engine_pid
        t0 = time.monotonic()
        with pytest.raises(SandboxError, match=r"step\('sleep'\) timed out after 0.5 s"):
            sb.step("sleep")
        assert time.monotonic() - t0 < 5
        assert wait_gone([hung]) == [] and sb.engine_pid is None
        with pytest.raises(SandboxError, match=r"no engine process|state is unknown"):
            sb.step("a")
        assert sb.restore(snap).text == "a #1"
        assert sb.step("b").observation.text == "b #2"
        sb.release(snap)
        assert sb.reset("t", 0).text == "ready"
        with pytest.raises(SandboxError, match=r"engine process died during step\('crash'\)"):
            sb.step("crash")
        assert sb.reset("t", 0).text == "ready"


def test_fork_memory_budget_evicts_lru_and_restores_by_replay():
    with make_env("toy", "fork", memory_budget=1) as sb:
        sb.reset("keydoor-0", 0)
        sb.step("go west")
        s1 = sb.snapshot()
        sb.step("take key")
        s2 = sb.snapshot()  # over budget: s1, the least recently used, is evicted
        assert sb.stats().evicted == 1 and len(sb.frozen_pids()) == 1
        assert sb.restore(s1).text == "You are in the study. Exits: east. You see a key."
        assert sb.fingerprint() == s1.fingerprint
        assert sb.stats().replayed == 1
        assert sb.restore(s2).text == "You take the key."
        for s in (s1, s2):
            sb.release(s)
        assert sb.stats().live == 0


OWNER = """
import os, signal, sys
from bpo.sandbox import make_env
sb = make_env("toy", "fork")
sb.reset("keydoor-0", 0)
snap = sb.snapshot()
sb.step("go west")
print(sb.server_pid, sb.engine_pid, *sb.frozen_pids(), flush=True)
if sys.argv[1] == "fork-then-kill":  # a forked child keeps the owner's descriptors open
    child = os.fork()
    if child == 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1), os.dup2(null, 2)
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
if sys.argv[1] != "exit":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("how", ["kill", "exit", "fork-then-kill"])
def test_fork_processes_die_with_their_owner(how):
    """The owner is SIGKILLed (no close(), no atexit), or just exits, or is SIGKILLed while a
    forked child of it still holds its end of every pipe (then only PR_SET_PDEATHSIG tells
    the server): nothing of the sandbox survives."""
    out = subprocess.run(
        [sys.executable, "-c", "import time\n" + textwrap.dedent(OWNER), how],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    pids = [int(x) for x in out.stdout.split()]
    assert len(pids) == (4 if how == "fork-then-kill" else 3), out.stderr
    try:
        assert wait_gone(pids[:3]) == []
    finally:
        if how == "fork-then-kill":
            os.kill(pids[3], 9)


class Cycle:
    """An object in a reference cycle, counted while it exists."""

    alive: ClassVar[weakref.WeakSet] = weakref.WeakSet()

    def __init__(self) -> None:
        self.me = self
        Cycle.alive.add(self)


class CyclicGarbage(LibcRandEngine):
    """Every step drops a reference cycle; observations count the cycles still in memory."""

    def reset(self, task: str, seed: int) -> Observation:
        self.node, self.history = Cycle(), []
        return Observation(f"{task} begins", "collect")

    def step(self, action: str) -> StepResult:
        self.node = Cycle()  # the previous one is garbage now
        if action == "collect":
            gc.collect()
        text = f"cycles alive: {len(Cycle.alive)}"
        return StepResult(Observation(text, "collect"), 0.0, False)


def test_fork_collects_garbage_frozen_for_snapshots_after_reset():
    with make_sandbox(CyclicGarbage, "fork") as sb:
        sb.reset("t", 0)
        for _ in range(20):  # each snapshot freezes the cycle alive at that moment
            sb.step("step")
            sb.release(sb.snapshot())
        assert sb.step("collect").observation.text == "cycles alive: 22"  # frozen: kept
        sb.reset("t", 0)
        assert sb.step("collect").observation.text == "cycles alive: 1"
