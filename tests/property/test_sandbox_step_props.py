"""Property tests of every shipped sandbox's ``step`` on arbitrary text.

Contract (bpo.sandbox.protocol): invalid or malformed action text is an observation, never an
exception. For any string (unicode, lone surrogates, control characters, very long, empty),
interleaved with valid actions so that junk arrives in many states, ``step`` returns a
StepResult holding an Observation, with a finite reward and boolean flags, and the sandbox stays
usable. The only exception allowed is SandboxError, and only for a dead engine (checked below by
killing a fork-backend engine process and a TextWorld-Express JVM).

Games of generated environments are cached under $BPO_CACHE (default ~/.cache/bpo), so only a
first run pays for generating them. ScienceWorld steps are slow: it gets few examples.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bpo.sandbox import Observation, SandboxError, StepResult, make_env
from bpo.sandbox.envs import load_all

# name -> (environment, make_env options, task, hypothesis examples)
CASES = {
    "toy": ("toy", {}, "keydoor-1", 100),
    "toy-fork": ("toy", {"backend": "fork"}, "keydoor-4", 40),
    "mdp": ("mdp", {}, "agent-3", 100),
    "textworld": ("textworld", {}, "tw-cooking/level=1/split=train/seed=0", 50),
    "twx": ("twx", {}, "coin/seed=1", 50),
    "alfworld": ("alfworld", {}, "pick_and_place_simple/FloorPlan315/0", 30),
    "scienceworld": ("scienceworld", {}, "find-animal/var=7", 8),
    "code": ("code", {}, "parse__parse-0000", 25),
    "web": ("web", {}, "shop-train-00000", 60),
}
ENV_MARKS = {"textworld", "twx", "alfworld", "scienceworld"}

NASTY = [
    "",
    " ",
    "\n",
    "\r\n\t",
    "\x00",
    "look\x00",
    "\x1b[31mred",
    "\x7f\x08",
    "\ud800",
    "\udfff go",
    "\ud83d\ude00",
    "é🙂 日本語",
    "\u202egnp",
    "\ufeff",
    "\u2028",
    "x" * 100_000,
    "go north\nsouth",
    "%s %d {0} %n",
    "\\",
    "'",
    '"',
    "?",
    "!!!",
    "-1",
    "()[]{}<>",
    "save",
    "restore",
    "restart",
    "quit",
    "undo",
    "script",
    "help",
    "inventory",
]
ANY_CHAR = st.characters(exclude_categories=())  # surrogates and control characters included
JUNK = st.one_of(
    st.sampled_from(NASTY),
    st.text(max_size=60),
    st.text(ANY_CHAR, max_size=30),
    st.text(st.characters(categories=["Cc", "Cf", "Zs", "Zl", "Zp"]), max_size=20),
    st.integers(1_000, 200_000).map(lambda n: "look " * (n // 5)),
)


def test_every_shipped_environment_is_covered():
    assert {env for env, *_ in CASES.values()} == set(load_all().names())


@pytest.fixture(scope="module")
def sandboxes():
    """One sandbox per case, built on first use and closed at the end of the module."""
    built: dict[str, object] = {}

    def get(case: str):
        if case not in built:
            env, options, _, _ = CASES[case]
            built[case] = make_env(env, **options)
        return built[case]

    yield get
    for sb in built.values():
        sb.close()
    gc.collect()


def _check_result(res: object) -> StepResult:
    assert isinstance(res, StepResult), type(res)
    obs = res.observation
    assert isinstance(obs, Observation), type(obs)
    assert isinstance(obs.text, str) and isinstance(obs.instruction, str)
    assert obs.admissible is None or (
        isinstance(obs.admissible, tuple) and all(isinstance(a, str) for a in obs.admissible)
    )
    assert isinstance(obs.done, bool)
    assert isinstance(res.reward, (int, float)) and math.isfinite(res.reward)
    assert isinstance(res.terminated, bool) and isinstance(res.truncated, bool)
    return res


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[pytest.mark.env] if c in ENV_MARKS else []) for c in CASES],
)
def test_step_on_arbitrary_text_is_an_observation(case, sandboxes):
    sb = sandboxes(case)
    _, _, task, examples = CASES[case]
    state = {"obs": sb.reset(task, 0)}

    def act(action: str) -> None:
        if state["obs"].done:
            state["obs"] = sb.reset(task, 0)
        res = _check_result(sb.step(action))  # any exception fails the test
        assert sb.observation() == res.observation
        assert isinstance(sb.fingerprint(), str)
        state["obs"] = res.observation

    @settings(
        max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(plan=st.lists(st.tuples(st.booleans(), JUNK, st.integers(0, 10**6)), max_size=4))
    @example(plan=[(False, junk, 0) for junk in NASTY])
    def run(plan: list[tuple[bool, str, int]]) -> None:
        for valid, junk, pick in plan:
            admissible = state["obs"].admissible
            act(admissible[pick % len(admissible)] if valid and admissible else junk)

    run()


# -- dead engines: the one case where step may raise, and it must be SandboxError --------------


def _children() -> set[int]:
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        pids |= {int(p) for p in (task / "children").read_text().split()}
    return pids


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited child not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_killed_fork_engine_is_a_sandbox_error_and_reset_recovers():
    sb = make_env("toy", backend="fork")
    try:
        sb.reset("keydoor-2", 0)
        _check_result(sb.step("look"))
        os.kill(sb.engine_pid, signal.SIGKILL)
        with pytest.raises(SandboxError):
            sb.step("look")
        with pytest.raises(SandboxError):  # stays an error until reset/restore
            sb.step("look")
        sb.reset("keydoor-2", 0)
        _check_result(sb.step("look"))
    finally:
        sb.close()


@pytest.mark.env
def test_a_killed_jvm_is_a_sandbox_error():
    before = _children()
    sb = make_env("twx")
    try:
        sb.reset("coin/seed=2", 0)
        jvms = [p for p in _children() - before if _comm(p) == "java"]
        assert len(jvms) == 1, f"expected this sandbox's JVM among the new children: {jvms}"
        os.kill(jvms[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _running(jvms[0]):
            assert time.monotonic() < deadline, "the killed JVM did not exit"
            time.sleep(0.05)
        with pytest.raises(SandboxError):
            sb.step("look around")
    finally:
        sb.close()  # must not raise either
        gc.collect()  # py4j's finalizers for the dead JVM run now, not inside a later test
