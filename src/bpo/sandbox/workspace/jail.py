"""Run an agent's shell command in a bubblewrap sandbox with limits.

Every command the code sandbox runs for an agent (``run``, ``test``, the grader's test run)
goes through :meth:`Jail.run`: ``bash -c COMMAND`` inside ``bwrap`` with

* **no network**: its own network namespace holding only ``lo``;
* **a read-only system**: ``/usr`` bound read-only (``/bin``, ``/lib``... are its symlinks),
  nothing else of the host: no ``/etc``, ``/home``, ``/root``, ``/work``, no other workspace;
* **one writable directory**: the workspace, at ``/workspace`` (the working directory), plus a
  private ``/tmp`` (tmpfs, which counts against the memory limit);
* **its own PID namespace** (and IPC, UTS, cgroup namespaces): host processes are invisible and
  cannot be signalled; when the command's shell exits, the kernel kills everything it left
  running in the namespace, so no process outlives the command;
* **limits**: wall time (the whole namespace is killed), CPU time (``RLIMIT_CPU``), memory and
  process count (a cgroup: v1 ``memory``/``pids`` controllers or v2 ``memory.max``/``pids.max``;
  without a writable cgroup hierarchy, ``RLIMIT_AS`` and ``RLIMIT_NPROC`` instead, and
  ``RLIMIT_NPROC`` binds only non-root users), output size (collected up to ``output_bytes``;
  a command that writes more than ``output_kill_factor`` times that is killed) and file size
  (``RLIMIT_FSIZE``).
* **Python**: the interpreter this process runs on, with only the packages named in
  ``python_packages`` (pytest and its dependencies by default) importable, bound read-only.

What it does not protect against: kernel exploits (bwrap shares the host kernel; use a VM for
hostile code); CPU contention with the host (no CPU quota, only a CPU-time limit); disk
filling through the workspace (``RLIMIT_FSIZE`` bounds one file, not their number). As root,
the sandboxed command runs as uid 0 without capabilities, so it cannot mount, ptrace or change
ownership, but files in the workspace are root's to write, as they should be.

bubblewrap is used rather than hand-written namespace code because it is the well-kept tool
for exactly this (Flatpak's sandbox); only the limits and process bookkeeping are ours.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bpo.sandbox.workspace.jail_procs import (
    Cgroup,
    cpu_exceeded,
    kill_sandbox,
    read_pids,
    running,
    sandbox_init,
)

WORKSPACE = "/workspace"
"""Where the workspace appears inside the sandbox (the command's working directory)."""
_PYROOT = "/opt/bpo-python"
PYTHON_LIB = f"{_PYROOT}/lib"
"""Where ``python_packages`` are importable from inside the sandbox (first on PYTHONPATH)."""
_PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py")


class JailError(RuntimeError):
    """The sandbox itself could not be set up (bubblewrap missing, bad workspace)."""


@dataclass(frozen=True)
class Limits:
    """What one command may use."""

    wall_s: float = 30.0
    cpu_s: int = 60
    memory_mb: int = 1024
    pids: int = 128
    output_bytes: int = 16_000
    output_kill_factor: int = 64
    """Kill a command once it has written this many times ``output_bytes``."""
    file_mb: int = 64

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "pids", "output_bytes", "file_mb"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class CommandResult:
    """What a command did."""

    returncode: int
    """The shell's exit status; -N when killed by signal N."""
    output: str
    """stdout and stderr interleaved, cut to ``Limits.output_bytes`` (see ``truncated``)."""
    truncated: bool
    timed_out: bool
    seconds: float
    limit: str | None = None
    """The limit that stopped the command: "wall", "cpu", "memory", "pids", "output", or None."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.limit is None


def _system_site_packages() -> list[str]:
    """The base interpreter's site-packages directories (hidden in the sandbox)."""
    paths = {
        sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})[key]
        for key in ("purelib", "platlib")
    }
    paths.add("/usr/lib/python3/dist-packages")  # Debian's system packages
    return sorted(p for p in paths if os.path.isdir(p))


def _package_dirs(names: Sequence[str]) -> dict[str, str]:
    """name -> directory or module file of each importable top-level package in ``names``."""
    found = {}
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        found[name] = str(origin.parent if origin.name == "__init__.py" else origin)
    return found


