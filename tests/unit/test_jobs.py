"""bpo compare's job runner (`bpo.jobs.Jobs`): at most `jobs` processes at once, a job waits
for the job it names, the list order is the priority, bad job lists are refused, and in one
process an interrupted run ends the list; a run whose bpo compare dies gets one SIGTERM."""

import subprocess
import sys
import time

import pytest

from bpo.jobs import Job, Jobs


def _lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("[compare]")]


def test_a_job_waits_for_the_one_it_names_and_free_processes_take_list_order(
    tmp_path, capsys
) -> None:
    flag = tmp_path / "quick 2 ran"
    wait_for_flag = ["sh", "-c", f"while [ ! -e '{flag}' ]; do sleep 0.05; done"]
    jobs = Jobs(2)
    try:
        results = jobs.map(
            [
                Job("slow", tmp_path / "slow.log", subprocess.run, (wait_for_flag,)),
                Job("after slow", tmp_path / "a.log", time.sleep, (0.0,), after="slow"),
                Job("quick 1", tmp_path / "q1.log", time.sleep, (0.0,)),
                Job("quick 2", tmp_path / "q2.log", subprocess.run, (["touch", str(flag)],)),
            ]
        )
    finally:
        jobs.close()
    assert [r.returncode for r in (results[0], results[3])] == [0, 0]
    assert results[1:3] == [None, None]
    lines = _lines(capsys.readouterr().out)
    started = [line.split("started ")[1].split(" (")[0] for line in lines if "started" in line]
    # "after slow" comes second in the list but must wait ("slow" ends only once "quick 2"
    # ran): the free process takes the next ready job in list order instead
    assert started == ["slow", "quick 1", "quick 2", "after slow"], lines
    idx = {line.split(" (")[0].removeprefix("[compare] "): i for i, line in enumerate(lines)}
    assert idx["started after slow"] > idx["finished slow"], lines
    live = peak = 0  # never more than two at once
    for line in lines:
        live += 1 if "started" in line else -1
        peak = max(peak, live)
    assert peak == 2, lines


def test_bad_job_lists_are_refused_before_any_work(tmp_path) -> None:
    jobs = Jobs(1)
    log = tmp_path / "x.log"
    seen: list[str] = []
    with pytest.raises(ValueError, match="unique"):
        jobs.map([Job("a", log, seen.append, ("a",)), Job("a", log, seen.append, ("a",))])
    with pytest.raises(ValueError, match="waits for 'b', not an earlier job"):
        jobs.map(
            [Job("a", log, seen.append, ("a",), after="b"), Job("b", log, seen.append, ("b",))]
        )
    with pytest.raises(ValueError, match="not an earlier job"):
        jobs.map([Job("a", log, seen.append, ("a",), after="missing")])
    assert seen == []


def test_one_process_runs_the_list_in_order_and_stops_at_an_interrupted_run(tmp_path) -> None:
    seen: list[str] = []

    def run(name: str) -> dict:
        seen.append(name)
        return {"interrupted": name == "c"}

    log = tmp_path / "x.log"
    jobs = [Job(n, log, run, (n,)) for n in "abcd"]
    assert [r and r["interrupted"] for r in Jobs(1).map(jobs)] == [False, False, True, None]
    assert seen == ["a", "b", "c"]


_CHILD = """
import os, signal, sys, time
from bpo.jobs import term_with_parent
terms = []
signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))
term_with_parent(os.getppid())
if sys.argv[1] == "twice":  # a second death signal that tripped Python's handler before the
    handler = signal.getsignal(signal.SIGUSR1)  # first one ran: both calls run the handler
    handler(signal.SIGUSR1, None)
    handler(signal.SIGUSR1, None)
    os.kill(os.getpid(), signal.SIGUSR1)  # and one after them
    time.sleep(0.2)
else:
    print("ready", flush=True)
    deadline = time.monotonic() + 30
    while not terms and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # time for a second SIGTERM to arrive
print("SIGTERMs", len(terms), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_run_gets_one_sigterm_however_often_the_death_signal_comes(tmp_path) -> None:
    # a second SIGTERM stops bpo train at once, without its checkpoint (CI once saw a compare
    # run die silently after "[interrupt]" when its bpo compare was killed)
    out = subprocess.run([sys.executable, "-c", _CHILD, "twice"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.stdout.split() == ["SIGTERMs", "1"], out.stdout + out.stderr

    # the real thing: the parent (with threads, as bpo compare has) dies by SIGKILL
    out_file = tmp_path / "child.out"
    parent_src = (
        "import subprocess, sys, threading, time\n"
        "for _ in range(4): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        f"subprocess.Popen([sys.executable, '-c', {_CHILD!r}, 'once'], "
        f"stdout=open({str(out_file)!r}, 'w'))\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_src])
    deadline = time.monotonic() + 60
    while "ready" not in (out_file.read_text() if out_file.exists() else ""):
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    while "SIGTERMs" not in out_file.read_text():
        assert time.monotonic() < deadline + 30, out_file.read_text()
        time.sleep(0.1)
    assert out_file.read_text().split() == ["ready", "SIGTERMs", "1"]
