"""``check_sandbox`` passes every shipped backend of the toy game and names the property that
breaks for engines with a known defect (each defect is one small change to a real engine)."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
from typing import Any

import pytest

from bpo.cli import main as bpo_main
from bpo.sandbox import (
    CheckReport,
    Observation,
    SandboxCheckError,
    StepResult,
    check_sandbox,
    list_tasks,
    make_env,
    make_sandbox,
)
from bpo.sandbox.envs.toy import KeyDoorEngine

PROPERTIES = (
    "determinism",
    "restore",
    "restore-many",
    "isolation",
    "release",
    "invalid-actions",
    "tree",
)
TASKS = ["keydoor-0", "keydoor-3", "keydoor-4"]


@pytest.mark.parametrize("backend", ["native", "replay", "pickle", "fork"])
def test_toy_passes_on_every_backend(backend):
    report = check_sandbox(lambda: make_env("toy", backend), TASKS)
    assert isinstance(report, CheckReport)
    assert tuple(p.name for p in report.properties) == PROPERTIES
    assert (report.backend, report.tasks, report.seed) == (backend, tuple(TASKS), 0)
    assert report.steps > 200 and report.snapshots >= 20 and report.restores >= 20
    assert "| tree | ok |" in report.render()
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.steps = 0  # type: ignore[misc]


# -- engines with one defect each ------------------------------------------------------------


class AliasingGetState(KeyDoorEngine):
    """get_state returns the live dict: later steps change the snapshot."""

    def get_state(self) -> dict[str, Any]:
        return self._s

    def set_state(self, state: dict[str, Any]) -> None:
        self._s = state


class AliasingSetState(KeyDoorEngine):
    """set_state adopts the snapshot's containers: the first restore is right, the next not."""

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self._s["items"] = state["items"]


class RaisesOnGarbage(KeyDoorEngine):
    def step(self, action: str) -> StepResult:
        if action.strip() and action not in self._admissible() and "\n" in action:
            raise ValueError(f"cannot parse {action!r}")
        return super().step(action)


_counter = itertools.count()


class SharedCounter(KeyDoorEngine):
    """Observations carry a module-level counter shared by every instance."""

    def step(self, action: str) -> StepResult:
        r = super().step(action)
        obs = dataclasses.replace(r.observation, text=f"{r.observation.text} [{next(_counter)}]")
        return dataclasses.replace(r, observation=obs)


class ForgetsTheTask(KeyDoorEngine):
    """Its state omits the game layout: restoring a snapshot of another task mixes them."""

    def get_state(self) -> dict[str, Any]:
        state = super().get_state()
        for key in ("task", "rooms", "key_room"):
            del state[key]
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        keep = {k: self._s[k] for k in ("task", "rooms", "key_room")}
        super().set_state(state)
        self._s.update(keep)


class LibcRand(KeyDoorEngine):
    """Noise from libc's rand(): one hidden generator per process."""

    def reset(self, task: str, seed: int) -> Observation:
        ctypes.CDLL(None).srand(seed)
        return super().reset(task, seed)

    def step(self, action: str) -> StepResult:
        r = super().step(action)
        n = ctypes.CDLL(None).rand() % 10
        obs = dataclasses.replace(r.observation, text=f"{r.observation.text} ({n})")
        return dataclasses.replace(r, observation=obs)


class NoRelease:
    """A sandbox whose release() keeps the snapshot alive."""

    def __init__(self) -> None:
        self._sb = make_env("toy")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sb, name)

    def release(self, snapshot: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("engine", "backend", "prop", "says"),
    [
        (AliasingGetState, "native", "restore", "fingerprint after restore"),
        (AliasingSetState, "native", "restore-many", "restore #2"),
        (RaisesOnGarbage, "native", "invalid-actions", "cannot parse"),
        (SharedCounter, "native", "determinism", "in two sandboxes"),
        (ForgetsTheTask, "native", "tree", "after restore"),
        (LibcRand, "pickle", "determinism", "in two sandboxes"),
    ],
)
def test_defects_are_named(engine, backend, prop, says):
    with pytest.raises(SandboxCheckError) as info:
        check_sandbox(lambda: make_sandbox(engine, backend), TASKS, stress_nodes=200)
    assert info.value.property == prop
    assert str(info.value).startswith(f"[{prop}]") and says in str(info.value)
    assert "likely cause:" in str(info.value)
    assert isinstance(info.value, AssertionError)


def test_release_defect_is_named():
    with pytest.raises(SandboxCheckError, match=r"^\[release\] live snapshots after releasing"):
        check_sandbox(NoRelease, TASKS[:1])


def test_c_library_state_passes_under_fork_only():
    report = check_sandbox(lambda: make_sandbox(LibcRand, "fork"), TASKS[:2])
    assert report.backend == "fork"


def test_cli_registered_env(capsys):
    assert bpo_main(["check-sandbox", "toy", "--tasks", "2", "--backend", "replay"]) == 0
    out = capsys.readouterr().out
    assert "backend replay, 2 task(s) (keydoor-0, keydoor-1)" in out
    assert "| restore-many | ok |" in out and out.rstrip().endswith("PASSED")
    assert list_tasks("toy", "valid")[:2] == ["keydoor-60", "keydoor-61"]


def aliasing_sandbox():
    return make_sandbox(AliasingGetState, "native")


def test_cli_module_factory(capsys):
    assert bpo_main(["check-sandbox", "bpo.sandbox.envs.toy:make", "--task", "keydoor-2"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("PASSED")
    assert bpo_main(["check-sandbox", f"{__name__}:aliasing_sandbox", "--task", "keydoor-2"]) == 1
    out = capsys.readouterr().out
    assert "FAILED [restore]" in out and "likely cause:" in out
