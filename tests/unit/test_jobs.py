"""bpo compare's job runner (`bpo.jobs.Jobs`): at most `jobs` processes at once, a call waits
for the call it names, the list order is the priority, and bad call lists are refused."""

import subprocess
import time

import pytest

from bpo.jobs import Jobs


def _lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("[compare]")]


def test_a_call_waits_for_the_one_it_names_and_free_processes_take_list_order(
    tmp_path, capsys
) -> None:
    flag = tmp_path / "quick 2 ran"
    wait_for_flag = ["sh", "-c", f"while [ ! -e '{flag}' ]; do sleep 0.05; done"]
    jobs = Jobs(2)
    try:
        calls = [
            ("slow", tmp_path / "slow.log", subprocess.run, (wait_for_flag,)),
            ("after slow", tmp_path / "a.log", time.sleep, (0.0,), "slow"),
            ("quick 1", tmp_path / "q1.log", time.sleep, (0.0,)),
            ("quick 2", tmp_path / "q2.log", subprocess.run, (["touch", str(flag)],)),
        ]
        results = jobs.map(calls)
    finally:
        jobs.close()
    assert [r.returncode for r in (results[0], results[3])] == [0, 0]
    assert results[1:3] == [None, None]
    lines = _lines(capsys.readouterr().out)
    started = [line.split("started ")[1].split(" (")[0] for line in lines if "started" in line]
    # "after slow" comes second in the list but must wait ("slow" ends only once "quick 2"
    # ran): the free process takes the next ready call in list order instead
    assert started == ["slow", "quick 1", "quick 2", "after slow"], lines
    idx = {line.split(" (")[0].removeprefix("[compare] "): i for i, line in enumerate(lines)}
    assert idx["started after slow"] > idx["finished slow"], lines
    assert not any("started" in line for line in lines[: idx["started slow"]])
    # never more than two at once
    live = peak = 0
    for line in lines:
        live += 1 if "started" in line else -1
        peak = max(peak, live)
    assert peak == 2, lines


def test_bad_call_lists_are_refused_before_any_work(tmp_path) -> None:
    jobs = Jobs(1)
    log = tmp_path / "x.log"
    with pytest.raises(ValueError, match="unique"):
        jobs.map([("a", log, time.sleep, (0,)), ("a", log, time.sleep, (0,))])
    with pytest.raises(ValueError, match="waits for 'b', not an earlier job"):
        jobs.map([("a", log, time.sleep, (0,), "b"), ("b", log, time.sleep, (0,))])
    with pytest.raises(ValueError, match="not an earlier job"):
        jobs.map([("a", log, time.sleep, (0,), "missing")])


def test_one_job_runs_the_calls_here_in_list_order(tmp_path) -> None:
    seen: list[str] = []
    calls = [(c, tmp_path / "x.log", seen.append, (c,)) for c in "abc"]
    calls.append(("d", tmp_path / "x.log", seen.append, ("d",), "a"))
    assert Jobs(1).map(calls) == [None] * 4
    assert seen == ["a", "b", "c", "d"]
