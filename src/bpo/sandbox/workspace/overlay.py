"""Exact workspace snapshots as an overlayfs layer stack.

The workspace is an overlay mount: read-only lower layers (the task's prepared checkout at the
bottom) and one writable upper layer. A snapshot freezes the upper layer (unmount, push it onto
the stack as a new lower layer, mount again with a fresh upper): two system calls and two
``mkdir``s, independent of the workspace's size, and the snapshot holds only the files changed
since the previous one. A restore mounts the snapshot's stack under a fresh empty upper, so one
snapshot restores any number of times. Layers are reference-counted by the live snapshots and
the current stack, and deleted when the last reference goes. Before the stack reaches
``max_depth`` layers (the kernel's limit is 500 lower layers, and the mount options must fit in
one page), the next snapshot merges it into one layer with a full copy.

Overlayfs keeps content, modes, ownership, timestamps, symlinks, hard links, empty directories
and the repository's ``.git`` exactly (``redirect_dir=on`` makes directory renames exact).

The mounts live in a private mount namespace owned by a small server process (:func:`serve`): when that process exits, for whatever reason,
the kernel takes the mounts with it, and the server deletes its layer directory when its
client goes away, so a killed trainer leaves neither mounts nor layers behind. The client reads
and writes files through ``/proc/<server>/root/...``, the server's view of the filesystem, and
asks the server to run commands (in a :class:`~bpo.sandbox.workspace.jail.Jail`, inside the
namespace). Mounting overlayfs needs root here; :class:`~bpo.sandbox.workspace.tarball.TarWorkspace`
is the portable fallback.

Overlayfs and mount(2) are used directly, through ctypes, because no maintained Python library
wraps them, and the ``mount`` command costs 15-30 ms per call where the system call costs
about 2 ms (MACHINE.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from bpo.sandbox.workspace.jail import CommandResult, Jail, Limits

_CLONE_NEWNS = 0x00020000
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MNT_DETACH = 2


class WorkspaceError(RuntimeError):
    """The workspace server failed (mount, layer, or the server process itself)."""


@dataclass(frozen=True)
class LayerState:
    """A snapshot: the layer stack, top first. Opaque to callers."""

    layers: tuple[str, ...]
    nbytes: int = 0


_C = TypeVar("_C", bound="Closing")


class Closing:
    """``with`` support and a last-resort ``close()`` on garbage collection, for workspaces
    (the subclass sets ``_closed = False`` once it holds something to close)."""

    _closed = True

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not self._closed:
            self.close()


def overlay_supported() -> bool:
    """True when this process may mount overlayfs (root, and overlay in /proc/filesystems)."""
    try:
        has_fs = "overlay" in Path("/proc/filesystems").read_text()
    except OSError:
        return False
    return has_fs and os.geteuid() == 0 and shutil.which("bwrap") is not None


# ---------------------------------------------------------------------------------------------
# client


class OverlayWorkspace(Closing):
    """A workspace whose snapshots are overlay layer stacks (see the module docstring)."""

    kind = "overlay"

    def __init__(
        self, base: str | os.PathLike[str], limits: Limits | None = None, max_depth: int = 48
    ) -> None:
        base = Path(base).resolve()
        if not base.is_dir():
            raise WorkspaceError(f"workspace base {str(base)!r} is not a directory")
        if not overlay_supported():
            raise WorkspaceError(
                "overlay workspaces need root, overlayfs and bubblewrap; use the tar backend "
                "(sandbox.workspace=tar)"
            )
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from bpo.sandbox.workspace.overlay import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._closed = False
        root = self._call("init", str(base), limits or Limits(), max_depth)
        self.path = Path(f"/proc/{self._proc.pid}/root{root}/merged")
        """Where this process reads and writes the workspace's files."""

    def run(self, command: str, limits: Limits | None = None) -> CommandResult:
        return self._call("run", command, limits)

    def snapshot(self) -> LayerState:
        return self._call("snapshot")

    def restore(self, state: LayerState) -> None:
        self._call("restore", state)

    def release(self, state: LayerState) -> None:
        self._call("release", state)

    def info(self) -> dict[str, Any]:
        """Counters: layers on disk, live snapshot references, merges, bytes in layers."""
        return self._call("info")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._proc.poll() is None:
                self._call("close")
        except WorkspaceError:
            pass
        finally:
            for f in (self._proc.stdin, self._proc.stdout):
                if f is not None:
                    f.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def _call(self, op: str, *args: Any) -> Any:
        if self._closed and op != "close":
            raise WorkspaceError("the workspace is closed")
        with self._lock:
            try:
                assert self._proc.stdin is not None and self._proc.stdout is not None
                _send(self._proc.stdin, (op, args))
                ok, value = _recv(self._proc.stdout)
            except (OSError, EOFError, struct.error) as e:
                code = self._proc.poll()
                raise WorkspaceError(
                    f"the overlay workspace server died during {op!r} (exit code {code})"
                ) from e
        if not ok:
            raise WorkspaceError(f"overlay workspace {op} failed: {value}")
        return value


