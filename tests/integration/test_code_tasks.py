"""The code-repair tasks: the shipped set is well formed, every task is failed by its buggy
workspace and solved by its gold patch, generation reproduces it, and bad input is refused
with the fix named."""

from __future__ import annotations

import shutil
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bpo import tasks_cli
from bpo.sandbox.envs import code_generate, code_tasks
from bpo.sandbox.envs.code_generate import failure_reports, unified_diff
from bpo.sandbox.envs.code_mutants import KINDS, mutants
from bpo.sandbox.envs.code_tasks import (
    PROJECTS,
    GenerationError,
    Task,
    judge,
    load_tasks,
    parse_summary,
    prepare_workspace,
    restore_test_files,
    run_tests,
)
from bpo.sandbox.workspace.jail import Jail, Limits

TASKS = load_tasks()
SWE_KEYS = (
    "instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch",
    "FAIL_TO_PASS", "PASS_TO_PASS",
)  # fmt: skip


def _git(workspace: Path, *args: str, stdin: str | None = None) -> str:
    return code_tasks.git(workspace, *args, stdin=stdin)


# --- the shipped set ---------------------------------------------------------------------------


def test_shipped_set_has_enough_tasks_projects_kinds_and_both_splits() -> None:
    assert len(TASKS) >= 50
    assert len({t.project for t in TASKS}) >= 3
    splits = Counter(t.split for t in TASKS)
    assert set(splits) == {"train", "test"} and splits["test"] >= 10
    assert splits["test"] >= 0.2 * len(TASKS)
    assert set(Counter(t.mutation["kind"] for t in TASKS)) == set(KINDS)
    assert len({t.instance_id for t in TASKS}) == len(TASKS)
    for t in TASKS:
        record = t.__dict__
        assert all(record[k] not in ("", []) for k in SWE_KEYS if k != "test_patch"), t
        assert t.test_patch == ""
        assert t.instance_id.startswith(f"{t.project}__{t.project}-")
        assert not set(t.FAIL_TO_PASS) & set(t.PASS_TO_PASS)
        assert 1 <= len(t.FAIL_TO_PASS) <= code_generate.MAX_FAILING
        assert t.test_command == f"{t.test_runner} {' '.join(t.test_directives)}"
        assert t.mutation["file"] not in t.test_files
        # the statement is written from the failures, not the diff
        assert t.mutation["file"] not in t.problem_statement
        assert "/workspace" not in t.problem_statement and "/tmp/" not in t.problem_statement


def test_shipped_file_is_canonical_json_lines() -> None:
    text = code_tasks.TASKS_FILE.read_text()
    assert text == "".join(t.to_json() + "\n" for t in TASKS)


def _check(task: Task, root: Path) -> list[str]:
    """Problems of one task: the HEAD, the buggy run, the gold patch's run."""
    problems = []
    ws = root / task.instance_id
    prepare_workspace(task, ws)
    if _git(ws, "rev-parse", "HEAD").strip() != task.base_commit:
        problems.append(f"{task.instance_id}: HEAD is not base_commit")
    with Jail(Limits(wall_s=120, cpu_s=240)) as jail:
        buggy = run_tests(jail, ws, task, task.FAIL_TO_PASS)
        if not any(buggy.get(n) == "failed" for n in task.FAIL_TO_PASS):
            problems.append(f"{task.instance_id}: no FAIL_TO_PASS test fails unpatched: {buggy}")
        _git(ws, "apply", "-", stdin=task.patch)
        restore_test_files(task, ws)
        if not judge(jail, ws, task):
            problems.append(f"{task.instance_id}: the gold patch does not pass judge")
    shutil.rmtree(ws)
    return problems


@pytest.mark.slow
def test_every_shipped_task_fails_unpatched_and_passes_with_its_gold_patch(
    tmp_path: Path,
) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        problems = [p for ps in pool.map(lambda t: _check(t, tmp_path), TASKS) for p in ps]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_generating_a_subset_reproduces_the_shipped_tasks(tmp_path: Path) -> None:
    """A project's first tasks come out byte-identical: the choice of mutants does not depend
    on how many are asked for (parse: the quickest suite; 4 includes a held-out task)."""
    rc = tasks_cli.main(
        ["generate", "code", "--out", str(tmp_path), "--projects", "parse", "--per-project", "4"]
    )
    assert rc == 0
    shipped = [t.to_json() + "\n" for t in TASKS if t.project == "parse"][:4]
    assert (tmp_path / "tasks.jsonl").read_text() == "".join(shipped)
    assert [t.split for t in load_tasks(tmp_path / "tasks.jsonl")][-1] == "test"


# --- grading helpers ---------------------------------------------------------------------------