class Jail:
    """Runs commands in one workspace under bubblewrap. One jail per workspace; not shared
    between threads. ``close()`` removes its cgroup."""

    def __init__(
        self,
        limits: Limits | None = None,
        python_packages: Sequence[str] = _PYTEST_PACKAGES,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise JailError(
                "bubblewrap (bwrap) is not installed; the code sandbox runs every command in it. "
                "Install it: `apt-get install bubblewrap` (done by `make setup`)"
            )
        self.limits = limits or Limits()
        self._cgroup = Cgroup(self.limits.memory_mb, self.limits.pids)
        self._packages = _package_dirs(python_packages)
        self._env = dict(env or {})
        self.runs = 0

    @property
    def cgroup_limits(self) -> bool:
        """True when memory and processes are limited by a cgroup (else by rlimits)."""
        return self._cgroup.active

    def argv(self, command: str, workdir: str | os.PathLike[str]) -> list[str]:
        """The bwrap command line for ``command`` in ``workdir``."""
        work = Path(workdir)
        if not work.is_dir():
            raise JailError(f"workspace {str(work)!r} is not a directory")
        python = Path(os.path.realpath(sys.executable))
        argv = [
            self.bwrap, "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--bind", str(work), WORKSPACE, "--chdir", WORKSPACE,
            "--unshare-all", "--hostname", "sandbox",
            "--die-with-parent", "--new-session", "--clearenv",
        ]  # fmt: skip
        if not str(python).startswith("/usr/"):  # an interpreter outside /usr (pyenv, conda)
            prefix = str(Path(sys.base_prefix).resolve())
            argv += ["--ro-bind", prefix, prefix]
        for hidden in _system_site_packages():  # only python_packages are importable
            argv += ["--tmpfs", hidden]
        argv += ["--dir", f"{_PYROOT}/bin", "--symlink", str(python), f"{_PYROOT}/bin/python"]
        argv += ["--symlink", str(python), f"{_PYROOT}/bin/python3"]
        for path in sorted(self._packages.values()):
            argv += ["--ro-bind", path, f"{PYTHON_LIB}/{Path(path).name}"]
        env = {
            "PATH": f"{_PYROOT}/bin:/usr/local/bin:/usr/bin",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONPATH": PYTHON_LIB,
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "TERM": "dumb",
            **self._env,
        }
        for k, v in env.items():
            argv += ["--setenv", k, v]
        return [*argv, "/usr/bin/bash", "-c", command]

    def run(
        self, command: str, workdir: str | os.PathLike[str], *, limits: Limits | None = None
    ) -> CommandResult:
        """Run ``bash -c command`` with ``workdir`` at /workspace; never raises for anything
        the command does (a limit hit is reported in the result)."""
        lim = limits or self.limits
        if (
            limits is not None
            and self._cgroup.active
            and (limits.memory_mb != self.limits.memory_mb or limits.pids != self.limits.pids)
        ):
            raise ValueError("memory_mb and pids are per jail (its cgroup); make another Jail")
        argv = self.argv(command, workdir)
        procs = self._cgroup.procs_files()
        use_rlimits = not self._cgroup.active

        def preexec() -> None:  # in the child, before exec: join the cgroup, set rlimits
            # raw system calls only: the child of a threaded parent must not take Python-level
            # locks another thread may have held at fork (subprocess's preexec_fn warning)
            pid = str(os.getpid()).encode()
            for f in procs:
                fd = os.open(f, os.O_WRONLY)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)
            resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1))
            fsize = lim.file_mb << 20
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if use_rlimits:
                mem = lim.memory_mb << 20
                resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
                resource.setrlimit(resource.RLIMIT_NPROC, (lim.pids, lim.pids))

        oom0, forks0 = self._cgroup.counters()
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            preexec_fn=preexec, start_new_session=True,
        )  # fmt: skip
        self.runs += 1
        chunks: list[bytes] = []
        kept = total = 0
        limit: str | None = None
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        try:
            while True:
                left = lim.wall_s - (time.monotonic() - t0)
                if left <= 0:
                    limit = "wall"
                    break
                ready, _, _ = select.select([fd], [], [], min(left, 1.0))
                if not ready:
                    continue
                data = os.read(fd, 65536)
                if not data:
                    break
                total += len(data)
                if kept < lim.output_bytes:
                    chunks.append(data[: lim.output_bytes - kept])
                    kept += len(chunks[-1])
                if total > lim.output_bytes * lim.output_kill_factor:
                    limit = "output"
                    break
        finally:
            init = None
            if limit is not None or proc.poll() is None:
                init = sandbox_init(proc.pid)
                kill_sandbox(proc, init)
            proc.stdout.close()
            rc = proc.wait()
            self._wait_sandbox_gone(init)
        seconds = time.monotonic() - t0
        oom, forks = self._cgroup.counters()
        if limit is None:
            if oom > oom0:
                limit = "memory"
            elif cpu_exceeded(rc):
                limit = "cpu"
            elif forks > forks0:
                limit = "pids"
        output = b"".join(chunks).decode("utf-8", errors="replace")
        truncated = total > kept
        if truncated:
            output += f"\n[output truncated: {total} bytes, showing the first {kept}]"
        if limit is not None:
            output += f"\n[stopped: {_LIMIT_TEXT[limit].format(lim=lim)}]"
        return CommandResult(
            returncode=rc, output=output, truncated=truncated, timed_out=limit == "wall",
            seconds=seconds, limit=limit,
        )  # fmt: skip

    def _wait_sandbox_gone(self, init: tuple[int, str] | None, timeout: float = 30.0) -> None:
        """Return once no process of the last command is left. bwrap returns as soon as its
        namespace's init is killed, while the kernel is still killing the rest (a fork bomb's
        hundreds of processes take a while on a busy machine): wait for the init to finish
        exiting (it does only after every process of its namespace is reaped), and for the
        cgroup to be empty, killing anything still in it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = [pid for f in self._cgroup.procs_files() for pid in read_pids(f)]
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if not left and (init is None or not running(*init)):
                return
            time.sleep(0.01)
        warnings.warn(
            f"processes of a sandboxed command were still exiting {timeout:g} s after it was "
            "killed", RuntimeWarning, stacklevel=3,
        )  # fmt: skip

    def close(self) -> None:
        self._cgroup.close()

    def __enter__(self) -> Jail:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        cgroup = getattr(self, "_cgroup", None)
        if cgroup is not None:
            cgroup.close()


_LIMIT_TEXT = {
    "wall": "the command ran past its wall-time limit of {lim.wall_s:g} s and was killed",
    "cpu": "the command used its CPU-time limit of {lim.cpu_s} s",
    "memory": "the command went over its memory limit of {lim.memory_mb} MB and was killed",
    "pids": "the command hit its limit of {lim.pids} processes",
    "output": "the command wrote more than {lim.output_kill_factor}x the output limit and was killed",
}
