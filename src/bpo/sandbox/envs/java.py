"""The JVM behind the Java-based environments (ScienceWorld, TextWorld-Express).

Both libraries start their simulator with py4j's ``launch_gateway`` and offer no way to pass
JVM flags. :class:`Jvm` does the same launch with the flags this project needs:

* ``-XX:+UnlockExperimentalVMOptions -XX:hashCode=2`` makes ``Object.hashCode`` a constant,
  so hash-ordered collections iterate in the same order in every JVM and after every reload.
  Without it ScienceWorld is not deterministic across reloads (MACHINE.md), which the replay
  snapshot backend depends on. It costs about 20% of step speed (MACHINE.md).
* ``-Xmx1g -XX:+UseSerialGC`` keep each JVM near 300-500 MB resident (the default G1
  collector let a ScienceWorld JVM grow to 820-940 MB over three gold paths; serial: 465 MB,
  same speed) and add no GC threads on a small machine.

A missing runtime is reported by :func:`find_java` with the package to install.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Sequence
from typing import Any

from bpo.sandbox.protocol import SandboxError

JAVA_INSTALL_HINT = (
    "install a Java runtime (8 or newer; 17 is tested), e.g. `apt-get install "
    "openjdk-17-jre-headless` on Debian/Ubuntu (`dnf install java-17-openjdk-headless` on "
    "Fedora, `brew install openjdk@17` on macOS), or point JAVA_HOME at an existing one"
)

DETERMINISTIC_HASH_OPTS: tuple[str, ...] = ("-XX:+UnlockExperimentalVMOptions", "-XX:hashCode=2")


class JavaNotFoundError(SandboxError):
    """No Java runtime was found; the message says which package to install."""


def find_java() -> str:
    """Path of the ``java`` executable: ``$JAVA_HOME/bin/java`` if it exists, else ``java`` on
    PATH. Raises :class:`JavaNotFoundError` naming the package to install."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = os.path.join(java_home, "bin", "java")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("java")
    if found:
        return found
    where = f"JAVA_HOME={java_home!r} has no bin/java and " if java_home else ""
    raise JavaNotFoundError(
        f"this environment runs on the Java VM, but {where}no `java` is on PATH; {JAVA_INSTALL_HINT}"
    )


def java_text(text: str) -> str:
    """``text`` as py4j can send it: py4j encodes strings as UTF-8, which cannot carry lone
    surrogates (a ``str`` may hold them), and the failed send would turn a malformed action
    into an error instead of an observation. Surrogate pairs are joined, lone ones become
    U+FFFD."""
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def check_backend(backend: str) -> None:
    """Reject snapshot backends that cannot hold a JVM's state: "fork" would share one JVM
    between frozen copies of the engine process, "pickle" cannot pickle a JVM, and these
    engines have no native state. "auto" means replay for them."""
    if backend not in ("auto", "replay"):
        raise ValueError(
            f"backend {backend!r} cannot snapshot an engine that runs in a JVM; use 'replay' "
            "(or 'auto', which picks it): reset + replay of the action prefix, verified"
        )


class Jvm:
    """One JVM process running a py4j gateway; ``jvm`` is py4j's view of its classes.

    Close it explicitly (:meth:`close`); a finalizer closes it when it is garbage-collected,
    and the JVM also exits by itself when this Python process dies.
    """

    def __init__(
        self,
        classpath: str,
        *,
        cwd: str | None = None,
        heap: str = "1g",
        deterministic_hash: bool = True,
        extra_opts: Sequence[str] = (),
    ) -> None:
        from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway

        java = find_java()
        opts = [f"-Xmx{heap}", "-XX:+UseSerialGC",
                *(DETERMINISTIC_HASH_OPTS if deterministic_hash else ()), *extra_opts]
        self.command = [java, *opts, "-cp", classpath]
        # the JVM's stderr goes to an unlinked file: readable here if the start fails
        with tempfile.TemporaryFile() as stderr:
            try:
                port, proc = launch_gateway(
                    classpath=classpath, javaopts=opts, java_path=java, die_on_exit=True,
                    cwd=cwd, redirect_stderr=stderr, return_proc=True,
                    create_new_process_group=True,  # a terminal's Ctrl-C goes to bpo only
                )
            except (OSError, ValueError) as err:  # ValueError: no port printed (JVM died)
                stderr.seek(0)
                tail = " ".join(stderr.read()[-2000:].decode(errors="replace").split())
                raise SandboxError(
                    f"the JVM did not start ({' '.join(self.command)})"
                    + (f"; it said: {tail}" if tail else ""),
                    err,
                ) from err
        self._proc: subprocess.Popen[bytes] = proc
        self._gateway = JavaGateway(
            gateway_parameters=GatewayParameters(auto_field=True, port=port), java_process=proc
        )
        self._finalizer = weakref.finalize(self, _shutdown, self._gateway, proc)

    @property
    def jvm(self) -> Any:
        """py4j's JVM view: ``jvm.some.package.Class()`` instantiates a Java object."""
        return self._gateway.jvm

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and self._proc.poll() is None

    def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` for a Java method ``fn``; py4j errors become :class:`SandboxError`
        (saying whether the JVM has exited)."""
        from py4j.protocol import Py4JError

        try:
            return fn(*args)
        except Py4JError as err:
            state = "has exited" if self._proc.poll() is not None else "is running"
            raise SandboxError(f"a call into the JVM failed (the JVM {state})", err) from err

    def close(self) -> None:
        """Shut the gateway down and wait for the JVM to exit (idempotent)."""
        self._finalizer()


def _shutdown(gateway: Any, proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(Exception):  # the JVM may already be gone; closing must not raise
        gateway.shutdown()
    if proc.poll() is None and proc.stdin is not None:
        # py4j's --die-on-broken-pipe server exits on a newline / closed stdin
        with contextlib.suppress(OSError):
            proc.stdin.write(b"\n")
            proc.stdin.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
