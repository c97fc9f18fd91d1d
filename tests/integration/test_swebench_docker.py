"""SWE-bench proper (issue 7, item 5): instances load from local JSON, JSON lines and parquet
exports; the Docker backend runs where a Docker engine and the instance images are present, and
is skipped with the reason where they are not (this project's CI machine has no engine and no
registry to pull the images from)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bpo.sandbox.workspace.docker import docker_available, load_swebench

# one row shaped like the Hugging Face dataset's (list fields stored as JSON text); the values
# are made up for the loader test, not a real instance
ROW = {
    "instance_id": "octo__widgets-101",
    "repo": "octo/widgets",
    "base_commit": "0" * 40,
    "problem_statement": "Widgets break when frobnicated.",
    "patch": "diff --git a/w.py b/w.py\n",
    "test_patch": "diff --git a/test_w.py b/test_w.py\n",
    "FAIL_TO_PASS": json.dumps(["test_w.py::test_frob"]),
    "PASS_TO_PASS": json.dumps(["test_w.py::test_ok", "test_w.py::test_also"]),
    "version": "1.0",
}


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_instances_load_from_local_files(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"verified{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps([ROW]))
    elif suffix == ".jsonl":
        path.write_text(json.dumps(ROW) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([ROW]), path)
    (task,) = load_swebench(path)
    assert task.FAIL_TO_PASS == ("test_w.py::test_frob",)
    assert task.PASS_TO_PASS == ("test_w.py::test_ok", "test_w.py::test_also")
    assert task.image == "swebench/sweb.eval.x86_64.octo_1776_widgets-101:latest"


def test_bad_files_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no SWE-bench file"):
        load_swebench(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"instance_id": "x"}) + "\n")
    with pytest.raises(ValueError, match="lacks SWE-bench keys"):
        load_swebench(bad)


def test_swebench_instance_in_docker() -> None:
    why = docker_available()
    if why is not None:
        pytest.skip(f"SWE-bench in Docker not run here: {why}")
    path = os.environ.get("BPO_SWEBENCH_FILE")
    if not path:
        pytest.skip("SWE-bench in Docker: set BPO_SWEBENCH_FILE to a local export of the dataset")
    from bpo.sandbox.envs.code import CodeEngine

    engine = CodeEngine(swebench_file=path)
    try:
        task = sorted(engine.tasks)[0]
        engine.reset(task, 0)
        state = engine.get_state()
        engine.step("run git status --short")
        engine.set_state(state)
        assert engine.step("submit").reward == 0.0  # the unpatched repository fails
        engine.release_state(state)
    finally:
        engine.close()