def _send(f: BinaryIO, obj: object) -> None:
    blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(struct.pack("<Q", len(blob)) + blob)
    f.flush()


def _recv(f: BinaryIO) -> Any:
    head = f.read(8)
    if len(head) < 8:
        raise EOFError("the other side closed the pipe")
    (n,) = struct.unpack("<Q", head)
    blob = f.read(n)
    if len(blob) < n:
        raise EOFError("the other side closed the pipe")
    return pickle.loads(blob)


# ---------------------------------------------------------------------------------------------
# server (runs in its own process and mount namespace)


class _Server:
    def __init__(self, base: str, limits: Limits, max_depth: int) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        if self.libc.unshare(_CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
        # mounts made here must not propagate to the host's namespace
        self._sys(self.libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount /")
        self.root = Path(tempfile.mkdtemp(prefix="bw", dir="/tmp"))  # short: options fit a page
        self.merged = self.root / "merged"
        self.merged.mkdir()
        self.base = base
        self.max_depth = max_depth
        self.jail = Jail(limits)
        self.refs: Counter[str] = Counter()  # layer -> live snapshot references
        self.serial = 0
        self.stack: tuple[str, ...] = ()  # lower layers, top first (self.base last)
        self.upper = ""
        self.merges = 0
        self._new_upper()
        self._mount()

    # -- layers --------------------------------------------------------------------------
    def _sys(self, rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def _new_upper(self) -> None:
        self.serial += 1
        self.upper = str(self.root / str(self.serial))
        os.mkdir(self.upper)
        os.mkdir(self.upper + "w")  # overlay's work directory, beside its upper
        # the mount's root directory is the upper's: give it the attributes the workspace's
        # root has in the top layer (its mode, owner and times are part of the state)
        st = os.stat(self.stack[0] if self.stack else self.base)
        os.chown(self.upper, st.st_uid, st.st_gid)
        os.chmod(self.upper, st.st_mode & 0o7777)
        os.utime(self.upper, ns=(st.st_atime_ns, st.st_mtime_ns))

    def _mount(self) -> None:
        lower = ":".join((*self.stack, self.base))
        opts = (
            f"lowerdir={lower},upperdir={self.upper},workdir={self.upper}w,"
            "redirect_dir=on,index=off,metacopy=off"
        )
        if len(opts) >= 4000:
            raise OSError(f"overlay options too long ({len(opts)} bytes); lower max_depth")
        self._sys(
            self.libc.mount(b"overlay", bytes(self.merged), b"overlay", 0, opts.encode()),
            "mount overlay",
        )

    def _umount(self) -> None:
        self._sys(self.libc.umount2(bytes(self.merged), 0), "umount overlay")

    def _drop(self, layer: str) -> None:
        shutil.rmtree(layer, ignore_errors=True)
        shutil.rmtree(layer + "w", ignore_errors=True)

    def _collect(self, layers: tuple[str, ...]) -> None:
        for layer in layers:
            if self.refs[layer] <= 0 and layer not in self.stack:
                del self.refs[layer]
                self._drop(layer)

    # -- operations ----------------------------------------------------------------------
    def snapshot(self) -> LayerState:
        if self._changed():
            self._umount()
            frozen = self.upper
            shutil.rmtree(frozen + "w", ignore_errors=True)
            self.stack = (frozen, *self.stack)
            self._new_upper()
            if len(self.stack) >= self.max_depth:
                self._mount()
                self._merge()
            else:
                self._mount()
        nbytes = _tree_bytes(self.stack[0]) if self.stack else 0
        for layer in self.stack:
            self.refs[layer] += 1
        return LayerState(self.stack, nbytes)

    def _changed(self) -> bool:
        """Anything written since the last freeze: entries in the upper layer, or the root
        directory's own attributes (``chmod .``, a file created and removed)."""
        if any(os.scandir(self.upper)):
            return True
        a, b = os.stat(self.upper), os.stat(self.stack[0] if self.stack else self.base)
        return (a.st_mode, a.st_uid, a.st_gid, a.st_mtime_ns) != (
            b.st_mode, b.st_uid, b.st_gid, b.st_mtime_ns,
        )  # fmt: skip

    def _merge(self) -> None:
        """Replace the stack by one layer holding the merged view (a full copy)."""
        self.serial += 1
        merged_layer = str(self.root / str(self.serial))
        # cp -a keeps modes, timestamps, symlinks, hard links and empty directories
        subprocess.run(["cp", "-a", "--", f"{self.merged}/.", merged_layer], check=True)
        old = self.stack
        self._umount()
        self.stack = (merged_layer,)
        self._drop(self.upper)
        self._new_upper()
        self._mount()
        self.merges += 1
        self._collect(old)

    def restore(self, state: LayerState) -> None:
        if any(self.refs[layer] <= 0 for layer in state.layers):
            raise ValueError("snapshot layers were released")
        self._umount()
        old, old_upper = self.stack, self.upper
        self.stack = state.layers
        self._new_upper()
        self._mount()
        self._drop(old_upper)
        self._collect(old)

    def release(self, state: LayerState) -> None:
        for layer in state.layers:
            if self.refs[layer] <= 0:
                raise ValueError("snapshot already released")
        for layer in state.layers:
            self.refs[layer] -= 1
        self._collect(state.layers)

    def run(self, command: str, limits: Limits | None) -> CommandResult:
        return self.jail.run(command, self.merged, limits=limits)

    def info(self) -> dict[str, Any]:
        layers = [p for p in self.root.iterdir() if p.name.isdigit()]
        return {
            "layers": len(layers),
            "depth": len(self.stack),
            "live_refs": sum(self.refs.values()),
            "merges": self.merges,
            "layer_bytes": sum(_tree_bytes(str(p)) for p in layers),
        }

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._umount()
        self.jail.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def serve() -> None:
    """The server's main loop (stdin: requests, stdout: replies), until its client goes."""
    # the reply pipe moves off fd 1, so that nothing else (a child, C code) can write into it
    inp, out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    server: _Server | None = None
    try:
        while True:
            try:
                op, args = _recv(inp)
            except EOFError:
                return  # the client is gone: clean up (finally) and exit
            try:
                if op == "init":
                    server = _Server(*args)
                    value: Any = str(server.root)
                elif server is None:
                    raise RuntimeError("the server was not initialised")
                elif op == "close":
                    _send(out, (True, None))
                    return
                else:
                    value = getattr(server, op)(*args)
                reply = (True, value)
            except Exception as e:  # reported to the client, which raises WorkspaceError
                reply = (False, f"{type(e).__name__}: {e}")
            _send(out, reply)
    finally:
        if server is not None:
            server.close()
