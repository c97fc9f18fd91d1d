"""The code sandbox: its contract (check_sandbox on both workspace kinds), the tool language,
the grader (gold patch through the tools passes, the buggy checkout and edited tests do not),
and escapes through the tools."""

from __future__ import annotations

import os

import pytest

from bpo.sandbox import check_sandbox
from bpo.sandbox.envs import code
from bpo.sandbox.envs.code import CodeEngine
from bpo.sandbox.workspace import overlay_supported

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _first_per_project(split: str) -> list[str]:
    seen: dict[str, str] = {}
    for tid in code.tasks(split):
        seen.setdefault(code.task_index()[tid].project, tid)
    return sorted(seen.values())


TASK = _first_per_project("train")[0]


@pytest.fixture()
def engine():
    e = CodeEngine(window=10, max_obs_chars=3000)
    yield e
    e.close()


def test_shipped_tasks_have_both_splits():
    assert code.tasks("train") and code.tasks("test")
    assert not set(code.tasks("train")) & set(code.tasks("test"))
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        code.tasks("valid")


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(
            "overlay", marks=pytest.mark.skipif(not overlay_supported(), reason="needs root")
        ),
        "tar",
    ],
)
def test_check_sandbox_passes(kind):
    tasks = _first_per_project("train")[:2] if kind == "overlay" else [TASK]
    report = check_sandbox(
        lambda: code.make(workspace=kind, max_steps=8), tasks, max_steps=6, stress_nodes=10
    )
    assert len(report.properties) == 7


def test_expert_solves_and_buggy_submit_fails(engine):
    engine.reset(TASK, 0)
    s = engine.get_state()
    res = engine.step("submit")
    assert res.terminated and res.reward == 0.0 and "still fail" in res.observation.text
    engine.set_state(s)
    actions = []
    for _ in range(20):
        a = engine.expert_action()
        actions.append(a.split("\n")[0])
        res = engine.step(a)
        if res.terminated:
            break
    assert res.reward == 1.0, (actions, res.observation.text)
    assert actions[0].startswith("open ") and actions[-1] == "submit"
    assert engine.expert_action() is None
    engine.release_state(s)


def test_editing_the_tests_does_not_pass(engine):
    engine.reset(TASK, 0)
    task = code.task_index()[TASK]
    failing = task.FAIL_TO_PASS[0].split("::")[0]
    # replace the failing test file by one that passes trivially, and add a conftest that
    # would skip everything: the grader restores the tests first
    engine.step(f"create {failing}\ndef test_ok():\n    assert True\n")
    engine.step("create conftest.py\nimport pytest\ncollect_ignore_glob = ['*']\n")
    res = engine.step("submit")
    assert res.reward == 0.0


def test_tool_language(engine):
    obs = engine.reset(TASK, 0)
    assert "submit" in obs.text and obs.instruction
    task = code.task_index()[TASK]
    rel = next(iter(code.gold_files(task)))
    text = engine.step(f"open {rel}").observation.text
    assert text.startswith(f"[File: {rel}") and "1:" in text and "more lines below" in text
    assert "more lines above" in engine.step("scroll_down").observation.text
    assert "11:" in engine.step("goto 15").observation.text
    # edit: replace, insert, and a syntax error that is refused
    engine.step(f"edit {rel} 1:0\n# inserted by the test\nend_of_edit")
    assert (code.Path(engine._ws.path) / rel).read_text().startswith("# inserted by the test\n")
    bad = engine.step(f"edit {rel} 1:1\ndef (:\n").observation.text
    assert "not applied" in bad and "invalid Python" in bad
    assert (code.Path(engine._ws.path) / rel).read_text().startswith("# inserted by the test\n")
    assert "matches for" in engine.step(f"search def {rel}").observation.text
    assert "No matches" in engine.step('search "zz_not_there_zz"').observation.text
    assert "Created notes/a.txt" in engine.step("create notes/a.txt\nhello").observation.text
    assert engine.step("run cat notes/a.txt").observation.text == "hello"
    assert "(exit code 3)" in engine.step("run exit 3").observation.text
    out = engine.step("test").observation.text
    assert "failed" in out and " in 0." not in out  # durations removed: deterministic text
    for bad_action, says in [
        ("frobnicate now", "Unknown command"),
        ("open", "Usage: open"),
        ("edit 5", "Usage: edit"),
        (f"edit {rel} 10:2\nx", "are not in"),
        ("open ../../etc/passwd", "inside the workspace"),
        ("open /etc/passwd", "not a path inside"),
        ("open no/such/file.py", "No file"),
        ("run", "Usage: run"),
        (f"create {rel}/inside.txt\nx", "create failed"),
    ]:
        assert says in engine.step(bad_action).observation.text, bad_action


def test_links_out_of_the_workspace_are_not_followed(engine, tmp_path):
    secret = tmp_path / "host_secret.txt"
    secret.write_text("host secret\n")
    engine.reset(TASK, 0)
    engine.step(f"run ln -s {secret} leak; mkdir -p d; ln -s / d/root")
    for action in (
        "open leak",
        "open d/root/etc/hostname",
        "create leak\npwned",
        "edit leak 1:1\nx",
    ):
        text = engine.step(action).observation.text
        assert "outside the workspace" in text, (action, text)
    assert "host secret" not in engine.step("search secret").observation.text
    assert secret.read_text() == "host secret\n"


def test_steps_run_out(engine):
    e = CodeEngine(max_steps=2)
    try:
        e.reset(TASK, 0)
        assert not e.step("scroll_up").truncated
        res = e.step("scroll_up")
        assert res.truncated and res.observation.done
    finally:
        e.close()


def test_bad_options_are_clear():
    with pytest.raises(ValueError, match="backends auto, native and replay"):
        code.make(backend="fork")
    e = CodeEngine()
    with pytest.raises(ValueError, match="unknown code task"):
        e.reset("nope__nope-0000", 0)
    e.close()


def test_fake_pytest_and_hooks_in_the_workspace_do_not_fool_the_grader(engine):
    engine.reset(TASK, 0)
    task = code.task_index()[TASK]
    fake = "".join(f"print('PASSED {t}')\n" for t in task.FAIL_TO_PASS + task.PASS_TO_PASS)
    summary = "print('=' * 10 + ' short test summary info ' + '=' * 10)\n"
    for name in ("pytest.py", "sitecustomize.py", "usercustomize.py"):
        engine.step(f"create {name}\n{summary}{fake}raise SystemExit(0)\n")
    res = engine.step("submit")
    assert res.reward == 0.0, res.observation.text


def test_restoring_tests_does_not_follow_a_linked_test_directory(engine, tmp_path):
    host_dir = tmp_path / "host_dir"
    host_dir.mkdir()
    engine.reset(TASK, 0)
    test_dir = code.task_index()[TASK].FAIL_TO_PASS[0].split("/")[0]
    engine.step(f"run rm -rf {test_dir} && ln -s {host_dir} {test_dir}")
    engine.step("submit")
    assert list(host_dir.iterdir()) == [], "the grader wrote test files into a host directory"
