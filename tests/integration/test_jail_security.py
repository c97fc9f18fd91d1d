"""Security tests of the code sandbox's command jail (issue 7): every attempt is contained, and
recorded (the command, what the jail reported, and what the test checked) in
``security_attempts.jsonl`` in the test's temporary directory, printed on failure.

Each test runs a real hostile command in bubblewrap and checks the host afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from bpo.sandbox.workspace import Jail, Limits, open_workspace
from bpo.sandbox.workspace.jail import CommandResult

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "bwrap"], capture_output=True).returncode != 0,
    reason="bubblewrap is not installed (make setup installs it)",
)

PROJECT = Path(__file__).resolve().parents[2]
LIMITS = Limits(wall_s=8, cpu_s=4, memory_mb=256, pids=48, output_bytes=4000)


@pytest.fixture()
def record(tmp_path: Path):
    log = tmp_path / "security_attempts.jsonl"

    def write(attempt: str, command: str, res: CommandResult, contained: str) -> None:
        entry = {
            "attempt": attempt, "command": command, "returncode": res.returncode,
            "limit": res.limit, "seconds": round(res.seconds, 3), "contained": contained,
            "output": res.output[-400:],
        }  # fmt: skip
        with log.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        print(json.dumps(entry))

    return write


@pytest.fixture()
def jail():
    with Jail(LIMITS) as j:
        yield j


@pytest.fixture()
def work(tmp_path: Path) -> Path:
    w = tmp_path / "ws"
    w.mkdir()
    (w / "inside.txt").write_text("inside\n")
    return w


def _host_procs(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def test_no_network(jail: Jail, work: Path, record) -> None:
    # a server on the host's loopback: the sandbox has its own network namespace
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the socket is closed at the end of the test
            accepted.append(srv.accept())

    threading.Thread(target=accept, daemon=True).start()
    cmd = (
        'python -c "import socket\n'
        f"for host in [('127.0.0.1', {port}), ('1.1.1.1', 80), ('pypi.org', 443)]:\n"
        "    try:\n"
        "        socket.create_connection(host, timeout=2); print('CONNECTED', host)\n"
        "    except OSError as e:\n"
        "        print('refused', host, e.__class__.__name__)\"; cat /sys/class/net/*/address"
    )
    res = jail.run(cmd, work)
    srv.close()
    assert "CONNECTED" not in res.output and res.output.count("refused") == 3, res.output
    assert not accepted
    record("network", cmd, res, "no route out; host loopback unreachable")


def test_no_reads_or_writes_outside_the_workspace(
    tmp_path: Path, work: Path, jail: Jail, record
) -> None:
    other = tmp_path / "other_workspace"
    other.mkdir()
    (other / "their_secret.txt").write_text("theirs\n")
    host_file = tmp_path / "host_file.txt"
    host_file.write_text("host\n")
    cmd = (
        f"cat {PROJECT}/pyproject.toml; cat /etc/shadow; cat {other}/their_secret.txt; "
        f"cat {host_file}; ls /root /home /work; find / -name their_secret.txt 2>/dev/null; "
        f"echo pwned > {host_file}; echo pwned > /usr/pwned; echo pwned > /pwned; "
        f"echo ok > /workspace/inside.txt; echo tmp > /tmp/t && cat /tmp/t"
    )
    res = jail.run(cmd, work)
    assert "their_secret" not in res.output.replace("their_secret.txt: No such", "")
    assert "theirs" not in res.output and "[project]" not in res.output
    assert host_file.read_text() == "host\n"
    assert not Path("/usr/pwned").exists() and not Path("/pwned").exists()
    assert (work / "inside.txt").read_text() == "ok\n", "the workspace itself must be writable"
    assert "Read-only file system" in res.output
    record(
        "files outside the workspace",
        cmd,
        res,
        "host, project and other workspaces unseen; /usr read-only",
    )


def test_symlink_escape_through_the_tool_language(tmp_path: Path, record) -> None:
    """The engine reads and writes workspace files as the host: links the agent makes to host
    paths must not be followed by open/edit/create/search."""
    from bpo.sandbox.envs.code_tools import UsageError, inside

    base = tmp_path / "base"
    base.mkdir()
    (base / "a.py").write_text("x = 1\n")
    host = tmp_path / "host.txt"
    host.write_text("host secret\n")
    with open_workspace(base, "auto") as ws:
        res = ws.run(
            f"ln -s {host} abs; ln -s ../../../../../../{host} rel; mkdir d; ln -s / d/root"
        )
        root = Path(ws.path)
        for rel in ("abs", "rel", "d/root/etc/hostname", "../x", "/etc/hostname"):
            with pytest.raises(UsageError, match=r"outside the workspace|not a path inside"):
                inside(root, rel)
        assert inside(root, "a.py") == root / "a.py"
        record(
            "symlink escape via open/edit",
            "ln -s HOST abs; open abs",
            res,
            "links out of the workspace refused",
        )
    assert host.read_text() == "host secret\n"


def test_fork_bomb(jail: Jail, work: Path, record) -> None:
    # the shell exits on its own, then the bomb is killed by the wall limit: either way no
    # bomb process is left when run() returns (bwrap used to return while the kernel was still
    # killing them, and a busy CI machine saw them)
    for cmd in (":(){ :|:& };:; sleep 3; echo after-bomb", ":(){ :|:& };:; sleep 100"):
        res = jail.run(cmd, work)
        assert res.limit in ("pids", "wall"), res
        assert not _host_procs(":|:&")
        assert subprocess.run(["true"]).returncode == 0  # the host can still fork
        record("fork bomb", cmd, res, f"stopped by the {res.limit} limit")


def test_memory_hog(jail: Jail, work: Path, record) -> None:
    cmd = "python -c \"x = bytearray(2 << 30); print('allocated')\""
    res = jail.run(cmd, work)
    assert "allocated" not in res.output
    assert res.limit == "memory" or "MemoryError" in res.output, res
    record("memory hog", cmd, res, "killed or refused at the memory limit")


def test_endless_loop(jail: Jail, work: Path, record) -> None:
    for cmd in ("while true; do :; done", "sleep 100000"):
        t0 = time.monotonic()
        res = jail.run(cmd, work)
        assert res.limit in ("cpu", "wall"), res
        assert time.monotonic() - t0 < LIMITS.wall_s + 5
        record("endless loop", cmd, res, f"stopped by the {res.limit} limit")


def test_huge_output(jail: Jail, work: Path, record) -> None:
    cmd = "yes this-is-a-lot-of-output"
    res = jail.run(cmd, work)
    assert res.limit == "output" and res.truncated
    assert len(res.output) < LIMITS.output_bytes + 500
    record("huge output", cmd, res, "cut to the output limit, command killed")
    cmd = "head -c 200M /dev/zero > big.bin; ls -l big.bin"
    res = jail.run(cmd, work)
    assert (work / "big.bin").stat().st_size <= LIMITS.file_mb << 20
    record("huge file", cmd, res, "file size limit")


def test_cannot_kill_processes_outside(jail: Jail, work: Path, record) -> None:
    victim = subprocess.Popen(["sleep", "300.4242"])
    try:
        cmd = f"kill -9 {victim.pid}; kill -9 -1; pkill -9 sleep; kill -9 1; echo still-here"
        res = jail.run(cmd, work)
        time.sleep(0.2)
        assert victim.poll() is None, "a host process was killed from the sandbox"
        assert os.getpid() in [int(p) for p in os.listdir("/proc") if p.isdigit()]
        record("kill outside", cmd, res, "host processes invisible (own PID namespace)")
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()


def test_no_process_outlives_its_command(jail: Jail, work: Path, record) -> None:
    cmd = (
        "sleep 777.31 & disown; nohup sleep 777.32 >/dev/null 2>&1 & "
        "setsid sleep 777.33 & (sleep 777.34 &) ; echo started"
    )
    res = jail.run(cmd, work)
    assert res.ok and "started" in res.output
    deadline = time.monotonic() + 5
    while _host_procs("sleep 777.3") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _host_procs("sleep 777.3"), "a background process survived its command"
    record("leftover process", cmd, res, "the PID namespace dies with the command")


def test_jail_removes_its_cgroup(work: Path) -> None:
    j = Jail(LIMITS)
    dirs = list(j._cgroup.dirs.values())
    j.run("true", work)
    j.close()
    assert all(not d.exists() for d in dirs)