def test_restore_test_files_undoes_edits_to_the_tests(tmp_path: Path) -> None:
    task = next(t for t in TASKS if t.project == "parse")
    prepare_workspace(task, tmp_path / "ws")
    ws = tmp_path / "ws"
    test_file = next(f for f in task.test_files if f.endswith(".py"))
    pristine = (ws / test_file).read_text()
    (ws / test_file).write_text("def test_nothing():\n    pass\n")
    (ws / "conftest.py").write_text("collect_ignore_glob = ['*']\n")
    restore_test_files(task, ws)
    assert (ws / test_file).read_text() == pristine
    assert not (ws / "conftest.py").exists()


def test_parse_summary_reads_parametrized_ids_and_keeps_the_worse_status() -> None:
    output = "\n".join(
        [
            "..F.E",
            "==================== short test summary info ====================",
            "PASSED tests/test_a.py::test_x[a - b]",
            "PASSED tests/test_a.py::TestC::test_y",
            "FAILED tests/test_a.py::test_z[1] - assert 1 == 2",
            "ERROR tests/test_a.py::TestC::test_y - RuntimeError: teardown",
            "XFAIL tests/test_a.py::test_w - reason",
            "SKIPPED [1] tests/test_a.py:9: no numpy",
            "1 failed, 2 passed, 1 error in 0.1s",
        ]
    )
    assert parse_summary(output) == {
        "tests/test_a.py::test_x[a - b]": "passed",
        "tests/test_a.py::TestC::test_y": "error",
        "tests/test_a.py::test_z[1]": "failed",
        "tests/test_a.py::test_w": "skipped",
    }
    assert parse_summary("PASSED tests/test_a.py::t\n") == {}  # not in a summary


def test_failure_reports_keep_test_frames_and_errors_but_not_library_frames() -> None:
    output = "\n".join(
        [
            "=========================== FAILURES ===========================",
            "_______________________ test_bump _______________________",
            "tests/test_bump.py:12: in test_bump",
            "    assert bump('1.0') == '1.1'",
            "/workspace/src/lib/version.py:40: in bump",
            "    return secret_line(0x7f00aa11bb22)",
            "E   ValueError: bad <object at 0x7f00aa11bb22>",
            "----------------------- Captured stdout call -----------------------",
            "noise",
            "==================== short test summary info ====================",
        ]
    )
    assert failure_reports(output, ["tests/test_bump.py"]) == [
        (
            "test_bump",
            [
                "tests/test_bump.py:12: in test_bump",
                "    assert bump('1.0') == '1.1'",
                "E   ValueError: bad <object at 0x...>",
            ],
        )
    ]


def test_unified_diff_applies_with_git_also_without_a_final_newline(tmp_path: Path) -> None:
    old, new = "a = 1\nb = 2\nc = 3", "a = 1\nb = 20\nc = 3"
    (tmp_path / "m.py").write_text(old)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "apply", "-", stdin=unified_diff("m.py", old, new))
    assert (tmp_path / "m.py").read_text() == new


def test_mutants_cover_the_four_kinds_with_one_span_edits() -> None:
    source = b"def f(xs, n=2, strict=False):\n    if n > 1 and xs:\n        return xs[1:] + [n]\n"
    found = {(m.kind, source[m.start : m.end].decode(), m.new) for m in mutants("m.py", source)}
    assert {
        ("operator_swap", ">", ">="),
        ("operator_swap", "and", "or"),
        ("operator_swap", "+", "-"),
        ("off_by_one", "1", "2"),
        ("off_by_one", "1", "0"),
        ("dropped_condition", "n > 1 and xs", "True"),
        ("dropped_condition", "n > 1 and ", ""),
        ("wrong_default", "2", "3"),
        ("wrong_default", "False", "True"),
    } <= found
    assert all(m.line in (1, 2, 3) and m.scope == "f" for m in mutants("m.py", source))


# --- bad input ---------------------------------------------------------------------------------


def test_unknown_project_is_refused_with_the_valid_names() -> None:
    with pytest.raises(GenerationError, match="valid projects: toolz, parse"):
        code_generate.generate(["nope"])


def test_missing_or_altered_sdist_is_refused_with_the_download_command(tmp_path: Path) -> None:
    with pytest.raises(GenerationError, match=r"not found .*pip download --no-deps"):
        code_generate.generate(["parse"], data_dir=tmp_path)
    (tmp_path / PROJECTS["parse"].sdist).write_bytes(b"not the sdist")
    with pytest.raises(GenerationError, match=r"sha256 .*pip download"):
        code_generate.generate(["parse"], data_dir=tmp_path)


def test_cli_refuses_an_unknown_family_and_project(capsys: pytest.CaptureFixture[str]) -> None:
    assert tasks_cli.main(["generate", "swe", "--out", "x"]) == 2
    assert "valid families: code" in capsys.readouterr().err
    assert tasks_cli.main(["generate", "code", "--out", "x", "--projects", "nope"]) == 2
    assert "valid projects:" in capsys.readouterr().err
