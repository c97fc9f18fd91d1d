"""The jail's process bookkeeping (:mod:`bpo.sandbox.workspace.jail`): the cgroup that holds a
command's memory and process limits and says which one it hit, and the ``/proc`` reads that
find, watch and kill the init of the command's PID namespace (the namespace dies with it)."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["Cgroup", "cpu_exceeded", "kill_sandbox", "read_pids", "running", "sandbox_init"]


class Cgroup:
    """One cgroup for a jail's commands: memory and process limits, and the counters that say
    which limit a command hit. v1 (``memory`` and ``pids`` hierarchies) or v2."""

    _counter = itertools.count()

    def __init__(self, memory_mb: int, pids: int) -> None:
        self.dirs: dict[str, Path] = {}
        name = f"bpo-jail-{os.getpid()}-{next(self._counter)}"
        root = Path("/sys/fs/cgroup")
        try:
            if (root / "cgroup.controllers").exists():  # pure v2
                d = root / _own_cgroup("") / name
                d.mkdir()
                self.dirs["v2"] = d
                (d / "memory.max").write_text(str(memory_mb << 20))
                (d / "memory.swap.max").write_text("0")
                (d / "pids.max").write_text(str(pids))
            else:
                for ctl in ("memory", "pids"):
                    d = root / ctl / _own_cgroup(ctl) / name
                    d.mkdir()
                    self.dirs[ctl] = d
                mem = self.dirs["memory"]
                (mem / "memory.limit_in_bytes").write_text(str(memory_mb << 20))
                memsw = mem / "memory.memsw.limit_in_bytes"
                if memsw.exists():
                    memsw.write_text(str(memory_mb << 20))
                (self.dirs["pids"] / "pids.max").write_text(str(pids))
        except OSError:
            self.close()
            self.dirs = {}

    @property
    def active(self) -> bool:
        return bool(self.dirs)

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def counters(self) -> tuple[int, int]:
        """(OOM kills, refused forks) so far."""
        if "v2" in self.dirs:
            d = self.dirs["v2"]
            return _field(d / "memory.events", "oom_kill"), _field(d / "pids.events", "max")
        if self.dirs:
            return (
                _field(self.dirs["memory"] / "memory.oom_control", "oom_kill"),
                _field(self.dirs["pids"] / "pids.events", "max"),
            )
        return 0, 0

    def close(self) -> None:
        for d in self.dirs.values():
            for _ in range(50):  # processes may take a moment to leave after a kill
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
        self.dirs = {}


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path in ``controller``'s hierarchy (v2: controller "")."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctls, path = line.split(":", 2)
        if (controller == "" and ctls == "") or controller in ctls.split(","):
            return path.lstrip("/")
    return ""


def _field(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def cpu_exceeded(rc: int) -> bool:
    # bash reports a child killed by SIGXCPU as 128+24; bwrap passes the status on
    return rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU)


def kill_sandbox(proc: subprocess.Popen[bytes], init: tuple[int, str] | None) -> None:
    """Kill bwrap's session and its namespace's init: the PID namespace dies with its init
    (the command runs in a session of its own, so killing bwrap's group alone leaves it to
    ``--die-with-parent``)."""
    if init is not None and running(*init):
        with contextlib.suppress(ProcessLookupError):
            os.kill(init[0], signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of process ``pid`` from /proc, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0], fields[19]


def running(pid: int, start: str) -> bool:
    """True while the process that started at ``start`` has not finished exiting (a zombie
    has; a new process with a reused pid is another one)."""
    st = _stat(pid)
    return st is not None and st[1] == start and st[0] not in ("Z", "X")


def sandbox_init(bwrap_pid: int) -> tuple[int, str] | None:
    """(pid, start time) of bwrap's child: the init of the command's PID namespace."""
    try:
        kids = Path(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children").read_text().split()
    except OSError:
        kids = []
    for kid in kids:
        st = _stat(int(kid))
        if st is not None:
            return int(kid), st[1]
    return None


def read_pids(procs_file: str) -> list[int]:
    try:
        return [int(x) for x in Path(procs_file).read_text().split()]
    except (OSError, ValueError):
        return []
